"""Speculative Verification on the llama.cpp backend from the command line: `sv profile`, `sv calibrate` and
`generate --policy sv` in-process on tiny GGUFs (``kits.tinygguf``), the companion refused there before a model
loads, and profiles that never cross between backends or draft quantizations.

The GGUFs' tokenizer is ``tiny.tiny_tokenizer``'s vocabulary (``tinygguf`` mirrors it), but transformers cannot
rebuild a tokenizer from so small a GGUF vocabulary (its byte-level BPE converter fails on the one dead merge
llama.cpp requires), so ``tokenizer_from_gguf`` hands the loaders ``tiny_tokenizer`` for a GGUF file."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, replace

import pytest
import transformers
from kits.tiny import perturbed, tiny_model, tiny_tokenizer
from kits.tinygguf import save_gguf

from blockspec import cli
from blockspec.bench import records as rec
from blockspec.models import load
from blockspec.policy.latency import LatencyProfile
from blockspec.sampling import SamplingParams

pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.usefixtures("one_thread", "probes_in_a_temporary_cache")  # sv on hf probes the machine

PROMPT = "abc de"
GREEDY = ["--temperature", "0"]


@dataclass(frozen=True)
class Pair:
    target: str
    draft: str
    cache: object  # the private BLOCKSPEC_CACHE (a Path) holding the profiles made on llama.cpp


@pytest.fixture(scope="module")
def tokenizer_from_gguf():
    """transformers' AutoTokenizer.from_pretrained with a gguf_file returns ``tiny_tokenizer()`` (module docstring)."""
    original = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(*args, **kwargs):
        return tiny_tokenizer() if kwargs.get("gguf_file") else original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
        yield


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tokenizer_from_gguf) -> Pair:
    """A tiny target and a close draft as GGUFs, with the latency and greedy calibration profiles `sv profile` and
    `sv calibrate` make on llama.cpp for the draft as shipped (``--draft-quant none``), in a private cache."""
    root = tmp_path_factory.mktemp("svgguf")
    target = tiny_model(sharpness=5.0)
    # close enough that SV finds verifying worth its cost: the run below must verify drafted tokens
    draft = perturbed(target, scale=0.1, seed=1)
    found = Pair(save_gguf(target, root / "target.gguf"), save_gguf(draft, root / "draft.gguf"), root)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BLOCKSPEC_CACHE", str(root))
        models = ["--target", found.target, "--draft", found.draft, "--backend", "llamacpp", "--draft-quant", "none"]
        grid = ["--batch-sizes", "1", "2", "--tokens", "1", "2", "3", "4", "--context", "8", "--repeats", "1"]
        assert cli.main(["sv", "profile", *models, *grid]) == 0
        recorded = ["--dataset", "lm1b", "--prompts", "6", "--max-new-tokens", "24", "--max-draft", "3"]
        recording = ["--recording", str(root / "recording.pt")]
        assert cli.main(["sv", "calibrate", *models, *recorded, "--batch-size", "3", *GREEDY, *recording]) == 0
    return found


@pytest.fixture
def cache(pair, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(pair.cache))
    return pair.cache


def generate(pair: Pair, *options: str) -> list[str]:
    common = ["--target", pair.target, "--draft", pair.draft, "--max-new-tokens", "16", "--max-draft", "3"]
    return ["generate", *common, *GREEDY, "--no-chat", *options, PROMPT]


def test_profiles_made_on_llama_cpp_are_named_for_it(pair, cache):
    saved = sorted(p.name for p in (cache / "sv").glob("*.json"))
    assert len(saved) == 2
    for name in saved:  # the backend in both names, the draft as shipped: no quantization in its name
        assert "target.gguf_llama.cpp-draft.gguf_llama.cpp-None-" in name, name


