"""Speculative Verification (Kim et al., arXiv 2509.24328): verify, each step, only the drafted tokens that pay.

Per drafted position, features of the draft's (and optionally a companion's) distributions predict the gain of
verifying it (``features``, ``predictor``: a calibration profile); a latency profile measured on this machine
(``latency``) prices each verification width; ``stopping_lengths`` turns both into lossless per-row lengths.
Profiles are made by ``blockspec sv calibrate`` and ``blockspec sv profile`` and stored where ``profiles`` says;
``SVPolicy.from_cache`` finds them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from ..defaults import COMPANION, MAX_DRAFT, SV_PREDICTOR
from ..models.base import model_name
from ..sampling import SamplingParams
from ..verify import draft_distributions, position_gains
from .base import ragged_stopping_lengths, stopping_lengths
from .features import DRAFT_FEATURES, companion_features, draft_features
from .latency import LatencyProfile, dtype_name, kernels
from .predictor import Profile
from .profiles import calibration_file, latency_file, sampling_key


def load_calibration(
    target: str, draft: str, companion: str | None, sampling: SamplingParams, path: Path | None = None
) -> tuple[Profile, Path]:
    """The calibration profile ``blockspec sv calibrate`` saved for these model names and sampling (or ``path``),
    checked to be theirs, and where it was read from."""
    path = calibration_file(target, draft, companion, sampling_key(sampling), path)
    profile = Profile.load(path)
    profile.check(target=target, draft=draft, companion=companion, sampling=sampling_key(sampling))
    return profile, path


def load_latency(
    target: str, draft: str, companion: str | None, dtype: str, device, path: Path | None = None, on: str | None = None
) -> tuple[LatencyProfile, Path]:
    """The latency profile ``blockspec sv profile`` saved for these model names, dtype and device (or ``path``),
    checked to be theirs and, with ``on`` (``latency.kernels`` of the target), measured on these kernels, and where
    it was read from."""
    path = latency_file(target, draft, companion, dtype, str(device), path)
    profile = LatencyProfile.load(path)
    profile.check(target, draft, companion, dtype, device, on)
    return profile, path


class SVPolicy:
    """Speculative Verification: a step's verification lengths from predicted gains and measured latency.

    Each step makes four decisions, each using only what is known when it is made: ``draft_budget``,
    ``draft_next``, ``keep_drafting`` and ``lengths``, whose docstrings say what each decides and from what; then
    it learns online (``observe``). Settings: ``__init__``. Why it stays lossless: docs/algorithms.md
    ("Speculative Verification"); how to profile, calibrate and run it: docs/guide/sv.md.
    """

    def __init__(
        self,
        profile,
        latency,
        *,
        rule: str,
        max_draft: int,
        kind: str = SV_PREDICTOR,
        memory: float = 0.9,
        rate: float = 0.5,
        carry_over: bool = False,
        ragged: bool = False,
        whole_drafts: bool = False,
    ):
        """``kind`` is "draft" (draft-only features, no companion: the default) or "companion" (draft + companion
        features; needs ``companion=`` in the decoder). With ``ragged`` each row pays for its own verified tokens
        (``ragged_stopping_lengths``: a flattened batch, as vLLM's) instead of the batch padded to its widest row.
        With ``whole_drafts`` the engine drafts as vLLM's drafter does: the whole budget in one call (``draft_next``
        and ``keep_drafting`` always go on), all the positions drafted paid before any is verified, and a first
        draft forward every step, even when the budget is 0, that reads every token the previous step scored. A
        width w is then charged the first draft forward it causes in the next step, over 1 + w tokens a row (the
        latency profile's draft table up to K + 1 tokens), and ``catch_up`` is not read. ``memory``: the weight the
        gain history keeps at each step; ``rate``: the online calibration's step size (``observe``); ``carry_over``:
        see ``reset``."""
        if kind not in ("draft", "companion"):
            raise ValueError(f"kind must be 'draft' or 'companion', got {kind!r}")
        if kind == "companion" and latency.companion is None:
            raise ValueError("the latency profile has no companion costs: measure it with the companion")
        self.rule, self.max_draft, self.kind, self.memory, self.rate = rule, max_draft, kind, memory, rate
        self.carry_over, self.ragged, self.whole_drafts = carry_over, ragged, whole_drafts
        self.predictors = {"draft": profile.predictor(rule, "draft"), kind: profile.predictor(rule, kind)}
        self.latency = latency
        prior = list(profile.prior[rule])[:max_draft]
        self.prior = torch.tensor(prior + [prior[-1]] * (max_draft - len(prior)), dtype=torch.float64)
        self._predicted: dict[str, torch.Tensor] = {}  # this step's gains [B, K] per predictor, for ``learn``
        self._draft_features: list[torch.Tensor] = []
        self._batch, self._catch_up = 1, 1
        self._start()

    @classmethod
    def from_cache(
        cls,
        target,
        draft,
        *,
        sampling: SamplingParams,
        rule: str = "block",
        max_draft: int = MAX_DRAFT,
        kind: str = SV_PREDICTOR,
        companion: str | None = "auto",
        profile: Path | None = None,
        latency: Path | None = None,
        names: tuple[str, str] | None = None,
        **options,
    ) -> SVPolicy:
        """The policy for these loaded models and ``sampling``, from the profiles ``blockspec sv profile`` and
        ``blockspec sv calibrate`` saved for them (found by the models' names, dtype and device, as the command
        line finds them; ``names`` = (target, draft) overrides the names, ``profile`` and ``latency`` the files).
        ``companion`` names the companion the profiles were made with (``--companion``); "auto", as the command line
        does, is COMPANION on transformers and none on llama.cpp, whose target runs no companion (a ``prefix:K``
        companion is the target's own transformers layers). A missing or mismatched profile raises an error naming
        the command that makes it. ``options``: ``memory``, ``rate``, ``carry_over``."""
        from ..models.llamacpp import LlamaCppModel

        on_llamacpp = isinstance(target, LlamaCppModel)
        if companion == "auto":
            companion = None if on_llamacpp else COMPANION
        elif companion is not None and on_llamacpp:
            raise ValueError(
                f"companion {companion!r} runs on the target's transformers layers: on llama.cpp SV's profiles are "
                "made without one (leave companion out, or pass companion=None)"
            )
        target_name, draft_name = names or (model_name(target), model_name(draft))
        calibration, _ = load_calibration(target_name, draft_name, companion, sampling, profile)
        dtype = dtype_name(target.dtype)
        timing, _ = load_latency(target_name, draft_name, companion, dtype, target.device, latency, kernels(target))
        return cls(calibration, timing, rule=rule, max_draft=max_draft, kind=kind, **options)

    def reset(self) -> None:
        """At each ``generate`` call: the offsets and the gain history return to the profile's, so a call's output
        does not depend on earlier calls. With ``carry_over=True`` they are kept, and a call's verification
        lengths (its speed and, at a fixed seed, its tokens; never its law) depend on the calls before it."""
        if not self.carry_over:
            self._start()

    def _start(self) -> None:
        self.offsets = dict.fromkeys(self.predictors, 0.0)  # learnt online: added to each predictor's logits
        self.history = self.prior.clone()  # predicted gain per position, recent steps

    @property
    def needs_companion(self) -> bool:
        return self.kind == "companion"

    def step_seconds(self, batch: int, catch_up: int, drafted: int = 0, sampled: int = 0) -> Callable[[int], float]:
        """Predicted seconds of a step at this batch size that drafts, scores and verifies ``width`` tokens, when
        the draft has ``catch_up`` tokens to read first, has already run the forwards of ``drafted`` positions
        and sampled ``sampled`` tokens: those forwards are paid whatever the width, and the companion scores
        every token sampled, so a narrower width saves neither. With ``whole_drafts`` (vLLM) a step drafts the whole
        budget or nothing, and its first draft forward is the next step's, over 1 + ``width`` tokens a row."""

        def seconds(width: int) -> float:
            latency = self.latency
            scoring = latency.scoring(batch, max(width, sampled), catch_up) if self.needs_companion else 0.0
            if self.whole_drafts:  # the next step's first draft forward reads the 1 + width tokens scored now
                drafting = latency.drafting(batch, self.max_draft if width else 1, 1 + width, companion=False)
            else:
                drafting = latency.drafting(batch, max(width, drafted), catch_up, companion=False)
            return drafting + scoring + latency.target(batch, 1 + width)

        return seconds

    def expected_rate(self, batch: int, catch_up: int) -> None:
        return None  # prompt lookup does not run beside SV

    def draft_budget(self, batch: int, catch_up: int) -> int:
        """Decision 1, before drafting: from the recent history of predicted gains per position and the latency
        table, whether speculating pays at all at this batch size (``max_draft`` if so, else 0), with the draft's
        first forward priced at the ``catch_up`` tokens it must read (more after steps that did not draft; with
        ``whole_drafts``, the next step's over the 1 + width tokens scored, ``step_seconds``)."""
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
        """Decision 2, before the draft forward for position i > 1: whether the batch's plan, with the gains of
        position i predicted from its position, the drafted prefix's probability and position i - 1's draft
        features in place of its own, would reach i; so a stop rarely pays for a forward whose distribution then
        goes unused. The draft forwards already run are paid whatever is decided, and so is the companion's
        scoring of the tokens already sampled: only what is still to come (the next forward, scoring x_i, the
        target's wider forward) weighs against position i's gain."""
        if self.whole_drafts:
            return True
        known = torch.stack(self._draft_features, 1)  # [B, position - 1, F]
        # Position i's draft distribution is not known yet: its entropy and top probability are guessed to be
        # those of position i - 1; its position and the drafted prefix's probability (through x_{i-1}) are known.
        guessed = known[:, -1].clone()
        guessed[:, DRAFT_FEATURES.index("log_position")] = math.log(position)
        guessed[:, DRAFT_FEATURES.index("log_prefix_prob")] = prefix.to(guessed)
        guess = self.predict("draft", torch.cat([known, guessed[:, None]], dim=1))
        return self._plan_reaches(guess, drafted=position - 1)

    def keep_drafting(self, position: int, probs: torch.Tensor, prefix: torch.Tensor) -> bool:
        """Decision 3, once the draft's distribution at position i is known and before x_i is sampled: whether the
        stopping rule over the draft-only gains of positions 1..i reaches i. Only what is still to come weighs
        against position i's gain, as in ``draft_next``."""
        return self.keep_drafting_given(draft_features(probs[:, None], prefix[:, None], first=position)[:, 0])

    def keep_drafting_given(self, features: torch.Tensor) -> bool:
        """``keep_drafting`` from the draft-only features [B, F] of the next position."""
        self._draft_features.append(features)
        if self.whole_drafts:
            return True
        gains = self.predict("draft", torch.stack(self._draft_features, 1))
        return self._plan_reaches(gains, drafted=len(self._draft_features))

    def _plan_reaches(self, gains: torch.Tensor, drafted: int) -> bool:
        """Whether the stopping rule over the gains [B, i] of positions 1..i reaches position i, deciding before
        x_i is sampled (i - 1 tokens sampled) with the draft forwards of ``drafted`` positions already run."""
        position = gains.shape[1]
        limit = torch.full((len(gains),), position, dtype=torch.long)
        seconds = self.step_seconds(self._batch, self._catch_up, drafted=drafted, sampled=position - 1)
        return int(stopping_lengths(gains, limit, seconds).max()) == position

    def lengths(self, draft_tokens, draft_probs, companion_probs, drafted: torch.Tensor) -> torch.Tensor:
        """Decision 4, after drafting (and the companion's scoring of the block, with ``kind="companion"``): the
        stopping rule over the ``kind`` predictor's gains gives each row its verification length."""
        features = torch.stack(self._draft_features[: draft_tokens.shape[1]], 1).to(draft_tokens.device)
        if self.kind == "companion":
            probs = draft_distributions(draft_tokens, draft_probs, companion_probs.shape[-1])
            features = companion_features(draft_tokens, probs, companion_probs, self.rule, features)
        return self.lengths_given(features, drafted)

    def lengths_given(self, features: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
        """``lengths`` from the ``kind`` predictor's features [B, K, F] of the drafted positions."""
        gains = self.predict(self.kind, features)
        draft = gains if self.kind == "draft" else self.predict("draft", features[..., : len(DRAFT_FEATURES)])
        self._predicted = {"draft": draft, self.kind: gains}
        # positions drafted move towards this step's predictions, the others towards the (recalibrated) prior's
        now = torch.cat([gains.mean(0).cpu(), self.expected()[gains.shape[1] :]])
        self.history = self.memory * self.history + (1 - self.memory) * now
        # Drafting (and the companion's scoring) up to position i is paid by the time x_i is decided on; the
        # sunk seconds are those of i positions, never of how far drafting went (which depends on x_i), unless the
        # engine drafts whole budgets (vLLM), whose length does not depend on the tokens: then the budget's later
        # forwards are sunk and its first, in the next step, reads the 1 + width tokens a row scores now.
        batch, catch_up, budget, latency = self._batch, self._catch_up, features.shape[1], self.latency
        if self.whole_drafts:
            sunk = latency.drafting(batch, budget, 1, self.needs_companion) - latency.draft(batch, 1)

            def paid(position: int) -> float:
                return sunk

            def seconds(width: float) -> float:
                return latency.target(batch, 1 + width) + latency.draft(batch, 1 + width)

        else:

            def paid(position: int) -> float:
                return latency.drafting(batch, position, catch_up, self.needs_companion)

            def seconds(width: float) -> float:
                return latency.target(batch, 1 + width)

        if self.ragged:
            lengths = ragged_stopping_lengths(gains, drafted, lambda tokens: seconds(tokens / batch), paid=paid)
        else:
            lengths = stopping_lengths(gains, drafted, seconds, paid=paid)
        return lengths.to(drafted.device)

    def expected(self) -> torch.Tensor:
        """The calibrated mean gain per position [max_draft], shifted by the learnt offset of the predictor."""
        return torch.sigmoid(torch.logit(self.prior, eps=1e-6) + self.offsets[self.kind])

    def predict(self, kind: str, features: torch.Tensor) -> torch.Tensor:
        """Gains [B, K] predicted by the ``kind`` predictor from its features [B, K, F], with its learnt offset."""
        return torch.sigmoid(self.predictors[kind].logits(features) + self.offsets[kind])

    def observe(self, rows, draft_tokens, draft_probs, target_probs, verified, accepted) -> None:
        """After each step each predictor's logit offset takes one gradient step of the cross-entropy it was
        fitted with, on the exact gains of the positions just verified (``learn``), at ``rate``: the calibration
        follows the prompts at hand (a profile fitted on chat prompts underestimates code). The offsets are used
        from the next step on, so no decision on a token depends on that token."""
        if not bool((verified > 0).any()):
            return
        probs = draft_distributions(draft_tokens, draft_probs, target_probs.shape[-1])
        self.learn(position_gains(draft_tokens, probs, target_probs, self.rule), verified)

    def learn(
        self, labels: torch.Tensor, verified: torch.Tensor, predicted: dict[str, torch.Tensor] | None = None
    ) -> None:
        """One online step on the exact gains ``labels`` [B, W] of the first ``verified`` [B] <= W positions of
        each row (where the target's distributions are known), against the gains each predictor gave them
        (``predicted``, [B, >=W] per predictor; default: those of the step whose ``lengths`` were just decided)."""
        width = labels.shape[1]
        mask = torch.arange(width, device=labels.device) < verified.to(labels.device)[:, None]
        if not mask.any():
            return
        for kind, gains in (self._predicted if predicted is None else predicted).items():
            residual = labels.double() - gains[:, :width].to(labels.device)
            self.offsets[kind] += self.rate * float(residual[mask].mean())
