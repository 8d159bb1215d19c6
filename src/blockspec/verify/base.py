"""What every verifier shares: inputs and their validation, explicit randomness, the final-token draw, outputs.

Glossary (used throughout blockspec). Shapes:
    B  batch size (rows)
    K  the step's width: drafted positions per row in the verify tensors (a row's own ``num_verified`` may be less)
    V  vocabulary size
    draft_tokens [B, K]      x_1..x_K, the drafted tokens
    draft_probs  [B, K, V]   draft_probs[:, i] is the distribution x_{i+1} was sampled from
    target_probs [B, K+1, V] the target's distributions at the same contexts, from one forward
How many tokens, one name each (a count per row is ``num_<name>`` in this package's tensors):
    max_draft     the most tokens any step drafts: a setting of the decoder, a length policy or a benchmark run
    budget        the most tokens this step drafts, chosen by the length policy before drafting (<= max_draft)
    drafted       tokens drafted this step (a lookup proposal counts; per row where rows differ, else the step's)
    verified      n_b: drafted tokens the target verifies in row b, x_1..x_{n_b} (<= drafted; SV may verify fewer)
    width         the step's widest row, max_b n_b: K above
    accepted      tau: verified tokens accepted, the longest accepted prefix
    emitted       tokens a step emits: tau + 1 (less any cut by EOS, stop strings or the length cap)
Probabilities are the *processed* distributions actually sampled from (temperature, top-k, top-p applied).
A verifier is a deterministic part (acceptance probabilities, final distributions) plus a thin random part
that consumes explicit uniforms and exponentials; the exact tests integrate over the first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Randomness:
    """All the randomness one verification consumes, so that its outcome is a pure function of its inputs."""

    uniforms: torch.Tensor  # [B, K] float in [0, 1): one per drafted position
    exponentials: torch.Tensor  # [B, V] float > 0: Exp(1) variates; the final token wins an exponential race

    @classmethod
    def draw(
        cls,
        batch: int,
        width: int,
        vocab: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
    ) -> Randomness:
        uniforms = torch.rand(batch, width, dtype=dtype, device=device, generator=generator)
        return cls(uniforms, draw_exponentials(batch, vocab, dtype=dtype, device=device, generator=generator))


def draw_exponentials(rows: int, vocab: int, *, dtype, device, generator) -> torch.Tensor:
    """[rows, V] Exp(1) variates, as -log(U): faster on CPU than Tensor.exponential_.

    U lies in [0, 1), so every variate is > 0; U = 0 is clamped to the smallest normal number first.
    """
    uniforms = torch.rand(rows, vocab, dtype=dtype, device=device, generator=generator)
    return uniforms.clamp_(min=torch.finfo(dtype).tiny).log_().neg_()


@dataclass(frozen=True)
class VerifyOutput:
    tokens: torch.Tensor  # [B, K+1] int64: accepted drafted prefix, then the correction/bonus token; -1 after
    num_accepted: torch.Tensor  # [B] int64: tau, the number of drafted tokens accepted

    @property
    def num_emitted(self) -> torch.Tensor:  # [B] int64
        return self.num_accepted + 1


def prepare(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_verified: torch.Tensor | None,
    randomness: Randomness | None,
    validate: bool,
) -> torch.Tensor:
    """Checks the inputs (when ``validate``) and returns ``num_verified`` [B] int64, defaulting to K for every row."""
    if validate:
        _check_shapes(draft_tokens, draft_probs, target_probs, num_verified, randomness)
    batch, width = draft_tokens.shape
    if num_verified is None:
        num_verified = torch.full((batch,), width, dtype=torch.long, device=draft_tokens.device)
    if validate:
        _check_values(draft_tokens, draft_probs, target_probs, num_verified, randomness)
    return num_verified


def draw_uniforms(randomness: Randomness | None, generator, target_probs: torch.Tensor, width: int):
    """The caller's explicit uniforms [B, K], or a fresh draw from ``generator`` in the dtype of ``target_probs``."""
    if randomness is not None:
        return randomness.uniforms
    return torch.rand(
        target_probs.shape[0], width, dtype=target_probs.dtype, device=target_probs.device, generator=generator
    )


