"""`blockspec sv profile`, `sv calibrate`, `sv replay` and `generate --policy sv`, end to end on tiny models."""

from __future__ import annotations

import errno
import itertools
import json
import subprocess
import sys

import pytest
import torch
from kits.tiny import save_tiny

from blockspec import cli
from blockspec.bench import replay
from blockspec.models import load
from blockspec.policy import LatencyTable
from blockspec.policy.latency import LatencyProfile
from blockspec.verify import SAMPLED_RULES

pytestmark = pytest.mark.usefixtures("probes_in_a_temporary_cache")  # sv on transformers probes the machine


def run(*args: str, cache=None) -> subprocess.CompletedProcess:
    env = None
    if cache is not None:
        import os

        env = {**os.environ, "BLOCKSPEC_CACHE": str(cache)}
    return subprocess.run(
        [sys.executable, "-m", "blockspec.cli", *args], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny pair with its latency and calibration profiles in a private cache directory."""
    root = tmp_path_factory.mktemp("sv")
    target, draft = save_tiny(root / "target"), save_tiny(root / "draft", noise=0.3)
    models = ["--target", target, "--draft", draft, "--dtype", "float32"]
    profile = run(
        "sv",
        "profile",
        *models,
        "--companion",
        "prefix:1",
        "--batch-sizes",
        "1",
        "2",
        "--tokens",
        "1",
        "2",
        "3",
        "--context",
        "8",
        "--repeats",
        "1",
        cache=root,
    )
    assert profile.returncode == 0, profile.stderr
    calibrate = run(
        "sv",
        "calibrate",
        *models,
        "--companion",
        "prefix:1",
        "--dataset",
        "lm1b",
        "--prompts",
        "6",
        "--max-new-tokens",
        "24",
        "--max-draft",
        "3",
        "--batch-size",
        "3",
        "--recording",
        str(root / "rec.pt"),
        cache=root,
    )
    assert calibrate.returncode == 0, calibrate.stderr
    return root, models, profile, calibrate


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_profile_and_calibrate_save_where_generate_looks(calibrated):
    root, _, profile, calibrate = calibrated
    assert "target forward seconds" in profile.stdout and "companion forward seconds" in profile.stdout
    saved = sorted(p.name for p in (root / "sv").iterdir())
    assert [n.split("-")[0] for n in saved] == ["calibration", "calibration", "latency"]  # .json, .png; latency
    report = json.loads(calibrate.stdout.strip().splitlines()[-1])
    for rule in SAMPLED_RULES:
        for kind in ("draft", "companion"):
            metrics = report["held_out"][rule][kind]
            assert metrics["entropy_of_labels"] <= metrics["log_loss"]  # the labels' own entropy is the floor
    assert "held-out log-loss" in calibrate.stdout


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_generate_with_sv_gives_the_greedy_text_of_the_target(calibrated):
    root, models, _, _ = calibrated
    common = [*models, "--max-new-tokens", "16", "--temperature", "0", "--max-draft", "3"]
    plain = run("generate", *common, "--draft", "none", "abc de", cache=root)
    # calibrated at T=1: greedy needs its own calibration profile, and says so
    missing = run("generate", *common, "--policy", "sv", "--companion", "prefix:1", "abc de", cache=root)
    assert missing.returncode == 2 and "blockspec sv calibrate" in missing.stderr
    sampled = run(
        "generate",
        *models,
        "--max-new-tokens",
        "16",
        "--max-draft",
        "3",
        "--seed",
        "3",
        "--policy",
        "sv",
        "--companion",
        "prefix:1",
        "abc de",
        "fgh",
        cache=root,
    )
    assert sampled.returncode == 0 and "sv K=3" in sampled.stderr, sampled.stderr
    with_companion = run(
        "generate",
        *models,
        "--max-new-tokens",
        "16",
        "--max-draft",
        "3",
        "--policy",
        "sv",
        "--sv-predictor",
        "companion",
        "--companion",
        "prefix:1",
        "abc de",
        cache=root,
    )
    assert with_companion.returncode == 0, with_companion.stderr
    profile = next((root / "sv").glob("calibration-*.json"))
    greedy = run(
        "generate",
        *common,
        "--policy",
        "sv",
        "--companion",
        "prefix:1",
        "--sv-profile",
        str(profile),
        "abc de",
        cache=root,
    )
    assert greedy.returncode == 2 and "calibrated with sampling" in greedy.stderr
    assert plain.returncode == 0 and plain.stdout.strip()


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_replay_compares_policies_and_the_oracle(calibrated):
    root, _, _, _ = calibrated
    profile = next((root / "sv").glob("calibration-*.json"))
    latency = next((root / "sv").glob("latency-*.json"))
    out = run(
        "sv",
        "replay",
        "--recording",
        str(root / "rec.pt"),
        "--sv-profile",
        str(profile),
        "--latency",
        str(latency),
        "--batch-sizes",
        "1",
        "2",
        "--steps",
        "20",
        "--out",
        str(root / "replay.json"),
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads((root / "replay.json").read_text())
    assert (root / "replay.png").stat().st_size > 0
    policies = {r["policy"] for r in rows}
    assert policies == {"target-only", "fixed K=1", "fixed K=2", "SV draft", "SV companion", "oracle"}
    for r in rows:
        if r["policy"] == "target-only":
            assert r["speedup"] == 1.0 and r["verified_per_emitted"] == 0.0
    for rule in ("token", "block"):
        for batch in (1, 2):
            best_fixed = max(
                r["speedup"]
                for r in rows
                if r["rule"] == rule and r["batch"] == batch and r["policy"].startswith("fixed")
            )
            oracle = next(r for r in rows if (r["rule"], r["batch"], r["policy"]) == (rule, batch, "oracle"))
            assert oracle["speedup"] >= 1.0  # it may always choose not to speculate
            assert oracle["speedup"] >= best_fixed * 0.9  # a ceiling, up to the expected-vs-realised noise


def test_the_oracle_maximises_the_runs_pooled_goodput_not_each_steps():
    """Brute force over every assignment of widths to 4 steps: the oracle's pooled goodput is the maximum, and on
    these steps it beats the per-step argmax of emitted / seconds."""
    latency = LatencyProfile(
        target=LatencyTable((2,), (1, 2, 3), ((1.0, 1.8, 1.8),)),
        draft=LatencyTable((2,), (1, 2), ((0.05, 0.1),)),
        companion=None,
        meta={},
    )
    taus = [torch.tensor(t) for t in ([2, 2], [2, 0], [1, 1], [2, 2])]
    num_drafts = [torch.tensor([2, 2])] * len(taus)

    def emitted(tau, w):
        return float((1 + tau.clamp(max=w)).sum())

    def seconds(w):
        return latency.target(2, 1 + w) + latency.drafting(2, w, replay.CATCH_UP, companion=False)

    def pooled(widths):
        return sum(emitted(tau, w) for tau, w in zip(taus, widths)) / sum(seconds(w) for w in widths)

    chosen = replay.oracle(taus, num_drafts, latency, batch=2)
    best = max(pooled(widths) for widths in itertools.product(range(3), repeat=len(taus)))
    assert pooled([w for _, w in chosen]) == pytest.approx(best, rel=1e-12)
    per_step = [max(range(3), key=lambda w, tau=tau: emitted(tau, w) / seconds(w)) for tau in taus]
    assert pooled(per_step) < best - 0.1
    assert all(torch.equal(lengths, tau.clamp(max=w)) for (lengths, w), tau in zip(chosen, taus))


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_missing_profiles_are_explained(tmp_path):
    target = save_tiny(tmp_path / "target")
    out = run(
        "generate", "--target", target, "--draft", target, "--dtype", "float32", "--policy", "sv", "hi", cache=tmp_path
    )
    assert out.returncode == 2 and "blockspec sv calibrate" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("command", ["profile", "calibrate"])
@pytest.mark.parametrize("flag, expected", [([], False), (["--allow-download"], True)])
def test_sv_commands_download_hub_models_only_when_allowed(command, flag, expected, monkeypatch):
    calls = []

    def fake_load_model(name, **kwargs):
        calls.append(kwargs["allow_download"])
        raise ValueError("stopped before measuring")

    monkeypatch.setattr(load, "load_model", fake_load_model)
    assert cli.main(["sv", command, *flag, "--target", "some/model"]) == 2
    assert calls == [expected]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
@pytest.mark.parametrize("command", ["profile", "calibrate"])
def test_sv_commands_refuse_an_unusable_device_before_loading_a_model(command, monkeypatch, capsys):
    monkeypatch.setattr(load, "load_model", lambda name, **kwargs: pytest.fail(f"loaded {name}"))
    assert cli.main(["sv", command, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("blockspec: error: ") and "cuda" in err


@pytest.mark.parametrize("command", ["profile", "calibrate"])
def test_sv_commands_refuse_to_replace_a_saved_profile_before_loading_a_model(command, tmp_path, monkeypatch, capsys):
    """A profile can take hours to make: an existing one is replaced only with --force, and the refusal comes
    before any model loads, naming the models the existing profile holds."""
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"meta": {"target": "a/model", "draft": "d", "companion": None, "date": "2026-01-01"}}))
    monkeypatch.setattr(load, "load_model", lambda name, **kwargs: pytest.fail(f"loaded {name}"))
    assert cli.main(["sv", command, "--out", str(saved)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--force" in err and "a/model" in err and str(saved) in err

    def stop(name, **kwargs):
        raise ValueError("stopped before measuring")

    monkeypatch.setattr(load, "load_model", stop)
    assert cli.main(["sv", command, "--out", str(saved), "--force"]) == 2
    err = capsys.readouterr().err
    assert "will replace" in err and "stopped before measuring" in err
    assert json.loads(saved.read_text())["meta"]["target"] == "a/model"  # kept until a new profile is saved


def test_sv_calibrate_refuses_to_replace_the_default_profile_before_loading_a_model(tmp_path, monkeypatch, capsys):
    from blockspec.policy.profiles import profile_path

    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(load, "load_model", lambda name, **kwargs: pytest.fail(f"loaded {name}"))
    saved = profile_path("t", "d", "prefix:8", {"temperature": 0.5, "top_k": 0, "top_p": 1.0})
    saved.parent.mkdir(parents=True)
    saved.write_text(json.dumps({"target": "t", "draft": "d", "companion": "prefix:8", "sampling": {}}))
    common = ["sv", "calibrate", "--target", "t", "--draft", "d", "--companion", "prefix:8", "--top-p", "1.0"]
    assert cli.main([*common, "--temperature", "0.5"]) == 2
    assert "--force" in capsys.readouterr().err
    # 0.5000001 is another calibration, which must not replace this one
    with pytest.raises(pytest.fail.Exception, match="loaded t"):
        cli.main([*common, "--temperature", "0.5000001", "--debug"])


def test_sv_commands_refuse_an_output_folder_they_cannot_write_before_loading_a_model(tmp_path, monkeypatch, capsys):
    from blockspec.cli import sv as sv_cli

    monkeypatch.setattr(load, "load_model", lambda name, **kwargs: pytest.fail(f"loaded {name}"))

    def read_only(*args, **kwargs):  # what a read-only mount answers, to root too
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(sv_cli.tempfile, "TemporaryFile", read_only)
    assert cli.main(["sv", "calibrate", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err and "--out" in err


def test_sv_profile_takes_the_dtype_generate_picks(tmp_path, monkeypatch):
    """``--dtype auto`` (the default of generate, bench and sv profile) is the machine probe's choice on transformers
    in all three, so the profile sv profile saves is the one ``generate --policy sv`` looks for."""
    from blockspec import auto

    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path / "cache"))
    probe = {"bfloat16": {"1": 2.0}, "float32": {"1": 1.0}}  # float32 the faster here
    monkeypatch.setattr(auto, "cpu_probe", lambda refresh=False: probe)
    target, draft = save_tiny(tmp_path / "target"), save_tiny(tmp_path / "draft", noise=0.3)
    grid = ["--batch-sizes", "1", "--tokens", "1", "2", "--context", "8", "--repeats", "1"]
    profile = ["sv", "profile", "--target", target, "--draft", draft, "--companion", "none", *grid]
    assert cli.main(profile) == 0
    probe.update(bfloat16={"1": 0.5})  # now bfloat16
    assert cli.main(profile) == 0
    saved = [LatencyProfile.load(path).meta["dtype"] for path in (tmp_path / "cache" / "sv").glob("latency-*.json")]
    assert sorted(saved) == ["bfloat16", "float32"]
