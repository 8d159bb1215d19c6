"""SV's profiles given to the vLLM plugin (BLOCKSPEC_VLLM_SV) are read and tried where vLLM starts, without vLLM:
a profile SV cannot decide with is refused with the switch's name and what is wrong, not left to raise inside
vLLM's worker at the first request or to make SV silently never draft."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from blockspec.policy import LatencyTable
from blockspec.policy.features import DRAFT_FEATURES
from blockspec.policy.latency import META_FIELDS, LatencyProfile
from blockspec.policy.predictor import Predictor, Profile
from blockspec.vllm import sv_hook
from blockspec.vllm.profile import first_forward_seconds
from blockspec.vllm.state import STATE
from blockspec.vllm.switches import SV_SWITCH, SWITCH


def write_profiles(directory, meta: dict | None = None, **changes) -> tuple[str, str]:
    """Hand-made profiles SV decides with (calibration path, latency path), the latency one measured with
    ``meta``; ``changes`` break them, as JSON: the calibration's "predictors" or "prior", or the latency
    profile's "target" or "draft" table."""
    calibration = Profile(
        "target",
        "draft",
        None,
        {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
        {"block": {"draft": Predictor(DRAFT_FEATURES, (1.0, -0.5, -0.5, 1.0, 0.4))}},
        {"block": [0.9, 0.8]},
    )
    latency = LatencyProfile(
        LatencyTable((1, 16), (1, 2, 3), ((1.0, 1.2, 1.4), (2.0, 2.4, 2.8))),
        LatencyTable((1, 16), (1, 2, 3), ((0.1, 0.15, 0.2), (0.2, 0.3, 0.4))),
        None,
        dict.fromkeys(META_FIELDS, "tiny") | (meta or {}),
    )
    paths = str(directory / "calibration.json"), str(directory / "latency.json")
    calibration.save(paths[0])
    latency.save(paths[1])
    for path, fields in ((paths[0], ("predictors", "prior")), (paths[1], ("target", "draft"))):
        data = json.loads(open(path).read())
        data.update({field: changes[field] for field in fields if field in changes})
        with open(path, "w") as file:
            file.write(json.dumps(data))
    return paths


def weights(*values) -> dict:
    return {"block": {"draft": {"features": list(DRAFT_FEATURES), "weights": list(values)}}}


def table(*seconds) -> dict:
    return {"batch_sizes": [1], "tokens": list(range(1, len(seconds) + 1)), "seconds": [list(seconds)]}


@pytest.fixture(autouse=True)
def block_rule(monkeypatch):
    monkeypatch.setenv(SWITCH, "block")
    yield
    sv_hook.use_sv(None)


def test_profiles_sv_decides_with_are_put_in_place(tmp_path):
    paths = write_profiles(tmp_path)
    sv_hook.use_sv(paths)
    assert STATE.sv_paths == list(paths) and STATE.sv_profiles is not None


@pytest.mark.parametrize(
    ("broken", "change", "message"),
    [
        (
            "no predictor for the rule",
            {"predictors": {"token": weights(1, 0, 0, 1, 0)["block"]}},
            "no 'draft' predictor",
        ),
        ("an empty prior", {"prior": {"block": []}}, "prior must list"),
        ("a prior above 1", {"prior": {"block": [1.5]}}, "prior must list"),
        ("a NaN prior", {"prior": {"block": [math.nan]}}, "prior must list"),
        ("a prior that is not a table", {"prior": [0.5]}, "calibration profile"),  # hand-edited JSON
        ("too few weights", {"predictors": weights(1.0, 0.0, 0.0, 1.0)}, "needs 5 finite weights"),
        ("a NaN weight", {"predictors": weights(1.0, math.nan, 0.0, 1.0, 0.0)}, "needs 5 finite weights"),
        (
            "other features",
            {"predictors": {"block": {"draft": {"features": ["bias"], "weights": [1.0]}}}},
            "reads \\('bias',\\)",
        ),
        ("a zero target table", {"target": table(0.0, 0.0, 0.0)}, "must be > 0 seconds"),
        ("a NaN target table", {"target": table(1.0, math.nan, 1.4)}, "finite and >= 0"),
        ("an infinite draft table", {"draft": table(math.inf)}, "finite and >= 0"),
        ("a negative draft table", {"draft": table(-0.1)}, "finite and >= 0"),
        ("a target table without drafts", {"target": table(1.0)}, "no width with drafts"),
        (
            "a draft table of one width (an earlier profile's average draft forward)",
            {"draft": table(0.1)},
            "first forward up to 1 tokens a request, but that forward reads every token the target scored, up to 3",
        ),
    ],
)
def test_profiles_sv_cannot_decide_with_are_refused_where_vllm_starts(tmp_path, broken, change, message):
    """Each is refused where vLLM starts, naming the profile: otherwise the first request would raise inside vLLM's
    worker (no predictor, empty prior, wrong feature count, zero latency) or SV would never draft (NaN)."""
    paths = write_profiles(tmp_path, **change)
    with pytest.raises(ValueError, match=message) as error:
        sv_hook.use_sv(paths)
    assert str(error.value).startswith(SV_SWITCH)
    assert STATE.sv_paths is None


def runner(target: str, draft: str, drafts: int = 2, dtype: str = "float32", device: str = "cpu"):
    """What SV reads of vLLM's model runner: the served models, dtype and device, and K."""
    import torch

    return SimpleNamespace(
        model_config=SimpleNamespace(model=target, dtype=getattr(torch, dtype)),
        speculative_config=SimpleNamespace(model=draft, num_speculative_tokens=drafts),
        device=torch.device(device),
    )


SERVED = {"target": "models/target", "draft": "models/draft", "dtype": "float32", "device": "cpu"}


@pytest.mark.parametrize(
    ("served", "message"),
    [
        (
            runner("models/other", "models/draft"),
            "measured with target 'models/target', but vLLM serves 'models/other'",
        ),
        (runner("models/target", "models/other"), "measured with draft"),
        (runner("models/target", "models/draft", dtype="bfloat16"), "measured with dtype 'float32'"),
        (runner("models/target", "models/draft", device="meta"), "measured with device 'cpu'"),
        (runner("models/target", "models/draft", drafts=3), "measured up to 2 drafts a request, but vLLM drafts 3"),
    ],
)
def test_a_latency_profile_measured_on_another_engine_is_refused(tmp_path, served, message):
    """The latency profile is measured in vLLM on the served models (python -m blockspec.vllm.profile): one
    measured on other models, dtype, device or fewer drafts would price SV's steps with another engine's
    seconds, so each is refused naming what differs."""
    paths = write_profiles(tmp_path, meta=SERVED)
    sv_hook.use_sv(paths)
    with pytest.raises(ValueError, match=f"{SV_SWITCH}: latency profile .*{message}"):
        sv_hook.sv_policy(served)
    assert STATE.sv_policy is None


def test_a_latency_profile_of_the_served_engine_is_used(tmp_path, monkeypatch):
    """The same models under another path to the same files are the same models."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "target").mkdir()
    (tmp_path / "models" / "draft").mkdir()
    monkeypatch.chdir(tmp_path)
    sv_hook.use_sv(write_profiles(tmp_path, meta=SERVED))
    policy = sv_hook.sv_policy(runner(str(tmp_path / "models" / "target"), "models/draft"))
    assert policy.max_draft == 2 and STATE.sv_policy is policy


@pytest.mark.parametrize("max_draft", [1, 2, 4])
def test_the_first_draft_forward_is_recovered_from_the_drafting_timed_after_each_width(max_draft):
    """vLLM's drafting after a step that verified w drafts a request is one forward over 1 + w tokens, then K - 1
    over one: with F(n) = 0.03 + 0.01 n, D(w) = F(1 + w) + (K - 1) F(1), and the profile gives back F(1..K + 1)."""
    forward = [0.03 + 0.01 * n for n in range(1, max_draft + 2)]
    drafting = [forward[w] + (max_draft - 1) * forward[0] for w in range(max_draft + 1)]
    assert first_forward_seconds(drafting, max_draft) == pytest.approx(forward)
