"""The one interface the engine sees: a causal LM with a per-row KV cache that rolls back for free."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class LanguageModel(Protocol):
    """A batch of B rows, each a token sequence whose first ``lengths[b]`` tokens are in the model's cache.

    ``forward`` appends tokens and returns their logits; ``rollback`` forgets each row's latest tokens;
    ``select`` keeps a subset of rows (finished rows stop costing compute). Positions are per row, so rows of
    different lengths share one batch.
    """

    vocab_size: int  # size of the logits' last dimension
    eos_token_ids: tuple[int, ...]
    max_length: int | None  # the model's context length, if it has one
    tokenizer: Any  # a transformers tokenizer, or None
    device: torch.device

    @property
    def lengths(self) -> torch.Tensor: ...  # [B] int64: tokens in the cache per row

    def prefill(self, sequences: list[list[int]]) -> None:
        """Start a new batch: one row per sequence, every token of it in the cache (no logits kept)."""

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` [B, S] to each row (slots where ``valid`` [B, S] is False are skipped: they take no
        position and are never attended to) and return their logits [B, S, vocab_size]. The logits of skipped
        slots are never used but must be finite: the engine checks every logit it is handed for NaN and inf."""
        ...

    def rollback(self, lengths: torch.Tensor) -> None:
        """Cut each row back to its first ``lengths[b]`` tokens (never more than it has)."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` [B'] (indices into the current batch), in that order."""


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of different lengths as (tokens [B, S], valid [B, S]), padded on the left with holes, so
    every row's last token is in the last column."""
    width = max((len(r) for r in rows), default=0)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        if row:
            tokens[b, width - len(row) :] = torch.tensor(row)
            valid[b, width - len(row) :] = True
    return tokens, valid


def target_vocabulary(target: LanguageModel) -> int:
    """The ids the target can emit: its logits, less any padding rows beyond its tokenizer (embedding tables
    are often padded to a multiple of 64 or 128)."""
    if target.tokenizer is None:
        return target.vocab_size
    return min(target.vocab_size, len(target.tokenizer))


def check_shared_vocabulary(target: LanguageModel, model: LanguageModel, vocab: int, role: str) -> None:
    """Refuse a draft or companion that does not cover the target's ``vocab`` ids or has another tokenizer:
    the target's law would silently lose the ids it cannot propose or score."""
    if target.tokenizer is not None and model.tokenizer is not None:
        if target.tokenizer.get_vocab() != model.tokenizer.get_vocab():
            raise ValueError(f"{role} and target tokenizers differ: speculative decoding needs a shared vocabulary")
    elif model.vocab_size != target.vocab_size:
        raise ValueError(
            f"{role} has {model.vocab_size} logits and target {target.vocab_size}, and without tokenizers "
            "blockspec cannot check they share a vocabulary"
        )
    if model.vocab_size < vocab:
        raise ValueError(
            f"the {role} model ({model_name(model)}) has {model.vocab_size} logits but the target's vocabulary has "
            f"{vocab} tokens: ids {model.vocab_size}..{vocab - 1} could never be emitted; use a {role} with the "
            "target's vocabulary"
        )


def model_name(model: LanguageModel) -> str:
    """The adapter's ``name`` if it has one, else its class name: how errors name a model."""
    return getattr(model, "name", None) or type(model).__name__
