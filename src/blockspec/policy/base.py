"""The length-policy contract, and the stopping rule that keeps an adaptive length lossless.

A length policy decides, each step, how many tokens each row drafts and how many of them the target verifies.
Verifying the first L drafted tokens is lossless only if the decision to include x_i is a *stopping rule*: it
may use x_<i, the distributions at position i, other rows and latency figures, never x_i itself
(docs/algorithms.md, "Choosing how many tokens to verify"). ``LengthPolicy`` states, hook by hook, what the engine
has when it asks; ``stopping_lengths`` is the search every adaptive length here uses: it extends L one position at
a time and stops at the first whose marginal gain does not pay (a global argmax over L would be look-ahead: later
predictions use x_i).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LengthPolicy(Protocol):
    """How many tokens each row drafts and verifies; the engine calls these hooks, in this order, each step.

    Glossary (``blockspec.verify.base`` has the whole): B rows in this step, K = the positions drafted this step,
    V the vocabulary; position i (1-based) is the i-th drafted token x_i. What each hook may look at, in its
    docstring, is what keeps verification lossless; the engine hands it nothing more (why: docs/algorithms.md,
    "Choosing how many tokens to verify").
    """

    needs_companion: bool  # whether ``lengths`` needs a companion model's distributions

    @property
    def max_draft(self) -> int:
        """The most any step drafts (the engine sizes its random draws by it)."""
        ...

    def reset(self) -> None:
        """At the start of each ``generate`` call. A policy that learns online forgets what it learnt, unless it
        was built to carry its state over calls (then a call's output depends on the calls before it)."""
        ...

    def draft_budget(self, batch: int, catch_up: int) -> int:
        """Before drafting: the most positions any row drafts this step (0: a plain target step). Known: the batch
        size, the tokens the draft's first forward must catch up on, everything from earlier steps."""
        ...

    def expected_rate(self, batch: int, catch_up: int) -> float | None:
        """Before drafting: the tokens a row is expected to commit from this step if the policy drafts for it (as
        ``draft_budget`` would price the step) per plain target step's time (1: what a plain step commits in it), or
        None for a policy that does not price its steps. A unit of the machine's own step, not seconds: prompt lookup
        weighs it against its own measured costs, taken at another time, and proposes only what beats it. Known: as
        for ``draft_budget``; it changes nothing."""
        ...

    def draft_next(self, position: int, prefix: torch.Tensor) -> bool:
        """Before the draft's forward for position i = ``position`` > 1: whether to run it. Known: x_<i, through
        ``prefix`` [B] float64 = sum_{j<i} log draft(x_j)."""
        ...

    def keep_drafting(self, position: int, probs: torch.Tensor, prefix: torch.Tensor) -> bool:
        """Once the draft's distribution ``probs`` [B, V] at position i = ``position`` is known and before x_i is
        sampled: whether to sample it. Known: ``probs`` and x_<i, through ``prefix`` as in ``draft_next``."""
        ...

    def lengths(
        self,
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        companion_probs: torch.Tensor | None,
        drafted: torch.Tensor,
    ) -> torch.Tensor:
        """After drafting (and the companion's scoring, if ``needs_companion``): how many tokens each row
        verifies, [B] int64, at most ``drafted`` [B] (the tokens each row drafted).

        Known: the whole block ``draft_tokens`` [B, K], the draft's distributions ``draft_probs`` [B, K, V] (None
        when greedy), the companion's ``companion_probs`` [B, K+1, V] or None. Lossless only if the decision to
        verify x_i reads columns < i of the tokens and columns <= i of the distributions (``stopping_lengths``):
        never x_i itself."""
        ...

    def observe(
        self,
        rows: list[int],
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        verified: torch.Tensor,
        accepted: torch.Tensor,
    ) -> None:
        """After verification, for later steps only. ``verified`` [B] counts the positions of each row that the
        draft model drafted and the target verified (0 for a row whose draft was a prompt lookup proposal);
        ``accepted`` [B] = tau per row."""
        ...


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
        if not self.batch_sizes or not self.tokens:
            raise ValueError("latency table axes must not be empty")
        if not all(seconds >= 0 and math.isfinite(seconds) for row in self.seconds for seconds in row):
            raise ValueError(f"latency table seconds must be finite and >= 0, got {self.seconds}")

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
    gains: torch.Tensor,  # [B, K]: predicted gain of verifying x_i, from information available before x_i
    drafted: torch.Tensor,  # [B] int64: the tokens each row drafted
    step_seconds: Callable[[int], float],  # verification width (drafted tokens per row) -> seconds of the step
    paid: Callable[[int], float] = lambda position: 0.0,  # seconds already spent when position i is decided
) -> torch.Tensor:
    """Per-row verification lengths L [B] maximising batch goodput by a stopping rule.

    Goodput = sum_b (1 + sum_{i <= L_b} gains[b, i]) / (paid + step_seconds(max_b L_b)). The batch's forward is
    padded to its widest row, so its cost depends on the width alone, and once the width reaches i every row that
    drafted x_i adds to the expected output at no extra cost: the width grows one position at a time while
    the rows' summed gains at the next position pay for it, and stops at the first position that does not
    (a global argmax would be look-ahead). Column i of ``gains`` may depend only on what was known before
    x_{i+1} was sampled, so the verified length is a stopping time and verification stays lossless whatever
    the predictor. Each row then verifies min(width, drafted[b]). ``paid(i)`` (sunk costs, such as the
    drafting already done) must likewise depend on i alone, not on how far drafting went.
    """
    limit = drafted.tolist()
    rows: list[list[float]] = gains.double().cpu().tolist()
    emitted, width = float(len(limit)), 0
    for i in range(len(rows[0]) if rows else 0):
        gained, sunk = sum(row[i] for row, n in zip(rows, limit) if n > i), paid(i + 1)
        if not any(n > i for n in limit) or (emitted + gained) / (sunk + step_seconds(i + 1)) <= emitted / (
            sunk + step_seconds(i)
        ):
            break
        emitted, width = emitted + gained, i + 1
    return drafted.clamp(max=width)


