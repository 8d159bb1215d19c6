"""Hand-made SV calibration profiles and latency profiles for the tests."""

from __future__ import annotations

from collections.abc import Sequence

from blockspec.policy import LatencyTable
from blockspec.policy.features import COMPANION_FEATURES, DRAFT_FEATURES
from blockspec.policy.latency import LatencyProfile
from blockspec.policy.predictor import Predictor, Profile
from blockspec.verify import SAMPLED_RULES

DRAFT_WEIGHTS = (1.0, -0.5, -0.5, 1.0, 0.4)  # DRAFT_FEATURES: bias, log_position, entropy, log_max_prob, log_prefix
COMPANION_WEIGHTS = (0.3, -0.2, -0.3, 0.5, 0.2, 1.5, 0.5)  # ... + logit_plugin_gain, log_overlap
PRIOR = [0.9, 0.9, 0.9]


def hand_profile(draft_weights=DRAFT_WEIGHTS, companion_weights=COMPANION_WEIGHTS, prior=PRIOR, **names) -> Profile:
    predictors = {
        rule: {
            "draft": Predictor(DRAFT_FEATURES, tuple(draft_weights)),
            "companion": Predictor(COMPANION_FEATURES, tuple(companion_weights)),
        }
        for rule in SAMPLED_RULES
    }
    fields = {
        "target": "tiny-target",
        "draft": "tiny-draft",
        "companion": "tiny-target[:1]",
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
        **names,
    }
    return Profile(
        **fields,
        predictors=predictors,
        prior={m: list(prior) for m in SAMPLED_RULES},
        metrics={"note": "hand-set weights"},
    )


def flat_latency(target: tuple[float, float], draft: float) -> LatencyProfile:
    return LatencyProfile(
        target=LatencyTable((1,), (1, 2), (target,)),
        draft=LatencyTable((1,), (1, 2), ((draft,) * 2,)),
        companion=LatencyTable((1,), (1, 2), ((1e-9,) * 2,)),
        meta={},
    )


def profile(target_ms: Sequence[float], draft_ms: float) -> LatencyProfile:
    """A latency profile at batch 1: target seconds for 1..len(target_ms) tokens, a flat draft forward."""
    target = LatencyTable((1,), tuple(range(1, len(target_ms) + 1)), (tuple(t / 1e3 for t in target_ms),))
    draft = LatencyTable((1,), (1, 2, 4), ((draft_ms / 1e3,) * 3,))
    return LatencyProfile(target, draft, None, meta={})


CHEAP_VERIFICATION = [100, 102, 104, 106, 108, 110, 112, 114, 116]  # AVX-512-BF16-like: width almost free
LINEAR_VERIFICATION = [100 * n for n in range(1, 10)]  # AVX2 bf16-like: every scored token costs a step
# The bundled pair on llama.cpp's AVX2 kernels (the AVX2-only AMD EPYC, 2 threads, the draft in q4_0), seconds: the
# target over 1..9 tokens, the draft over 1, 2, 4, 8 and 32 tokens; at the prior a one-token draft pays by a hair
AVX2_LLAMACPP = LatencyProfile(
    LatencyTable((1,), tuple(range(1, 10)), ((0.0939, 0.1371, 0.1838, 0.2357, 0.2973, 0.288, 0.3449, 0.5102, 0.5376),)),
    LatencyTable((1,), (1, 2, 4, 8, 32), ((0.0279, 0.0378, 0.0493, 0.0890, 0.2674),)),
    None,
    meta={},
)


ENGINE_LATENCY = LatencyProfile(
    target=LatencyTable((1, 3), (1, 2, 3, 4, 5), ((1.0, 1.3, 1.5, 1.52, 1.55), (1.0, 1.05, 1.08, 1.1, 1.5))),
    draft=LatencyTable((1, 3), (1, 2), ((0.02, 0.03), (0.01, 0.02))),
    companion=LatencyTable((1, 3), (1, 2, 3, 4, 5), ((0.03,) * 5, (0.01,) * 5)),
    meta={},
)