def test_generate_with_sv_on_llama_cpp_gives_the_greedy_text_of_the_target(pair, cache, capsys, tmp_path):
    """With the profiles `sv` made, found by default: the same text as the target alone. The tiny draft is as large as
    the tiny target, so its measured latency says drafting never pays (SV then verifies nothing and the check would
    be empty); a copy of the latency profile with the draft 50 times faster, as a real draft is, makes SV verify."""
    assert cli.main(generate(pair, "--draft", "none", "--backend", "llamacpp")) == 0
    alone = capsys.readouterr().out
    assert cli.main(generate(pair, "--policy", "sv", "--draft-quant", "none")) == 0  # backend auto: llama.cpp
    out, err = capsys.readouterr()
    assert "sv K=3" in err and out == alone, err
    measured = LatencyProfile.load(next((cache / "sv").glob("latency-*.json")))
    seconds = tuple(tuple(s / 50 for s in row) for row in measured.draft.seconds)
    cheap = replace(measured, draft=replace(measured.draft, seconds=seconds))
    cheap.save(tmp_path / "latency.json")
    faster = ["--draft-quant", "none", "--latency", str(tmp_path / "latency.json")]
    assert cli.main(generate(pair, "--policy", "sv", *faster)) == 0
    out, err = capsys.readouterr()
    assert "llama.cpp, the GGUF as it is" in err and "sv K=3" in err, err
    drafted = re.search(r"([0-9.]+) drafted per step", err)
    assert drafted is not None and float(drafted[1]) > 0, f"SV verified no drafted token, so tested nothing: {err}"
    assert out == alone and len(alone.strip()) >= 8


def test_generate_does_not_load_a_draft_its_cached_step_latency_prices_out(pair, cache, monkeypatch, capsys):
    """The default on llama.cpp asks the step latency cached for its draft (the q4_0 copy, by the name its adapter will
    have) before loading it: where no length pays, it decodes by prompt lookup alone and never loads the draft
    (seconds and memory on a machine where no draft pays); where one pays, the draft loads, and the probe it is
    priced by is asked of that very name."""
    from kits.svkit import CHEAP_VERIFICATION, LINEAR_VERIFICATION, profile

    from blockspec import auto

    loaded, asked, probed = [], [], []
    real = load.load_model
    monkeypatch.setattr(load, "load_model", lambda name, **options: loaded.append(name) or real(name, **options))
    dear, cheap = profile(LINEAR_VERIFICATION, draft_ms=100), profile(CHEAP_VERIFICATION, draft_ms=1)
    monkeypatch.setattr(auto, "cached_latency", lambda target, draft, batch: asked.append(draft) or dear)
    assert cli.main(generate(pair, "--backend", "llamacpp")) == 0
    err = capsys.readouterr().err
    assert loaded == [pair.target] and asked == [f"{pair.draft} (llama.cpp, q4_0)"], (loaded, asked)
    assert "speculation cannot pay here" in err and "loading draft" not in err, err
    assert err.splitlines()[-1].startswith("[block, lookup alone, up to 32, "), err
    monkeypatch.setattr(auto, "cached_latency", lambda target, draft, batch: asked.append(draft) or cheap)
    monkeypatch.setattr(auto, "latency_probe", lambda target, draft, batch: probed.append(draft.name) or cheap)
    assert cli.main(generate(pair, "--backend", "llamacpp")) == 0
    assert loaded == [pair.target, pair.target, pair.draft] and probed == asked[-1:], (loaded, probed, asked)
    assert "block, auto K=3" in capsys.readouterr().err


def test_replay_of_a_recording_without_a_companion_scores_the_draft_only_policy(pair, cache, tmp_path):
    profiles = {kind: str(next((cache / "sv").glob(f"{kind}-*.json"))) for kind in ("calibration", "latency")}
    out = tmp_path / "replay.json"
    replay = ["sv", "replay", "--recording", str(cache / "recording.pt"), "--sv-profile", profiles["calibration"]]
    replay += ["--latency", profiles["latency"], "--batch-sizes", "1", "2", "--steps", "10", "--out", str(out)]
    assert cli.main(replay) == 0
    policies = {row["policy"] for row in json.loads(out.read_text())}
    assert policies == {"target-only", "fixed K=1", "fixed K=2", "SV draft", "oracle"}


def test_the_library_finds_the_profiles_the_command_line_made(pair, cache):
    """``SVPolicy.from_cache`` on the loaded llama.cpp models, named by the adapters themselves, finds the files that
    `sv profile` and `sv calibrate` saved: both name a model with what runs it."""
    from blockspec.policy import SVPolicy

    target = load.load_model(pair.target, backend="llamacpp")
    draft = load.load_model(pair.draft, backend="llamacpp")
    greedy = SamplingParams(temperature=0.0)
    policy = SVPolicy.from_cache(target, draft, sampling=greedy, companion=None)
    assert policy.latency.meta["draft"] == f"{pair.draft} (llama.cpp)"
    # by default it looks for no companion on llama.cpp, as the command line does; one named there is refused
    assert SVPolicy.from_cache(target, draft, sampling=greedy).latency.meta == policy.latency.meta
    with pytest.raises(ValueError, match="runs on the target's transformers layers: on llama.cpp"):
        SVPolicy.from_cache(target, draft, sampling=greedy, companion="prefix:8")


