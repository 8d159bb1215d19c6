"""The gain predictor and the calibration profile that carries it.

A predictor maps the features of ``features.py`` to a predicted gain in (0, 1): a logistic model fitted to
the exact gains (soft labels, cross-entropy: a proper scoring rule for a probability), cheap to evaluate, and
monotone non-decreasing in one named feature (the companion's plug-in gain, or the draft's top probability),
enforced by a softplus-parametrised weight. A profile holds one predictor per (verification rule, feature set)
and refuses to serve other models or other sampling settings than those it was calibrated on.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..files import write_atomic
from .features import COMPANION_FEATURES, DRAFT_FEATURES

PROFILE_SCHEMA = 1
_EPS = 1e-6


@dataclass(frozen=True)
class Predictor:
    features: tuple[str, ...]
    weights: tuple[float, ...]  # on the raw (unstandardised) features; "bias" is a feature

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Predicted gains [...] from features [..., len(self.features)]."""
        return torch.sigmoid(self.logits(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The predicted gains' logits [...] (float64)."""
        return x.double() @ torch.tensor(self.weights, dtype=torch.float64, device=x.device)

    @classmethod
    def fit(
        cls, features: tuple[str, ...], x: torch.Tensor, y: torch.Tensor, *, monotone: str, l2: float = 1e-4
    ) -> Predictor:
        """Minimise the mean cross-entropy of sigmoid(x @ w) against labels y in [0, 1], with w[monotone] >= 0."""
        if x.ndim != 2 or x.shape[1] != len(features) or y.shape != x.shape[:1]:
            raise ValueError(f"fit needs x [N, {len(features)}] and y [N], got {tuple(x.shape)} and {tuple(y.shape)}")
        if len(y) < 2 * len(features):
            raise ValueError(f"too few calibration positions to fit {len(features)} weights: {len(y)}")
        x, y = x.double(), y.double().clamp(0.0, 1.0)
        scale = x.std(0).clamp(min=1e-3)
        scale[features.index("bias")] = 1.0
        z = x / scale
        m = features.index(monotone)
        free = torch.zeros(len(features), dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([free], max_iter=200, line_search_fn="strong_wolfe", tolerance_change=1e-12)

        def weights():
            return torch.cat([free[:m], torch.nn.functional.softplus(free[m : m + 1]), free[m + 1 :]])

        def loss():
            opt.zero_grad()
            logits = z @ weights()
            value = torch.nn.functional.binary_cross_entropy_with_logits(logits, y) + l2 * free.square().sum()
            value.backward()
            return value

        opt.step(loss)
        return cls(tuple(features), tuple((weights().detach() / scale).tolist()))


def log_loss(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean cross-entropy of predicted gains against soft labels (lower is better)."""
    p, y = predicted.double().clamp(_EPS, 1 - _EPS), labels.double()
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def brier(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    return float((predicted.double() - labels.double()).square().mean())


@dataclass(frozen=True)
class Profile:
    """Calibrated predictors for one (target, draft, companion, sampling): ``predictors[rule][kind]`` with
    rule one of ``SAMPLED_RULES`` and kind "draft" (draft-only features) or "companion"."""

    target: str
    draft: str
    companion: str | None
    sampling: dict
    predictors: dict[str, dict[str, Predictor]]
    prior: dict[str, list[float]]  # mean exact gain per position, per rule: the policy's starting history
    metrics: dict = field(default_factory=dict)
    schema: int = PROFILE_SCHEMA

    def predictor(self, rule: str, kind: str) -> Predictor:
        try:
            return self.predictors[rule][kind]
        except KeyError:
            raise ValueError(f"this SV profile has no {kind!r} predictor for the {rule!r} rule") from None

    def check(self, *, target: str, draft: str, companion: str | None, sampling: dict) -> None:
        """Refuse to serve models or sampling settings other than those calibrated (a silent mismatch would
        only cost speed, never exactness, but the speed claims would be wrong)."""
        wanted = {"target": target, "draft": draft, "companion": companion, "sampling": sampling}
        for name, value in wanted.items():
            if getattr(self, name) != value:
                raise ValueError(
                    f"SV profile was calibrated with {name} {getattr(self, name)!r}, not {value!r}: "
                    "run `blockspec sv calibrate` for this configuration"
                )

    def save(self, path: str | Path) -> None:
        write_atomic(path, json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        if data.get("schema") != PROFILE_SCHEMA:
            raise ValueError(f"{path}: SV profile schema {data.get('schema')!r}, this blockspec reads {PROFILE_SCHEMA}")
        try:
            data["predictors"] = {
                rule: {kind: Predictor(tuple(p["features"]), tuple(p["weights"])) for kind, p in kinds.items()}
                for rule, kinds in data["predictors"].items()
            }
            return cls(**data)
        except (KeyError, TypeError) as error:
            raise ValueError(f"{path}: not a complete SV profile ({error})") from None


def feature_names(kind: str) -> tuple[str, ...]:
    return {"draft": DRAFT_FEATURES, "companion": COMPANION_FEATURES}[kind]


MONOTONE = {"draft": "log_max_prob", "companion": "logit_plugin_gain"}


def evaluate(predictor: Predictor, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    p = predictor(x)
    return {
        "log_loss": log_loss(p, y),
        "brier": brier(p, y),
        "mean_predicted": float(p.mean()),
        "mean_label": float(y.double().mean()),
        "positions": len(y),
        "entropy_of_labels": _label_entropy(y),
    }


def _label_entropy(y: torch.Tensor) -> float:
    """Log-loss of the perfect predictor (the labels' own entropy): the floor of ``log_loss``."""
    return log_loss(y, y) if len(y) else math.nan
