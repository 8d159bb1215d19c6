"""Calibration: record drafted positions with their features and exact gains, fit the predictors, and replay.

``record`` runs ordinary speculative decoding (every drafted token verified, token rule) on calibration prompts
with a recording policy. Per row and step it keeps, for the K drafted positions: the draft-only features, the
companion's plug-in gain and overlap under each rule, the exact gains under each rule (from the target's
distributions, ``blockspec.verify.position_gains``), and the accepted length. ``fit_profile`` fits a draft-only and a
draft+companion predictor per rule on some prompts and reports held-out log-loss and Brier score on the others
(the companion's information gain). ``replay`` evaluates any length policy offline on recorded steps against a
latency table, with a hindsight oracle that knows how many tokens the target accepts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..policy import FixedLength
from ..policy.features import companion_features, draft_features
from ..policy.predictor import MONOTONE, Predictor, Profile, evaluate, feature_names
from ..verify import SAMPLED_RULES, draft_distributions, position_gains


@dataclass
class Recording:
    """Recorded row-steps: N rows of K positions (positions past ``num_verified`` are padding)."""

    prompt: torch.Tensor  # [N] index of the calibration prompt
    num_verified: torch.Tensor  # [N]
    accepted: torch.Tensor  # [N] tau under the token rule with all drafted tokens verified
    draft: torch.Tensor  # [N, K, len(DRAFT_FEATURES)]
    companion: dict[str, torch.Tensor]  # rule -> [N, K, len(COMPANION_FEATURES)]; empty: recorded without one
    labels: dict[str, torch.Tensor]  # rule -> [N, K] exact gains

    def positions(self, rows: torch.Tensor) -> torch.Tensor:
        """Mask [n, K] of the real (drafted) positions of ``rows``."""
        k = self.draft.shape[1]
        return torch.arange(k)[None, :] < self.num_verified[rows, None]

    def features(self, kind: str, rule: str) -> torch.Tensor:
        return self.draft if kind == "draft" else self.companion[rule]

    def save(self, path) -> None:
        torch.save(self.__dict__, path)

    @classmethod
    def load(cls, path) -> Recording:
        # weights_only: tensors and containers only, so a planted recording cannot run code, even where
        # TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD makes full unpickling torch.load's default.
        return cls(**torch.load(path, weights_only=True))


class Recorder(FixedLength):
    """A fixed-length policy that also records every step (used by ``record``); with ``companion=False`` the draft's
    features alone, for a decoder without a companion (llama.cpp runs none)."""

    def __init__(self, max_draft: int, *, companion: bool = True):
        super().__init__(max_draft)
        self.needs_companion = companion
        self.rows: list[dict] = []
        self.offset = 0  # index of the current generate() call's first prompt (set by ``record``)
        self._pending: dict = {}

    def draft_budget(self, batch: int, catch_up: int) -> int:
        self._draft: list[torch.Tensor] = []
        return self.max_draft

    def keep_drafting(self, position: int, probs: torch.Tensor, prefix: torch.Tensor) -> bool:
        self._draft.append(draft_features(probs[:, None], prefix[:, None], first=position)[:, 0])
        return True

    def lengths(self, draft_tokens, draft_probs, companion_probs, drafted):
        draft = torch.stack(self._draft[: draft_tokens.shape[1]], 1)
        self._pending = {"draft": draft, "companion": {}}
        if companion_probs is not None:
            probs = draft_distributions(draft_tokens, draft_probs, companion_probs.shape[-1])
            self._pending["companion"] = {
                m: companion_features(draft_tokens, probs, companion_probs, m, draft) for m in SAMPLED_RULES
            }
        return drafted

    def observe(self, rows, draft_tokens, draft_probs, target_probs, verified, accepted) -> None:
        if draft_tokens.shape[1] < self.max_draft:
            return  # a row's last step: fewer drafted positions than the recording's width
        probs = draft_distributions(draft_tokens, draft_probs, target_probs.shape[-1])
        labels = {
            m: position_gains(draft_tokens, probs.double(), target_probs.double(), m).float() for m in SAMPLED_RULES
        }
        for b in range(len(draft_tokens)):
            self.rows.append(
                {
                    "prompt": self.offset + rows[b],
                    "num_verified": int(verified[b]),
                    "accepted": int(accepted[b]),
                    "draft": self._pending["draft"][b].cpu(),
                    "companion": {m: f[b].cpu() for m, f in self._pending["companion"].items()},
                    "labels": {m: v[b].cpu() for m, v in labels.items()},
                }
            )

    def recording(self) -> Recording:
        rows = self.rows
        return Recording(
            prompt=torch.tensor([r["prompt"] for r in rows]),
            num_verified=torch.tensor([r["num_verified"] for r in rows]),
            accepted=torch.tensor([r["accepted"] for r in rows]),
            draft=torch.stack([r["draft"] for r in rows]),
            companion={m: torch.stack([r["companion"][m] for r in rows]) for m in SAMPLED_RULES}
            if self.needs_companion
            else {},
            labels={m: torch.stack([r["labels"][m] for r in rows]) for m in SAMPLED_RULES},
        )


def record(
    decoder, prompts, *, sampling, max_new_tokens: int, batch_size: int, seed: int = 0, progress: bool = True
) -> Recording:
    """Decode ``prompts`` with ``decoder`` (a SpeculativeDecoder whose policy is a ``Recorder``) and return what
    was recorded; row b of a batch uses seed + its prompt index."""
    from tqdm.auto import tqdm

    recorder = decoder.policy
    if not isinstance(recorder, Recorder):
        raise TypeError("record() needs a SpeculativeDecoder built with policy=Recorder(max_draft)")
    for start in tqdm(range(0, len(prompts), batch_size), desc="calibration batches", disable=not progress):
        recorder.offset = start
        decoder.generate(
            prompts[start : start + batch_size], max_new_tokens=max_new_tokens, sampling=sampling, seed=seed + start
        )
    if not recorder.rows:
        raise ValueError("calibration recorded no complete drafted block: use more prompts or more new tokens")
    return recorder.recording()


def split_prompts(recording: Recording, held_out: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices (train, test), split by prompt so no prompt is on both sides."""
    prompts = sorted(set(recording.prompt.tolist()))
    random.Random(seed).shuffle(prompts)
    n_test = max(1, round(held_out * len(prompts))) if len(prompts) > 1 else 0
    test = torch.isin(recording.prompt, torch.tensor(prompts[:n_test], dtype=torch.long))
    return (~test).nonzero().squeeze(1), test.nonzero().squeeze(1)


