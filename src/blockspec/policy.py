"""Verification-length policies: how many drafted tokens each row verifies this step.

Speculative Verification (Kim et al., arXiv 2509.24328) verifies, each step, only as many drafted tokens as
pay for themselves: goodput = expected emitted tokens / predicted step latency. Verifying the first L drafted
tokens is lossless only if the decision to include x_i is a *stopping rule*: it may use x_<i, the
distributions at position i (so the draft-companion overlap S_i) and A_<i, other rows and latency figures,
never x_i itself (so never A_i). ALGORITHMS.md, "Adaptive verification length must be a stopping rule".
Hence the search below extends L one token at a time and stops at the first position whose marginal gain is
not positive; a global argmax over L would be look-ahead (predictions for later positions use A_i).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class LatencyTable:
    """Measured step latency (seconds) over (batch size, tokens scored per row), interpolated linearly in both."""

    batch_sizes: tuple[int, ...]  # increasing
    tokens: tuple[int, ...]  # increasing; tokens per row in the target forward (verified drafts + 1)
    seconds: tuple[tuple[float, ...], ...]  # seconds[i][j] at (batch_sizes[i], tokens[j])

    def __post_init__(self):
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError("latency table axes must be strictly increasing")
        if len(self.seconds) != len(self.batch_sizes) or any(len(r) != len(self.tokens) for r in self.seconds):
            raise ValueError("latency table seconds must be [len(batch_sizes)][len(tokens)]")

    def __call__(self, batch: int, tokens: int) -> float:
        rows = [_interpolate(self.tokens, row, tokens) for row in self.seconds]
        return _interpolate(self.batch_sizes, rows, batch)


def _interpolate(xs: tuple[int, ...], ys, x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past either end."""
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def stopping_lengths(
    predicted: torch.Tensor,  # [B, K]: P(x_i accepted | x_1..x_{i-1} accepted), from information before x_i
    num_draft: torch.Tensor,  # [B] int64: drafted tokens available per row
    latency: Callable[[int, int], float],  # (batch, tokens per row) -> seconds of a step
) -> torch.Tensor:
    """Per-row verification lengths L [B] maximising batch goodput by a stopping rule.

    Goodput = sum_b (1 + sum_{j <= L_b} prod_{i <= j} predicted[b, i]) / latency(B, 1 + max_b L_b). Position by
    position, each row (in row order) extends from i - 1 to i only if that raises the goodput, and a row that
    declines once is done. Column i of ``predicted`` may depend only on what was known before x_{i+1} was
    sampled; the rule never looks further, so the verified length is a stopping time and verification stays
    lossless whatever the predictor.
    """
    batch, draft_len = predicted.shape
    predicted = predicted.double().cpu()
    lengths = [0] * batch
    emitted = [1.0] * batch  # expected tokens emitted per row at its current length
    survival = [1.0] * batch  # predicted P(all drafted tokens so far accepted)
    active = [int(n) > 0 for n in num_draft.tolist()]
    limit = num_draft.tolist()
    for i in range(draft_len):
        for b in range(batch):
            if not active[b]:
                continue
            width = max(lengths)
            before = sum(emitted) / latency(batch, 1 + width)
            gained = survival[b] * float(predicted[b, i])
            after = (sum(emitted) + gained) / latency(batch, 1 + max(width, i + 1))
            if after <= before:
                active[b] = False
                continue
            lengths[b], emitted[b], survival[b] = i + 1, emitted[b] + gained, gained
            active[b] = lengths[b] < limit[b]
    return torch.tensor(lengths, dtype=torch.long)