@pytest.mark.parametrize(
    "options, command",
    [
        # llama.cpp with the draft in q4_0 (what --draft-quant auto picks there)
        ([], "--backend llamacpp --draft-quant q4_0"),
        # transformers, on the same files, without a companion either: only the backend tells the two apart
        (
            ["--backend", "hf", "--dtype", "float32", "--companion", "none"],
            "--backend hf --draft-quant none --companion none",
        ),
    ],
)
def test_a_profile_made_for_one_backend_or_quantization_is_not_found_by_another(pair, cache, capsys, options, command):
    """The profiles on disk were made on llama.cpp with the draft as shipped: neither a q4_0 draft nor transformers
    finds them, and the error names the exact command that makes the missing one."""
    assert cli.main(generate(pair, "--policy", "sv", *options)) == 2
    err = capsys.readouterr().err
    wanted = (
        f"run `blockspec sv calibrate --target {pair.target} --draft {pair.draft} {command} --temperature 0.0 "
        "--top-k 0 --top-p 1.0` first"
    )
    assert wanted in err, err
    assert "under another digest" not in err  # the other configuration's file is not offered in its place


def test_profiles_passed_for_another_quantization_are_refused(pair, cache, capsys):
    """Named explicitly, the files of the draft as shipped are still refused for a q4_0 draft, naming the field."""
    calibration = next((cache / "sv").glob("calibration-*.json"))
    latency = next((cache / "sv").glob("latency-*.json"))
    passed = ["--sv-profile", str(calibration), "--latency", str(latency)]
    assert cli.main(generate(pair, "--policy", "sv", "--draft-quant", "q4_0", *passed)) == 2
    err = capsys.readouterr().err
    assert f"calibrated with draft '{pair.draft} (llama.cpp)', not '{pair.draft} (llama.cpp, q4_0)'" in err, err


def test_a_missing_latency_profile_names_the_command_that_makes_it(pair, cache, capsys, tmp_path):
    missing = tmp_path / "latency.json"
    assert cli.main(generate(pair, "--policy", "sv", "--draft-quant", "none", "--latency", str(missing))) == 2
    err = capsys.readouterr().err
    wanted = (
        f"{missing} does not exist: run `blockspec sv profile --target {pair.target} --draft {pair.draft} "
        f"--backend llamacpp --draft-quant none --out {missing}` first"
    )
    assert wanted in err, err


def test_profile_and_calibrate_on_llama_cpp_save_under_the_names_generate_looks_for(pair, cache, tmp_path, capsys):
    """The same pair copied elsewhere (the same weights, so the same identity) with the q4_0 draft: what `sv profile`
    and `sv calibrate` save is what generate then finds, and a second `sv profile` is refused before it measures."""
    shutil.copy(pair.target, tmp_path / "target.gguf")
    shutil.copy(pair.draft, tmp_path / "draft.gguf")
    models = ["--target", str(tmp_path / "target.gguf"), "--draft", str(tmp_path / "draft.gguf")]
    grid = ["--batch-sizes", "1", "--tokens", "1", "2", "--context", "4", "--repeats", "1"]
    assert cli.main(["sv", "profile", *models, *grid]) == 0  # backend auto, draft-quant auto: llama.cpp, q4_0
    saved = capsys.readouterr().out
    assert "draft.gguf_llama.cpp_q4_0-None-gguf-cpu-" in saved, saved
    assert cli.main(["sv", "profile", *models, *grid]) == 2
    assert "--force" in capsys.readouterr().err
    recorded = ["--dataset", "lm1b", "--prompts", "4", "--max-new-tokens", "16", "--max-draft", "2", *GREEDY]
    assert cli.main(["sv", "calibrate", *models, *recorded]) == 0
    run = ["generate", *models, "--policy", "sv", "--max-new-tokens", "4", *GREEDY, "--no-chat", PROMPT]
    assert cli.main(run) == 0, capsys.readouterr().err