def fit_profile(
    recording: Recording,
    *,
    target: str,
    draft: str,
    companion: str | None,
    sampling: dict,
    held_out: float = 0.25,
    seed: int = 0,
) -> tuple[Profile, dict]:
    """Fit every (rule, kind) predictor on the training prompts (the draft-only ones alone for a recording without
    a companion); returns the profile (refitted on all prompts) and the held-out evaluation {rule: {kind:
    metrics}} plus calibration curves."""
    train, test = split_prompts(recording, held_out, seed)
    report, predictors = {}, {}
    kinds = ("draft", "companion") if recording.companion else ("draft",)
    for rule in SAMPLED_RULES:
        report[rule], predictors[rule] = {}, {}
        for kind in kinds:
            x, y = _flat(recording, kind, rule, train)
            fitted = Predictor.fit(feature_names(kind), x, y, monotone=MONOTONE[kind])
            if len(test):
                xt, yt = _flat(recording, kind, rule, test)
                report[rule][kind] = {**evaluate(fitted, xt, yt), "curve": calibration_curve(fitted(xt), yt)}
            x, y = _flat(recording, kind, rule, torch.arange(len(recording.prompt)))
            predictors[rule][kind] = Predictor.fit(feature_names(kind), x, y, monotone=MONOTONE[kind])
    prior = {m: _mean_by_position(recording, m) for m in SAMPLED_RULES}
    metrics = {
        "positions": int(recording.positions(torch.arange(len(recording.prompt))).sum()),
        "prompts": len(set(recording.prompt.tolist())),
        "held_out": {
            m: {k: {n: v for n, v in r.items() if n != "curve"} for k, r in report[m].items()} for m in SAMPLED_RULES
        },
    }
    profile = Profile(
        target=target,
        draft=draft,
        companion=companion,
        sampling=sampling,
        predictors=predictors,
        prior=prior,
        metrics=metrics,
    )
    return profile, report


def calibration_curve(predicted: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> list[tuple[float, float, int]]:
    """(mean predicted, mean exact gain, count) per bin of equal predicted-gain width."""
    index = (predicted.double() * bins).long().clamp(max=bins - 1)
    curve = []
    for b in range(bins):
        chosen = index == b
        if chosen.any():
            curve.append((float(predicted[chosen].mean()), float(labels[chosen].double().mean()), int(chosen.sum())))
    return curve


def _flat(recording: Recording, kind: str, rule: str, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mask = recording.positions(rows)
    return recording.features(kind, rule)[rows][mask], recording.labels[rule][rows][mask]


def _mean_by_position(recording: Recording, rule: str) -> list[float]:
    labels, mask = recording.labels[rule], recording.positions(torch.arange(len(recording.prompt)))
    return (labels * mask).sum(0).div(mask.sum(0).clamp(min=1)).tolist()
