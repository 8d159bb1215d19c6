"""Latency profiles: measured grid and metadata, JSON round trip, refusal of foreign or broken profiles, and
models left usable after measuring. Tiny in-process models; no timing assertions beyond positivity."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from kits.tiny import tiny_model

from blockspec.auto import measure_profile
from blockspec.models.hf import HFModel
from blockspec.policy.latency import DRAFT_TOKENS, META_FIELDS, LatencyProfile

BATCH_SIZES, TOKENS = (1, 3), (1, 2, 4)


def tiny_trio():
    return (
        HFModel(tiny_model(seed=0), name="tiny-target"),
        HFModel(tiny_model(seed=1, layers=1), name="tiny-draft"),
        HFModel(tiny_model(seed=2, layers=1), name="tiny-companion"),
    )


def measure(target, draft, companion, **grid):
    grid = {"batch_sizes": BATCH_SIZES, "tokens": TOKENS, **grid}
    return measure_profile(target, draft, companion, context=8, repeats=1, progress=False, **grid)


@pytest.fixture(scope="module")
def profile() -> LatencyProfile:
    return measure(*tiny_trio())


def test_measured_grid_is_as_requested_and_positive(profile):
    tables = {
        "target": (profile.target, TOKENS),
        "draft": (profile.draft, DRAFT_TOKENS),
        "companion": (profile.companion, TOKENS),
    }
    for name, (table, tokens) in tables.items():
        assert table.batch_sizes == BATCH_SIZES and table.tokens == tokens, name
        assert len(table.seconds) == len(BATCH_SIZES) and all(len(row) == len(tokens) for row in table.seconds)
        assert all(math.isfinite(s) and s > 0 for row in table.seconds for s in row), name


def test_the_draft_is_measured_at_the_widths_asked_for():
    target, draft, _ = tiny_trio()
    wider = measure(target, draft, None, batch_sizes=(1,), draft_tokens=(1, 8, 16))
    assert wider.draft.tokens == (1, 8, 16) and wider.target.tokens == TOKENS and wider.companion is None


def test_meta_records_models_and_machine(profile):
    assert set(META_FIELDS) <= set(profile.meta)
    meta = profile.meta
    assert (meta["target"], meta["draft"], meta["companion"]) == ("tiny-target", "tiny-draft", "tiny-companion")
    assert (meta["dtype"], meta["device"], meta["context"], meta["repeats"]) == ("float32", "cpu", 8, 1)
    assert meta["torch"] == torch.__version__ and meta["torch_threads"] == torch.get_num_threads()


def test_models_are_usable_after_measuring():
    models = tiny_trio()
    measure(*models, batch_sizes=(2,), tokens=(1, 3))
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    tokens, valid = torch.tensor([[8, 9], [10, 11]]), torch.ones(2, 2, dtype=torch.bool)
    for model in models:
        assert model.lengths.tolist() == []  # the measured batch was freed
        fresh = HFModel(model.model, name="fresh")
        model.prefill(prompts)
        fresh.prefill(prompts)
        torch.testing.assert_close(model.forward(tokens, valid), fresh.forward(tokens, valid))
        assert model.lengths.tolist() == [7, 4]


def test_save_load_round_trip(profile, tmp_path):
    path = tmp_path / "latency.json"
    profile.save(path)
    assert json.loads(path.read_text())["schema"] == 1
    assert LatencyProfile.load(path) == profile


def test_profile_without_companion_round_trips(tmp_path):
    target, draft, _ = tiny_trio()
    profile = measure(target, draft, None, batch_sizes=(2,), tokens=(1, 3))
    assert profile.companion is None and profile.meta["companion"] is None
    profile.save(tmp_path / "latency.json")
    assert LatencyProfile.load(tmp_path / "latency.json") == profile


def test_load_refuses_another_schema(profile, tmp_path):
    path = tmp_path / "latency.json"
    profile.save(path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "schema": 2}))
    with pytest.raises(ValueError, match="schema 2"):
        LatencyProfile.load(path)


@pytest.mark.parametrize("where, field", [(None, "draft"), ("meta", "dtype"), ("target", "seconds")])
def test_load_refuses_a_missing_field(profile, tmp_path, where, field):
    path = tmp_path / "latency.json"
    profile.save(path)
    data = json.loads(path.read_text())
    del (data if where is None else data[where])[field]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"missing {field}"):
        LatencyProfile.load(path)


def test_check_passes_for_the_measured_models(profile):
    profile.check("tiny-target", "tiny-draft", "tiny-companion", "float32", "cpu")
    profile.check("tiny-target", "tiny-draft", "tiny-companion", torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("field, value", [("target", "other-target"), ("companion", None), ("dtype", "bfloat16")])
def test_check_names_the_field_that_differs(profile, field, value):
    given = {
        "target_name": "tiny-target",
        "draft_name": "tiny-draft",
        "companion_name": "tiny-companion",
        "dtype": "float32",
        "device": "cpu",
    }
    given["dtype" if field == "dtype" else f"{field}_name"] = value
    with pytest.raises(ValueError, match=f"measured for {field} .*, not {value}: run `blockspec sv profile`"):
        profile.check(**given)


def test_a_profile_records_its_kernels_and_check_refuses_others(profile, monkeypatch):
    from blockspec import machine
    from blockspec.policy.latency import kernels

    target = tiny_trio()[0]
    here = kernels(target)
    assert profile.meta["kernels"] == here
    profile.check("tiny-target", "tiny-draft", "tiny-companion", "float32", "cpu", here)
    monkeypatch.setattr(machine, "cpu_model", lambda: "another CPU")
    with pytest.raises(ValueError, match="other kernels than this machine's"):
        profile.check("tiny-target", "tiny-draft", "tiny-companion", "float32", "cpu", kernels(target))


def test_check_refuses_a_profile_of_another_device(profile):
    foreign = dataclasses.replace(profile, meta={**profile.meta, "device": "cuda:0"})
    with pytest.raises(ValueError, match="measured for device cuda:0, not cpu"):
        foreign.check("tiny-target", "tiny-draft", "tiny-companion", "float32", "cpu")