def test_bench_runs_sv_draft_on_llama_cpp_with_the_q4_0_draft_and_its_profiles(pair, cache, tmp_path, capsys):
    """`bench --backend llamacpp` runs sv-draft with the draft in q4_0, as `generate --policy sv` runs it there, and
    finds the profiles `sv profile` and `sv calibrate` save for that draft; passed the files of the draft as shipped
    instead, it refuses them, naming the draft they were made for."""
    models = ["--target", pair.target, "--draft", pair.draft, "--backend", "llamacpp"]
    quant = ["--draft-quant", "q4_0", "--force"]  # --force: another test may have saved them for the same weights
    grid = ["--batch-sizes", "1", "--tokens", "1", "2", "3", "4", "--context", "8", "--repeats", "1"]
    assert cli.main(["sv", "profile", *models, *quant, *grid]) == 0
    recorded = ["--dataset", "lm1b", "--prompts", "4", "--max-new-tokens", "16", "--max-draft", "3", *GREEDY]
    assert cli.main(["sv", "calibrate", *models, *quant, *recorded]) == 0
    bench = ["bench", *models, "--no-chat", "--configs", "target-only", "sv-draft", "--datasets", "lm1b"]
    bench += ["--prompts", "2", "--max-new-tokens", "8", "--max-draft", "3", "--temperatures", "0"]
    assert cli.main([*bench, "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    records = list(rec.read(tmp_path / "out" / "records.jsonl"))
    assert {r.config for r in records} == {"target-only", "sv-draft"} and all(r.ok for r in records), records
    for record in (r for r in records if r.config == "sv-draft"):
        assert record.meta["draft_quant"] == "q4_0" and record.meta["companion"] is None, record.meta
        assert all("draft.gguf_llama.cpp_q4_0-" in record.meta[k] for k in ("latency", "sv_profile")), record.meta
    shipped = {
        k: next((cache / "sv").glob(f"{k}-*draft.gguf_llama.cpp-None-*.json")) for k in ("calibration", "latency")
    }
    passed = ["--sv-profile", str(shipped["calibration"]), "--latency", str(shipped["latency"])]
    assert cli.main([*bench, *passed, "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert f"calibrated with draft '{pair.draft} (llama.cpp)', not '{pair.draft} (llama.cpp, q4_0)'" in err, err


@pytest.fixture
def loads(monkeypatch):
    """Fails the test if any model loads."""
    monkeypatch.setattr(load, "load_model", lambda name, **kwargs: pytest.fail(f"loaded {name}"))


@pytest.mark.parametrize(
    "args, said",
    [
        (["generate", "--policy", "sv", "--sv-predictor", "companion", "hi"], "use --sv-predictor draft"),
        (["generate", "--policy", "sv", "--companion", "prefix:1", "hi"], "leave --companion out"),
        (["sv", "calibrate", "--sv-predictor", "companion"], "use --sv-predictor draft"),
        (["sv", "calibrate", "--companion", "prefix:1"], "leave --companion out"),
        (["sv", "profile", "--companion", "prefix:1"], "leave --companion out"),
    ],
)
@pytest.mark.parametrize("backend", [[], ["--backend", "llamacpp"]])  # auto: llama.cpp for GGUF files
def test_the_companion_is_refused_on_llama_cpp_before_a_model_loads(tmp_path, loads, capsys, args, said, backend):
    models = ["--target", str(tmp_path / "t.gguf"), "--draft", str(tmp_path / "d.gguf")]
    assert cli.main([*args[:-1], *models, *backend, args[-1]] if args[0] == "generate" else [*args, *models]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and "--backend hf" in err, err


def test_the_companion_predictor_stays_available_on_transformers(tmp_path, monkeypatch, capsys):
    """The refusal is llama.cpp's alone: on transformers the same options reach the model loading."""

    def stop(name, **kwargs):
        assert kwargs["backend"] == "hf"
        raise ValueError("stopped before loading")

    monkeypatch.setattr(load, "load_model", stop)
    models = ["--target", str(tmp_path / "t.gguf"), "--draft", str(tmp_path / "d.gguf"), "--backend", "hf"]
    assert cli.main(["sv", "calibrate", *models, "--sv-predictor", "companion", "--out", str(tmp_path / "p.json")]) == 2
    assert "stopped before loading" in capsys.readouterr().err
