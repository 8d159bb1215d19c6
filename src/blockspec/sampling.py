"""Logits -> the processed distribution actually sampled from, identical for draft and target.

Verification is lossless relative to what it is handed: the same temperature, top-k and top-p must shape
the draft's and the target's distributions, and the verifier must see exactly the rows the draft sampled
from. Everything here runs in float32 whatever the model's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch

from .verify.base import argmax, row_chunks

MIN_TEMPERATURE = 1e-4  # below it logits / temperature overflow float32 (inf, then NaN): use 0 for greedy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy (argmax), verified by the greedy rule
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the smallest most-likely set with at least this mass (1: all)

    def __post_init__(self):
        if not is_number(self.temperature) or not (
            self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf
        ):
            raise ValueError(
                f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got "
                f"{self.temperature!r}: use 0 for greedy decoding"
            )
        if not (is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        object.__setattr__(self, "top_k", int(self.top_k))  # a NumPy integer is stored as Python's
        if not (is_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def is_int(value) -> bool:
    """An integer (Python's or NumPy's), not a bool (True would pass as 1) nor a float."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_number(value) -> bool:
    """A real number, not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)


class NonFiniteLogitsError(ValueError):
    """A model returned NaN or inf logits: sampling from them would emit garbage that looks like output."""


# Options that change the next-token law depending on the generated text in ways the engine does not apply to
# both models identically; accepting and ignoring them would silently change the output distribution.
UNSUPPORTED = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "min_p",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "logits_processor",
    "num_beams",
    "min_new_tokens",
    "suppress_tokens",
    "sequence_bias",
    "guidance_scale",
)


def check_unsupported(options: dict) -> None:
    """Refuse, with a clear message, generation options that cannot be kept lossless."""
    for name in options:
        if name in UNSUPPORTED:
            raise ValueError(
                f"{name} is not supported: blockspec only applies temperature, top_k and top_p, which it applies "
                "identically to draft and target so that the output law stays exactly the target's"
            )
        raise TypeError(f"generate() got an unexpected keyword argument {name!r}")


def process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Processed probabilities [..., V] float32 from logits [..., V] of any float dtype.

    Temperature 0 gives the one-hot argmax (ties to the lowest id). top-p keeps every token whose probability
    is at least that of the last token of the smallest most-likely prefix reaching ``top_p`` (so exact ties
    at the boundary are all kept: a deterministic rule, the same for both models).
    Raises NonFiniteLogitsError if any logit is NaN or +-inf (a -inf row entry is fine where a finite one is
    left): argmax and softmax would otherwise turn such rows into confident garbage.
    """
    shape = logits.shape
    if params.greedy:
        # argmax, like max, takes a NaN or +inf where a row has one, and a row of -inf has a -inf peak: the peak's
        # own logit tells what check_finite would, without a second pass over the vocabulary
        top = argmax(logits)[..., None]
        _raise_if_not_finite(logits.gather(-1, top).squeeze(-1).float())
        return torch.zeros(shape, dtype=torch.float32, device=logits.device).scatter_(-1, top, 1.0)
    given, logits = logits, logits.reshape(-1, shape[-1])
    parts = []
    for rows in row_chunks(*logits.shape):
        scaled = logits[rows].float()  # float32 logits themselves: every step below makes a new tensor
        if params.temperature != 1:
            scaled = scaled / params.temperature
        if 0 < params.top_k < scaled.shape[-1]:
            kth = scaled.topk(params.top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        parts.append(scaled.softmax(-1))
        check_softmax(parts[-1], given, params.temperature)
        if params.top_p < 1:
            parts[-1] = _top_p(parts[-1], params.top_p)
    if not parts:  # no rows
        return torch.empty(shape, dtype=torch.float32, device=logits.device)
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(shape)  # one chunk: no copy


def check_softmax(probs: torch.Tensor, logits: torch.Tensor, temperature: float) -> None:
    """NonFiniteLogitsError if a row of ``probs`` [..., V], softmax of some rows of ``logits`` / ``temperature``,
    came from non-finite logits, naming the first such row of ``logits`` (``check_finite``). A NaN or +inf logit, a
    row of -inf and logits / temperature that overflow are what make softmax's peak non-finite, which turns every
    entry of the row NaN; finite rows give no NaN. So one entry per row tells, without a pass over the vocabulary."""
    if bool(probs[..., 0].isnan().any()):
        check_finite(logits, temperature)


def check_finite(logits: torch.Tensor, temperature: float) -> None:
    """One reduction over ``logits`` [..., V]: a row's maximum is NaN if any entry is (max propagates NaN), +inf
    if any entry is, and -inf only if every entry is; a finite maximum leaves -inf entries (masked tokens)
    harmless. Divided by the ``temperature``, it also catches the row whose logits / temperature would overflow."""
    _raise_if_not_finite(logits.amax(-1).float() / temperature)


def _raise_if_not_finite(peaks: torch.Tensor) -> None:
    """NonFiniteLogitsError if a row's peak logit ``peaks`` [...] is NaN or +-inf (``check_finite``)."""
    bad = ~torch.isfinite(peaks)
    if bool(bad.any()):
        first = tuple(bad.nonzero()[0].tolist())
        raise NonFiniteLogitsError(
            f"non-finite logits (NaN or inf) at {int(bad.sum())} of {bad.numel()} positions "
            f"(first at index {first} of {tuple(peaks.shape)}, maximum {float(peaks[first])})"
        )


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter without a full-vocabulary sort: look at the top k, doubling k until the mass is reached."""
    vocab = probs.shape[-1]
    k = min(vocab, 256)
    while True:
        top = probs.topk(k, dim=-1).values  # [N, k], descending
        mass = top.cumsum(-1)
        # Float32 sums of a full row can fall short of top_p by rounding: once k covers V, stop anyway.
        if k == vocab or bool((mass[:, -1] >= top_p).all()):
            break
        k = min(vocab, 4 * k)
    last = (mass < top_p).sum(-1, keepdim=True).clamp(max=k - 1)  # index of the token that reaches top_p
    threshold = top.gather(-1, last)
    kept = probs.masked_fill(probs < threshold, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Tokens [B] from probs [B, V] by inversion: the first id whose cumulative mass exceeds u * total.

    The cumulative sum runs in float64 (error ~1e-16 per step), and a zero-probability token can never be
    drawn since the cumulative mass does not increase across it; ``uniforms`` [B] float64 in [0, 1).
    """
    tokens = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    for rows in row_chunks(*probs.shape):
        cumulative = probs[rows].cumsum(-1, dtype=torch.float64)
        total = cumulative[:, -1:].contiguous()
        drawn = torch.searchsorted(cumulative, uniforms[rows, None] * total, right=True)
        # u * total can round up to total itself: then the draw is the last token with positive mass.
        last_positive = torch.searchsorted(cumulative, total, right=False)
        tokens[rows] = torch.minimum(drawn, last_positive).squeeze(-1)
    return tokens


def draw(probs: torch.Tensor, uniforms: torch.Tensor | None) -> torch.Tensor:
    """Tokens [B] from probs [B, V]: by inversion from ``uniforms`` [B] (``sample``), or without them (temperature 0,
    one-hot rows) the argmax."""
    return argmax(probs) if uniforms is None else sample(probs, uniforms)