def row_chunks(batch: int, vocab: int) -> list[slice]:
    """Row ranges whose [rows, V] temporaries stay small (2**21 entries).

    A fresh tensor of tens of MB is page-faulted in on every call, which can cost more than the arithmetic on it;
    small temporaries are reused by the allocator.
    """
    rows = max(1, (1 << 21) // max(vocab, 1))
    return [slice(start, min(start + rows, batch)) for start in range(0, batch, rows)]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)``: the first index of each row's maximum (a NaN counts as the maximum), int64. On the CPU it is
    numpy's, vectorized where torch's is not: 0.01 against 0.33 ms over a row of 151,936 float32 logits."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(-1))
    return x.argmax(-1)


def positive_part_mass(scale: torch.Tensor, target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """sum_v max(scale * target[..., v] - draft[..., v], 0): scale [B, N], target and draft [B, N, V] -> [B, N]."""
    mass = torch.empty_like(scale)
    batch, positions, vocab = target.shape
    for rows in row_chunks(batch, positions * vocab):
        residual = torch.mul(target[rows], scale[rows, :, None])
        mass[rows] = residual.sub_(draft[rows]).clamp_(min=0.0).sum(-1)
    return mass


def agreement(draft_probs: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """sum_v min(draft_probs[..., v], other[..., v]) per position, [B, K] from two [B, K, V]: the probability that
    the token rule accepts position i's draft once the ones before it were, when ``other`` is the target."""
    ones = torch.ones(draft_probs.shape[:2], dtype=draft_probs.dtype, device=draft_probs.device)
    return 1.0 - positive_part_mass(ones, other, draft_probs)


def drafted_log_ratio(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """log other_i(x_i) - log draft_i(x_i), [B, K] from draft_tokens [B, K] and two [B, K, V]; -inf where other
    is 0. Guard: the drafted token's draft probability is clamped to the smallest normal number, never 0."""
    index = draft_tokens[..., None]
    draft_at = draft_probs.gather(-1, index).squeeze(-1).clamp(min=torch.finfo(draft_probs.dtype).tiny)
    return other.gather(-1, index).squeeze(-1).log() - draft_at.log()


def sample_final(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    num_verified: torch.Tensor,
    tau: torch.Tensor,
    weight: torch.Tensor,
    randomness: Randomness | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The token [B] emitted after ``tau`` accepted drafted tokens, drawn from ``final_distribution``.

    Row chunk by row chunk (see ``row_chunks``); without explicit randomness each chunk draws its own Exp(1)
    variates from ``generator``, so the [B, V] table of them never exists.
    """
    batch, _, vocab = target_probs.shape
    last = torch.empty_like(tau)
    for rows in row_chunks(batch, vocab):
        dist = final_distribution(
            draft_tokens[rows],
            None if draft_probs is None else draft_probs[rows],
            target_probs[rows],
            num_verified[rows],
            tau[rows],
            weight[rows],
        )
        last[rows] = race_rows(dist, rows, randomness, generator)
    return last


def verified_mask(num_verified: torch.Tensor, width: int) -> torch.Tensor:
    """[B, K] bool: position i (0-based) holds a real drafted token, i.e. i < num_verified[b]."""
    return torch.arange(width, device=num_verified.device) < num_verified[:, None]


def probs_of_drafted(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor):
    """(draft, target) probabilities of each drafted token x_{i+1} at its own context, each [B, K].

    Padding positions may hold any id; they are clamped into the vocabulary here and masked by the callers.
    """
    index = draft_tokens.clamp(0, target_probs.shape[-1] - 1).unsqueeze(-1)  # [B, K, 1]
    target_at = target_probs[:, :-1].gather(-1, index).squeeze(-1)
    if draft_probs is None:  # a one-hot draft (greedy or n-gram drafter) proposed x with probability 1
        return torch.ones_like(target_at), target_at
    return draft_probs.gather(-1, index).squeeze(-1), target_at


def final_distribution(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] or None (one-hot draft)
    target_probs: torch.Tensor,  # [B, K+1, V]
    num_verified: torch.Tensor,  # [B] int64
    tau: torch.Tensor,  # [B] int64, 0 <= tau <= num_verified
    weight: torch.Tensor,  # [B] float: w_tau (1 for token verification, Sun et al.'s w_tau for block)
) -> torch.Tensor:
    """Unnormalised distribution [B, V] of the token emitted after ``tau`` accepted drafted tokens.

    The bonus ``target_probs[tau]`` when every drafted token was accepted (tau == num_verified), otherwise the
    residual ``max(weight * target_probs[tau] - draft_probs[tau], 0)``.
    """
    rows = torch.arange(tau.shape[0], device=tau.device)
    target_row = target_probs[rows, tau]  # [B, V]
    if draft_tokens.shape[1] == 0:  # nothing was drafted: a plain target step
        return target_row
    draft_pos = tau.clamp(max=draft_tokens.shape[1] - 1)  # where tau == K the row is a bonus; any index will do
    residual = torch.mul(target_row, weight[:, None].to(target_row.dtype))
    if draft_probs is None:
        # max(w * t - onehot(x), 0) is w * t with x's entry zeroed, since w * t(x) <= 1.
        residual.scatter_(-1, draft_tokens[rows, draft_pos].clamp(min=0)[:, None], 0.0)
    else:
        residual.sub_(draft_probs[rows, draft_pos]).clamp_(min=0.0)
    # Numerical guard: a residual that rounds to all zeros has zero probability of being reached in exact
    # arithmetic; sample the target row instead of dividing by zero.
    use_target = (tau == num_verified) | (residual.sum(-1) <= 0)
    return torch.where(use_target[:, None], target_row, residual)


def race(weights: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """Index [B] drawn with probability proportional to ``weights`` [B, V] (unnormalised, >= 0, not all 0).

    argmax_v weights_v / E_v with E_v ~ Exp(1) independent: P(v wins) = weights_v / sum(weights).
    """
    return argmax(weights / exponentials)


def race_rows(weights: torch.Tensor, rows: slice, randomness: Randomness | None, generator) -> torch.Tensor:
    """``race`` over ``weights`` [M, V], the batch's rows ``rows``: with the caller's exponentials of those rows, or
    M rows of fresh ones from ``generator`` (a chunk at a time: the [B, V] table of them never exists)."""
    if randomness is not None:
        exponentials = randomness.exponentials[rows]
    else:
        exponentials = draw_exponentials(
            len(weights), weights.shape[-1], dtype=weights.dtype, device=weights.device, generator=generator
        )
    return race(weights, exponentials)


def emit(draft_tokens: torch.Tensor, tau: torch.Tensor, last: torch.Tensor) -> VerifyOutput:
    """Left-aligns the accepted prefix x_1..x_tau followed by ``last``, padding with -1, into a VerifyOutput."""
    batch, width = draft_tokens.shape
    positions = torch.arange(width + 1, device=draft_tokens.device)  # [K+1]
    padded = torch.nn.functional.pad(draft_tokens, (0, 1), value=-1)  # [B, K+1]
    tokens = torch.where(positions < tau[:, None], padded, -1)
    tokens.scatter_(1, tau[:, None], last[:, None])
    return VerifyOutput(tokens=tokens, num_accepted=tau)


# --- validation --------------------------------------------------------------------------------------------


def _check_shapes(draft_tokens, draft_probs, target_probs, num_verified, randomness) -> None:
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be a [B, K] tensor, got {describe(draft_tokens)}")
    if draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be int64, got {draft_tokens.dtype}")
    batch, width = draft_tokens.shape
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        raise ValueError(f"target_probs must be a [B, K+1, V] tensor, got {describe(target_probs)}")
    if target_probs.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"target_probs must be float32 or float64 probabilities, got {target_probs.dtype}")
    if target_probs.shape[:2] != (batch, width + 1):
        raise ValueError(
            f"target_probs must have shape [B, K+1, V] = [{batch}, {width + 1}, V] to match draft_tokens "
            f"[{batch}, {width}], got {list(target_probs.shape)}"
        )
    vocab = target_probs.shape[2]
    if vocab == 0:
        raise ValueError("target_probs has an empty vocabulary (V = 0)")
    if draft_probs is not None:
        if not isinstance(draft_probs, torch.Tensor) or list(draft_probs.shape) != [batch, width, vocab]:
            raise ValueError(
                f"draft_probs must have shape [B, K, V] = [{batch}, {width}, {vocab}], got {describe(draft_probs)}"
            )
        if draft_probs.dtype != target_probs.dtype:
            raise ValueError(f"draft_probs is {draft_probs.dtype} but target_probs is {target_probs.dtype}")
    if num_verified is not None:
        if not isinstance(num_verified, torch.Tensor) or list(num_verified.shape) != [batch]:
            raise ValueError(f"num_verified must be a [B] = [{batch}] tensor, got {describe(num_verified)}")
        if num_verified.dtype != torch.long:
            raise ValueError(f"num_verified must be int64, got {num_verified.dtype}")
    if randomness is not None:
        if list(randomness.uniforms.shape) != [batch, width]:
            raise ValueError(
                f"randomness.uniforms must have shape [B, K] = [{batch}, {width}], "
                f"got {list(randomness.uniforms.shape)}"
            )
        if list(randomness.exponentials.shape) != [batch, vocab]:
            raise ValueError(
                f"randomness.exponentials must have shape [B, V] = [{batch}, {vocab}], "
                f"got {list(randomness.exponentials.shape)}"
            )
    devices = {t.device for t in (draft_tokens, draft_probs, target_probs, num_verified) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_values(draft_tokens, draft_probs, target_probs, num_verified, randomness) -> None:
    batch, width = draft_tokens.shape
    vocab = target_probs.shape[2]
    if bool(((num_verified < 0) | (num_verified > width)).any()):
        raise ValueError(f"num_verified must lie in [0, K] = [0, {width}], got {num_verified.tolist()}")
    verified = verified_mask(num_verified, width)  # [B, K]
    bad_ids = verified & ((draft_tokens < 0) | (draft_tokens >= vocab))
    if bool(bad_ids.any()):
        b, i = bad_ids.nonzero()[0].tolist()
        raise ValueError(f"draft_tokens[{b}, {i}] = {int(draft_tokens[b, i])} is outside the vocabulary [0, {vocab})")
    # The target row at position num_verified (the bonus distribution) is used too.
    target_used = torch.arange(width + 1, device=num_verified.device) <= num_verified[:, None]  # [B, K+1]
    check_distributions("target_probs", target_probs, target_used)
    if draft_probs is not None:
        check_distributions("draft_probs", draft_probs, verified)
        draft_at, _ = probs_of_drafted(draft_tokens, draft_probs, target_probs)
        impossible = verified & (draft_at <= 0)
        if bool(impossible.any()):
            b, i = impossible.nonzero()[0].tolist()
            raise ValueError(
                f"draft_tokens[{b}, {i}] = {int(draft_tokens[b, i])} has zero probability under draft_probs[{b}, {i}]: "
                "the drafted tokens must be sampled from draft_probs"
            )
    if randomness is not None:
        check_randomness_values(randomness)


def check_randomness_values(randomness: Randomness) -> None:
    """Uniforms in [0, 1) and exponentials finite and > 0 (NaN fails both). An infinite exponential never wins the
    final token's race; where every possible token's is infinite, the race's argmax over all-zero ratios returns
    token 0, of probability 0 perhaps."""
    u = randomness.uniforms
    if bool(((u < 0) | (u >= 1) | u.isnan()).any()):
        raise ValueError("randomness.uniforms must lie in [0, 1)")
    exponentials = randomness.exponentials
    if bool((~((exponentials > 0) & exponentials.isfinite())).any()):
        raise ValueError("randomness.exponentials must be finite and > 0")


def check_distributions(name: str, probs: torch.Tensor, used: torch.Tensor) -> None:
    """Each used row of ``probs`` [B, N, V] must be a probability vector: no NaN, no negatives, sum 1."""
    # Summing V rounded entries loses about half the significant digits at worst: float32 ~3e-4, float64 ~1e-8.
    tolerance = torch.finfo(probs.dtype).eps ** 0.5
    sums = probs.sum(-1)  # [B, N]; NaN and inf propagate here
    lowest = probs.amin(-1)
    for problem, bad in (
        ("contains NaN or inf", ~sums.isfinite()),
        ("has negative entries", lowest < 0),
        (f"does not sum to 1 (tolerance {tolerance:.1e})", (sums - 1).abs() > tolerance),
    ):
        bad = bad & used
        if bool(bad.any()):
            b, i = bad.nonzero()[0].tolist()
            raise ValueError(
                f"{name}[{b}, {i}] {problem}: sum = {float(sums[b, i]):.9g}; pass probabilities, not logits"
            )


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {list(value.shape)} and dtype {value.dtype}"
    return type(value).__name__
