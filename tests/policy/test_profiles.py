"""Where SV's profiles are saved: one file per models' identity (not their file names), exact sampling values,
dtype and device; a profile an earlier blockspec saved under its old name is pointed to, never read as current."""

from __future__ import annotations

import os

import pytest

from blockspec.models import identity
from blockspec.models.presets import PRESETS
from blockspec.policy.profiles import (
    calibration_file,
    latency_file,
    latency_path,
    model_identity,
    profile_path,
    run_name,
)

SAMPLING = {"temperature": 0.7, "top_k": 0, "top_p": 1.0}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_model(folder, weights: bytes = b"weights") -> str:
    """A model folder as far as its identity goes: a config and a weight file, never loaded."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    return str(folder)


def both_paths(target, draft, companion="prefix:8", sampling=SAMPLING):
    return profile_path(target, draft, companion, sampling), latency_path(target, draft, companion, "float32", "cpu")


def test_profiles_of_models_with_the_same_file_name_in_other_folders_do_not_share_a_file(tmp_path):
    draft = fake_model(tmp_path / "draft")
    one, other = fake_model(tmp_path / "a" / "model", b"weights"), fake_model(tmp_path / "b" / "model", b"others")
    for mine, theirs in zip(both_paths(one, draft), both_paths(other, draft)):
        assert mine != theirs and mine.parent == theirs.parent
        assert "model" in mine.name  # the name still says which models, for whoever lists the folder


def test_a_touched_or_copied_model_keeps_its_profile(tmp_path):
    """The identity is the weights' content: a bare ``touch``, a download again or a copy of the same bytes finds
    the profile measured on them (an SV calibration takes hours)."""
    target, draft = fake_model(tmp_path / "t"), fake_model(tmp_path / "d")
    before = both_paths(target, draft)
    os.utime(tmp_path / "t" / "model.safetensors", ns=(1, 1))
    assert both_paths(target, draft) == before
    copy = fake_model(tmp_path / "elsewhere" / "t")  # the same name and bytes in another folder
    assert both_paths(copy, draft) == before


def test_calibrations_at_sampling_values_equal_to_6_digits_do_not_share_a_file(tmp_path):
    target, draft = fake_model(tmp_path / "t"), fake_model(tmp_path / "d")
    close = {**SAMPLING, "temperature": 0.7000001}
    assert profile_path(target, draft, None, SAMPLING) != profile_path(target, draft, None, close)
    wider = {**SAMPLING, "top_p": 0.9999999}
    assert profile_path(target, draft, None, SAMPLING) != profile_path(target, draft, None, wider)
    # equal values are one key, whether written as int or float
    assert profile_path(target, draft, None, {**SAMPLING, "top_p": 1}) == profile_path(target, draft, None, SAMPLING)


def test_other_weights_of_the_same_size_and_time_under_the_same_path_are_another_profile(tmp_path, monkeypatch):
    """``rsync -a`` or ``cp -p`` replace weights in place keeping their size and modification time: the profile
    measured on the old ones must not be served for the new."""
    target, draft = fake_model(tmp_path / "t"), fake_model(tmp_path / "d")
    before = both_paths(target, draft)
    assert both_paths(target, draft) == before  # stable while nothing changes
    weights = tmp_path / "t" / "model.safetensors"
    old = weights.stat()
    weights.write_bytes(b"WEIGHTS")  # other bytes, the same size
    os.utime(weights, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    monkeypatch.setattr(identity, "_fingerprints", {})  # a later process: nothing read before is remembered
    after = both_paths(target, draft)
    assert after[0] != before[0] and after[1] != before[1]


def test_a_readme_edit_keeps_the_profile(tmp_path):
    target, draft = fake_model(tmp_path / "t"), fake_model(tmp_path / "d")
    before = both_paths(target, draft)
    (tmp_path / "t" / "README.md").write_text("notes")
    assert both_paths(target, draft) == before


def test_a_relative_path_is_the_folder_it_names(tmp_path, monkeypatch):
    target = fake_model(tmp_path / "t")
    monkeypatch.chdir(tmp_path)
    assert model_identity("t") == model_identity(target)


def test_a_preset_is_its_gguf_hash_and_a_loaded_models_label_is_kept(tmp_path):
    name, preset = next(iter(PRESETS.items()))
    assert preset.sha256 in model_identity(name)
    folder = fake_model(tmp_path / "d")
    assert model_identity(f"{folder} (int8)") == f"{model_identity(folder)} (int8)"
    assert model_identity(f"{name} (Q4_0)") == f"{model_identity(name)} (Q4_0)"
    assert model_identity("prefix:8") == "prefix:8" and model_identity(None) == "none"


def test_a_presets_identity_reads_no_file_and_looks_up_no_hub_id(monkeypatch):
    """`blockspec generate` finds its latency profile on every run: for the bundled presets (loaded as "<name>" or
    "<name> (Q4_0)") that costs no read of their weights and no import of huggingface_hub."""

    def fail(*args):
        raise AssertionError("read or looked up")

    monkeypatch.setattr(identity, "hub_snapshot", fail)
    monkeypatch.setattr(identity.integrity, "fingerprint", fail)
    for name in PRESETS:
        assert PRESETS[name].sha256 in model_identity(f"{name} (Q4_0)") == f"{model_identity(name)} (Q4_0)"


def test_profiles_of_the_bundled_models_keep_the_file_names_earlier_blockspecs_gave_them():
    """Keying folders by content changed their profiles' digests; the presets' are kept, so a calibration of the
    bundled pair made by an earlier blockspec is still found."""
    sampled = profile_path("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "prefix:8", SAMPLING)
    assert sampled.name == "calibration-qwen2.5-coder-1.5b-qwen2.5-coder-0.5b-prefix_8-T0.7-k0-p1-3bf0bd226a5ba4f6.json"
    timed = latency_path("qwen2.5-coder-1.5b (Q4_0)", "qwen2.5-coder-0.5b (Q4_0)", None, "gguf", "cpu")
    assert timed.name == "latency-qwen2.5-coder-1.5b_Q4_0-qwen2.5-coder-0.5b_Q4_0-None-gguf-cpu-9c8022d58096a03f.json"


def test_latency_profiles_are_apart_per_dtype_and_device(tmp_path):
    target, draft = fake_model(tmp_path / "t"), fake_model(tmp_path / "d")
    paths = {
        latency_path(target, draft, None, dtype, device)
        for dtype in ("float32", "gguf")
        for device in ("cpu", "cuda:0")
    }
    assert len(paths) == 4


def test_profiles_are_apart_per_backend_and_draft_quantization_and_unchanged_on_transformers(tmp_path):
    """A profile made on llama.cpp with a q4_0 draft is found neither by llama.cpp with the draft as shipped nor by
    transformers, and the other way round; on transformers with the draft as it is, the names are the models' as
    typed, so the profiles saved before the backend was part of the key are still found."""
    target, draft = fake_model(tmp_path / "t"), fake_model(tmp_path / "d")
    runs = [("hf", None), ("hf", "int8"), ("llamacpp", None), ("llamacpp", "q4_0")]
    keyed = {run: both_paths(run_name(target, run[0]), run_name(draft, *run)) for run in runs}
    for paths in zip(*keyed.values()):  # the calibration paths, then the latency paths
        assert len(set(paths)) == len(runs)
    assert keyed["hf", None] == both_paths(target, draft)
    assert run_name("qwen2.5-coder-0.5b", "llamacpp", "q4_0") == "qwen2.5-coder-0.5b (llama.cpp, q4_0)"


def test_a_missing_profile_names_the_command_it_is_given():
    command = "blockspec sv calibrate --target t --draft d --backend llamacpp --draft-quant q4_0"
    with pytest.raises(FileNotFoundError, match=f"run `{command}` first$"):
        calibration_file("t", "d", None, SAMPLING, command=command)
    with pytest.raises(FileNotFoundError, match="run `blockspec sv profile` with the same models first$"):
        latency_file("t", "d", None, "gguf", "cpu")


def test_profile_names_fit_a_file_system_whatever_the_paths(tmp_path):
    long = [fake_model(tmp_path / (letter * 200) / ("m" * 200)) for letter in "ab"]
    for path in both_paths(*long, companion=long[0]):
        assert len(path.name) <= 255


@pytest.mark.parametrize("kind", ["calibration", "latency"])
def test_a_profile_saved_under_an_earlier_name_is_pointed_to_not_read(kind, tmp_path, cache):
    """An earlier blockspec named profiles by the models' base names (and sampling to 6 digits): such a file may
    belong to other models, so it is never read in place of the missing one; the error names it and how to use
    it if it is right."""
    target, draft = fake_model(tmp_path / "t"), fake_model(tmp_path / "d")
    find = {
        "calibration": lambda: calibration_file(target, draft, "prefix:8", SAMPLING),
        "latency": lambda: latency_file(target, draft, "prefix:8", "float32", "cpu"),
    }[kind]
    with pytest.raises(
        FileNotFoundError, match=f"run `blockspec sv {'calibrate' if kind == 'calibration' else 'profile'}`"
    ):
        find()
    old = {
        "calibration": cache / "sv" / "calibration-t-d-prefix8-T0.7-k0-p1.json",
        "latency": cache / "sv" / "latency-t-d-prefix8-float32-cpu.json",
    }[kind]
    old.parent.mkdir(parents=True)
    old.write_text("{}")
    option = {"calibration": "--sv-profile", "latency": "--latency"}[kind]
    with pytest.raises(FileNotFoundError, match="earlier blockspec") as error:
        find()
    assert str(old) in str(error.value) and option in str(error.value)
    new = {"calibration": profile_path(target, draft, "prefix:8", SAMPLING), "latency": both_paths(target, draft)[1]}
    new[kind].write_text("{}")
    assert find() == new[kind]


@pytest.mark.parametrize("kind", ["calibration", "latency"])
def test_a_missing_profile_names_those_saved_for_the_same_names_under_another_digest(kind, tmp_path):
    """New weights under the same name, or a profile of an earlier blockspec that digested models otherwise: the
    error names the profiles saved for the same names, which the user may know to be right, besides the command
    that measures one again (hours, for a calibration)."""
    target, draft = fake_model(tmp_path / "t"), fake_model(tmp_path / "d")
    find = {
        "calibration": lambda: calibration_file(target, draft, "prefix:8", SAMPLING),
        "latency": lambda: latency_file(target, draft, "prefix:8", "float32", "cpu"),
    }[kind]
    saved = dict(zip(["calibration", "latency"], both_paths(target, draft)))[kind]
    saved.parent.mkdir(parents=True)
    saved.write_text("{}")
    (tmp_path / "t" / "model.safetensors").write_bytes(b"retrained")
    option = {"calibration": "--sv-profile", "latency": "--latency"}[kind]
    with pytest.raises(FileNotFoundError, match="under another digest: for other weights") as error:
        find()
    assert str(saved) in str(error.value) and option in str(error.value)


def test_an_explicit_profile_path_is_used_as_given(tmp_path):
    given = tmp_path / "mine.json"
    with pytest.raises(FileNotFoundError, match="sv calibrate"):
        calibration_file("t", "d", None, SAMPLING, given)
    given.write_text("{}")
    assert calibration_file("t", "d", None, SAMPLING, given) == given
    assert latency_file("t", "d", None, "float32", "cpu", given) == given
    assert os.path.samefile(given, latency_file("t", "d", None, "float32", "cpu", str(given)))