def ragged_stopping_lengths(
    gains: torch.Tensor,  # [B, K]: predicted gain of verifying x_i, from information available before x_i
    drafted: torch.Tensor,  # [B] int64: the tokens each row drafted
    step_seconds: Callable[[int], float],  # drafted tokens verified in the whole batch -> seconds of the step
    paid: Callable[[int], float] = lambda position: 0.0,  # seconds already spent when position i is decided
) -> torch.Tensor:
    """Per-row verification lengths L [B] by a stopping rule, when each row pays only for its own tokens.

    A flattened batch (vLLM's) is not padded: its forward costs what the drafted tokens it verifies cost in all,
    ``step_seconds(sum_b L_b)``. Position by position, each row still going verifies x_i while its own gain pays
    for one more token at the goodput the batch reached with positions < i, (B + gains so far) / (paid + seconds),
    and stops for good at the first position that does not. Row b's decision on x_i reads its own gain at i and
    the batch's totals over positions < i, never x_i: a stopping rule, so verification stays lossless (the other
    rows' tokens are independent of row b's).
    """
    limit = drafted.to(gains.device)
    gains = gains.double()
    going = limit > 0
    lengths = torch.zeros_like(limit)
    emitted, tokens = float(len(limit)), 0
    for i in range(gains.shape[1]):
        going &= limit > i
        if not bool(going.any()):
            break
        now = paid(i + 1) + step_seconds(tokens)
        going &= gains[:, i] > emitted * (step_seconds(tokens + 1) - step_seconds(tokens)) / now
        lengths += going
        emitted, tokens = emitted + float(gains[going, i].sum()), tokens + int(going.sum())
    return lengths.to(drafted.device)
