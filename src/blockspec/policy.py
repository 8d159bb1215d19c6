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
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .sampling import is_int
from .sv.features import (DRAFT_FEATURES, as_probs, companion_features, draft_features, gains as exact_gains,
                          overlap)


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
    gains: torch.Tensor,  # [B, K]: predicted gain of verifying x_i, from information available before x_i
    num_draft: torch.Tensor,  # [B] int64: drafted tokens available per row
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
    the predictor. Each row then verifies min(width, num_draft[b]). ``paid(i)`` (sunk costs, such as the
    drafting already done) must likewise depend on i alone, not on how far drafting went.
    """
    limit = num_draft.tolist()
    gains = gains.double().cpu().tolist()
    emitted, width = float(len(limit)), 0
    for i in range(len(gains[0]) if gains else 0):
        gained, sunk = sum(row[i] for row, n in zip(gains, limit) if n > i), paid(i + 1)
        if not any(n > i for n in limit) or (emitted + gained) / (sunk + step_seconds(i + 1)) <= emitted / (
                sunk + step_seconds(i)):
            break
        emitted, width = emitted + gained, i + 1
    return num_draft.clamp(max=width)


class FixedLength:
    """Standard speculative decoding: draft ``draft_len`` tokens every step and verify them all."""

    needs_companion = False

    def __init__(self, draft_len: int):
        self.draft_len = draft_len

    @property
    def max_draft(self) -> int:
        return self.draft_len

    def draft_budget(self, batch: int, catch_up: int) -> int:
        return self.draft_len

    def draft_next(self, position: int, prefix: torch.Tensor) -> bool:
        return True

    def keep_drafting(self, position: int, probs: torch.Tensor, prefix: torch.Tensor) -> bool:
        return True

    def lengths(self, draft_tokens, draft_probs, companion_probs, num_draft: torch.Tensor) -> torch.Tensor:
        return num_draft

    def observe(self, rows, draft_tokens, draft_probs, target_probs, num_draft, accepted) -> None:
        """After verification: ``num_draft`` [B] counts the positions of each row that the draft model drafted and
        the target verified (0 for a row whose draft was a prompt lookup proposal)."""


class AdaptiveLength(FixedLength):
    """Each step drafts the K (0 = a plain target step) that maximises expected tokens per second, from the
    step latency measured on this machine and the acceptance seen so far: the default, so that decoding is never
    planned slower than the target alone.

    A step drafting K emits 1 + a + a^2 + ... + a^K tokens in expectation when each drafted token is accepted
    with probability a once the ones before it were (the token rule; the block rule accepts at least as many),
    and costs the draft's forwards (the first catching up on what the draft has not read) and the target's
    forward over K + 1 tokens, from ``latency``. ``acceptance`` a starts at ``prior`` (0.8 is about what the
    bundled 0.5B draft gets from the 1.5B target at temperature 1) and follows, with weight 1 - ``memory`` per
    step, the exact acceptance probability sum_v min(draft, target) of the positions each step verified. K is
    decided before the step drafts, from earlier steps only, so verification stays lossless whatever it is.
    Where even the prior cannot pay for a draft (a machine on which a multi-token forward costs nearly as much
    per token as a plain step), ``best_length`` is 0 from the first step and stays 0: the caller can say so.
    """

    def __init__(self, latency, *, max_draft: int = 8, prior: float = 0.8, memory: float = 0.9):
        if not (is_int(max_draft) and max_draft >= 1) or not 0 < prior < 1 or not 0 <= memory < 1:
            raise ValueError(f"need max_draft >= 1, 0 < prior < 1 and 0 <= memory < 1; got {max_draft}, {prior}, "
                             f"{memory}")
        super().__init__(max_draft)
        self.latency, self.memory, self.acceptance = latency, memory, prior

    def best_length(self, batch: int, catch_up: int = 1) -> int:
        """The K in 0..max_draft with the most expected tokens per second at this batch size."""
        emitted = [sum(self.acceptance ** i for i in range(k + 1)) for k in range(self.draft_len + 1)]
        goodput = [emitted[k] / (self.latency.drafting(batch, k, catch_up, companion=False)
                                 + self.latency.target(batch, 1 + k)) for k in range(self.draft_len + 1)]
        return max(range(len(goodput)), key=goodput.__getitem__)

    def draft_budget(self, batch: int, catch_up: int) -> int:
        return self.best_length(batch, catch_up)

    def observe(self, rows, draft_tokens, draft_probs, target_probs, num_draft, accepted) -> None:
        width = int(num_draft.max()) if len(num_draft) else 0
        if width == 0:
            return
        probs = as_probs(draft_tokens[:, :width], None if draft_probs is None else draft_probs[:, :width],
                         target_probs.shape[-1])
        agreement = overlap(probs, target_probs[:, :width])  # [B, width]: P(accept x_i | x_<i accepted), token rule
        verified = torch.arange(width, device=num_draft.device) < num_draft[:, None]  # [B, width]
        step = float(agreement[verified].mean())
        self.acceptance = self.memory * self.acceptance + (1 - self.memory) * step


class SVPolicy:
    """Speculative Verification: a step's verification lengths from predicted gains and measured latency.

    Each step, four decisions, each using only what is known when it is made:
      1. before drafting (``draft_budget``): from the recent history of predicted gains per position and the
         latency table, whether speculating pays at all at this batch size, with the draft's first forward priced
         at the tokens it must catch up on (more after steps that did not draft);
      2. before the draft forward for position i > 1 (``draft_next``): whether the batch's plan, with the gains
         of position i predicted from its position, the drafted prefix's probability and position i - 1's draft
         features in place of its own, would reach i; so a stop rarely pays for a forward whose distribution
         then goes unused;
      3. after the draft's distribution at position i is known and before x_i is sampled (``keep_drafting``):
         whether the stopping rule over the draft-only gains of positions 1..i reaches i;
      4. after the companion has scored the block (``lengths``): the stopping rule over the ``kind``
         predictor's gains gives each row its verification length.
    In 2 and 3 the draft forwards already run are paid whatever is decided, and so is the companion's scoring of
    the tokens already sampled: only what is still to come (the next forward, scoring x_i, the target's wider
    forward) weighs against position i's gain.
    ``kind`` is "companion" (draft + companion features) or "draft" (draft-only features, no companion).

    After each step (``observe``) each predictor's logit offset takes one gradient step of the cross-entropy it
    was fitted with, on the exact gains of the positions just verified (``learn``), at ``rate``: the calibration
    follows the prompts at hand (a profile fitted on chat prompts underestimates code). The offsets are used from
    the next step on, so no decision on a token depends on that token.
    """

    def __init__(self, profile, latency, *, method: str, max_draft: int, kind: str = "companion",
                 memory: float = 0.9, rate: float = 0.5):
        if kind not in ("draft", "companion"):
            raise ValueError(f"kind must be 'draft' or 'companion', got {kind!r}")
        if kind == "companion" and latency.companion is None:
            raise ValueError("the latency profile has no companion costs: measure it with the companion")
        self.method, self.max_draft, self.kind, self.memory, self.rate = method, max_draft, kind, memory, rate
        self.predictors = {"draft": profile.predictor(method, "draft"), kind: profile.predictor(method, kind)}
        self.offsets = dict.fromkeys(self.predictors, 0.0)  # learnt online: added to each predictor's logits
        self._predicted: dict[str, torch.Tensor] = {}  # this step's gains [B, K] per predictor, for ``learn``
        self.latency = latency
        prior = list(profile.prior[method])[:max_draft]
        self.prior = torch.tensor(prior + [prior[-1]] * (max_draft - len(prior)), dtype=torch.float64)
        self.history = self.prior.clone()  # predicted gain per position, recent steps
        self._draft_features: list[torch.Tensor] = []
        self._batch, self._catch_up = 1, 1

    @property
    def needs_companion(self) -> bool:
        return self.kind == "companion"

    def step_seconds(self, batch: int, catch_up: int, drafted: int = 0, sampled: int = 0) -> Callable[[int], float]:
        """Predicted seconds of a step at this batch size that drafts, scores and verifies ``width`` tokens, when
        the draft has ``catch_up`` tokens to read first, has already run the forwards of ``drafted`` positions
        and sampled ``sampled`` tokens: those forwards are paid whatever the width, and the companion scores
        every token sampled, so a narrower width saves neither."""
        def seconds(width: int) -> float:
            latency = self.latency
            scoring = latency.scoring(batch, max(width, sampled), catch_up) if self.needs_companion else 0.0
            return (latency.drafting(batch, max(width, drafted), catch_up, companion=False) + scoring
                    + latency.target(batch, 1 + width))

        return seconds

    def draft_budget(self, batch: int, catch_up: int) -> int:
        self._batch, self._catch_up, self._draft_features, self._predicted = batch, catch_up, [], {}
        seconds = self.step_seconds(batch, catch_up)
        emitted = torch.cat([torch.ones(1, dtype=torch.float64), 1 + self.history.cumsum(0)])
        goodput = [float(emitted[w]) / seconds(w) for w in range(self.max_draft + 1)]
        if max(range(len(goodput)), key=goodput.__getitem__) == 0:
            # not speculating teaches nothing new: drift back towards the calibrated prior
            self.history = self.memory * self.history + (1 - self.memory) * self.expected()
            return 0
        return self.max_draft

    def draft_next(self, position: int, prefix: torch.Tensor) -> bool:
        known = torch.stack(self._draft_features, 1)  # [B, position - 1, F]
        # Position i's draft distribution is not known yet: its entropy and top probability are guessed to be
        # those of position i - 1; its position and the drafted prefix's probability (through x_{i-1}) are known.
        guessed = known[:, -1].clone()
        guessed[:, DRAFT_FEATURES.index("log_position")] = math.log(position)
        guessed[:, DRAFT_FEATURES.index("log_prefix_prob")] = prefix.to(guessed)
        guess = self.predict("draft", torch.cat([known, guessed[:, None]], dim=1))
        return self._plan_reaches(guess, drafted=position - 1)

    def keep_drafting(self, position: int, probs: torch.Tensor, prefix: torch.Tensor) -> bool:
        return self.keep_drafting_given(draft_features(probs[:, None], prefix[:, None], first=position)[:, 0])

    def keep_drafting_given(self, features: torch.Tensor) -> bool:
        """``keep_drafting`` from the draft-only features [B, F] of the next position."""
        self._draft_features.append(features)
        gains = self.predict("draft", torch.stack(self._draft_features, 1))
        return self._plan_reaches(gains, drafted=len(self._draft_features))

    def _plan_reaches(self, gains: torch.Tensor, drafted: int) -> bool:
        """Whether the stopping rule over the gains [B, i] of positions 1..i reaches position i, deciding before
        x_i is sampled (i - 1 tokens sampled) with the draft forwards of ``drafted`` positions already run."""
        position = gains.shape[1]
        limit = torch.full((len(gains),), position, dtype=torch.long)
        seconds = self.step_seconds(self._batch, self._catch_up, drafted=drafted, sampled=position - 1)
        return int(stopping_lengths(gains, limit, seconds).max()) == position

    def lengths(self, draft_tokens, draft_probs, companion_probs, num_draft: torch.Tensor) -> torch.Tensor:
        features = torch.stack(self._draft_features[: draft_tokens.shape[1]], 1).to(draft_tokens.device)
        if self.kind == "companion":
            probs = as_probs(draft_tokens, draft_probs, companion_probs.shape[-1])
            features = companion_features(draft_tokens, probs, companion_probs, self.method, features)
        return self.lengths_given(features, num_draft)

    def lengths_given(self, features: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
        """``lengths`` from the ``kind`` predictor's features [B, K, F] of the drafted positions."""
        gains = self.predict(self.kind, features)
        draft = gains if self.kind == "draft" else self.predict("draft", features[..., :len(DRAFT_FEATURES)])
        self._predicted = {"draft": draft, self.kind: gains}
        drafted = gains.shape[1]
        # positions drafted move towards this step's predictions, the others towards the (recalibrated) prior's
        now = torch.cat([gains.mean(0).cpu(), self.expected()[drafted:]])
        self.history = self.memory * self.history + (1 - self.memory) * now
        # Drafting (and the companion's scoring) up to position i is paid by the time x_i is decided on; the
        # sunk seconds are those of i positions, never of how far drafting went (which depends on x_i).
        batch, catch_up = self._batch, self._catch_up
        lengths = stopping_lengths(gains, num_draft, lambda width: self.latency.target(batch, 1 + width),
                                   paid=lambda i: self.latency.drafting(batch, i, catch_up, self.needs_companion))
        return lengths.to(num_draft.device)

    def expected(self) -> torch.Tensor:
        """The calibrated mean gain per position [max_draft], shifted by the learnt offset of the predictor."""
        return torch.sigmoid(torch.logit(self.prior, eps=1e-6) + self.offsets[self.kind])

    def predict(self, kind: str, features: torch.Tensor) -> torch.Tensor:
        """Gains [B, K] predicted by the ``kind`` predictor from its features [B, K, F], with its learnt offset."""
        return torch.sigmoid(self.predictors[kind].logits(features) + self.offsets[kind])

    def observe(self, rows, draft_tokens, draft_probs, target_probs, num_draft, accepted) -> None:
        if not bool((num_draft > 0).any()):
            return
        probs = as_probs(draft_tokens, draft_probs, target_probs.shape[-1])
        self.learn(exact_gains(draft_tokens, probs, target_probs, self.method), num_draft)

    def learn(self, labels: torch.Tensor, verified: torch.Tensor) -> None:
        """One online step on the exact gains ``labels`` [B, W] of the first ``verified`` [B] <= W positions of
        each row (where the target's distributions are known) of the step whose ``lengths`` were just decided."""
        width = labels.shape[1]
        mask = torch.arange(width, device=labels.device) < verified.to(labels.device)[:, None]
        if not mask.any():
            return
        for kind, predicted in self._predicted.items():
            residual = labels.double() - predicted[:, :width].to(labels.device)
            self.offsets[kind] += self.rate * float(residual[mask].mean())
