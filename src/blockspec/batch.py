"""The rows of one ``generate`` call: each row's prompt, what it generated, why it ended and its random stream."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampling import SamplingParams
from .stopping import Stopper
from .verify.base import draw_exponentials


@dataclass(frozen=True)
class Draws:
    """One step's uniforms, the same amount for every row whatever it drafts or verifies (the race's exponentials
    come after the proposal: ``Batch.exponentials``)."""

    drafting: torch.Tensor  # [B, W] float64: one uniform per drafted position
    verifying: torch.Tensor  # [B, W] float32: one uniform per verified position
    plain: torch.Tensor  # [B] float64: the token of a row that verifies nothing, by inversion (sampling.sample)


class Batch:
    """The rows still decoding. ``rows`` holds the prompt index of each batch row, in batch order; a row that
    finishes leaves it (``drop``), and batch position b of every step tensor is prompt ``rows[b]``."""

    def __init__(self, prompts: list[list[int]], seeds: list[int]):
        self.prompts = prompts
        self.generated: list[list[int]] = [[] for _ in prompts]
        self.finish_reasons: list[str | None] = [None] * len(prompts)
        self.rows = list(range(len(prompts)))
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]

    def contexts(self) -> list[list[int]]:
        """Each row's committed tokens, prompt included; the last one is pending (no model has read it yet)."""
        return [self.prompts[i] + self.generated[i] for i in self.rows]

    def lengths(self) -> torch.Tensor:
        """[B] int64: each row's committed tokens less the pending one, what the models' caches keep."""
        return torch.tensor([len(self.prompts[i]) + len(self.generated[i]) - 1 for i in self.rows])

    def remaining(self, limit: int) -> torch.Tensor:
        """[B] int64: the tokens each row may still emit."""
        return torch.tensor([limit - len(self.generated[i]) for i in self.rows])

    def draw(self, width: int, sampling: SamplingParams, device) -> Draws | None:
        """Each row's uniforms for one step, from its own stream and always the same amount of them, so a row's
        draws never depend on its neighbours (None at temperature 0: nothing is random)."""
        if sampling.greedy:
            return None
        streams = [self.generators[i] for i in self.rows]
        drafting = torch.stack([torch.rand(width, dtype=torch.float64, generator=g) for g in streams])
        verifying = torch.stack([torch.rand(width, generator=g) for g in streams])
        plain = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in streams])
        return Draws(drafting.to(device), verifying.to(device), plain.to(device))

    def exponentials(self, drafted: list[bool], vocab: int, device) -> torch.Tensor:
        """[B, V] float32: the race's Exp(1) variates, from the stream of each row that verifies a drafted token (its
        own proposal says so: what a row draws still never depends on its neighbours), ones in the other rows, which
        take their plain draw instead. A step that verifies nothing skips the V variates (0.4 ms at V = 151,936)."""
        out = torch.ones(len(self.rows), vocab)
        for b, row in enumerate(self.rows):
            if drafted[b]:
                out[b] = draw_exponentials(1, vocab, dtype=torch.float32, device="cpu", generator=self.generators[row])
        return out.to(device)

    def commit(
        self,
        tokens: torch.Tensor,  # [B, W+1] int64: the verifier's output, accepted tokens then the last one
        num_accepted: torch.Tensor,  # [B] int64 (tau)
        stopper: Stopper,
        on_tokens: Callable[[int, list[int]], None] | None,
    ) -> tuple[list[int], list[int]]:
        """Append each row's emitted tokens, cut where the row ends: (tokens kept per row, batch positions of the
        rows that finished)."""
        emitted, finished = [], []
        for b, (i, tau) in enumerate(zip(self.rows, num_accepted.tolist())):
            kept, self.finish_reasons[i] = stopper.cut(self.generated[i], tokens[b, : tau + 1].tolist())
            self.generated[i] += kept
            emitted.append(len(kept))
            if on_tokens is not None and kept:
                on_tokens(i, kept)
            if self.finish_reasons[i] is not None:
                finished.append(b)
        return emitted, finished

    def drop(self, finished: list[int]) -> None:
        self.rows = [i for b, i in enumerate(self.rows) if b not in finished]
