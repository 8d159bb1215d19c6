"""The one interface the engine sees: a causal LM with a per-row KV cache that rolls back for free."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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
    tokenizer: object | None
    device: torch.device

    @property
    def lengths(self) -> torch.Tensor: ...  # [B] int64: tokens in the cache per row

    def prefill(self, sequences: list[list[int]]) -> None:
        """Start a new batch: one row per sequence, every token of it in the cache (no logits kept)."""

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` [B, S] to each row (slots where ``valid`` [B, S] is False are skipped: they take no
        position and are never attended to) and return their logits [B, S, vocab_size]. The logits of skipped
        slots are never used but must be finite: the engine checks every logit it is handed for NaN and inf."""

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
            tokens[b, width - len(row):] = torch.tensor(row)
            valid[b, width - len(row):] = True
    return tokens, valid
