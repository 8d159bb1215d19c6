"""`blockspec bench` when things go wrong: a run that raises, a resume with other settings, other arithmetic,
libraries or model bytes, or into an older run directory, two benches into one directory, a damaged records or
settings file, other processes competing for the cores; and the machine facts behind it."""

from __future__ import annotations

import builtins
import errno
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from kits.tiny import save_tiny

from blockspec import machine
from blockspec.auto import Arithmetic
from blockspec.bench import provenance, report, runner
from blockspec.bench import records as rec
from blockspec.cli import main as cli_main
from blockspec.models import identity

pytestmark = pytest.mark.usefixtures("quiet_machine")  # tests/bench/conftest.py

PROC_BUSY_SECONDS = machine.busy_seconds  # before quiet_machine replaces it


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Two prompts through target-only and block at K = 2, four tokens each: the cheapest bench that has a
    baseline and a speedup over it."""
    root = tmp_path_factory.mktemp("faults")
    return runner.BenchConfig(
        target=save_tiny(root / "target"),
        draft=save_tiny(root / "draft", noise=0.3),
        dtype="float32",
        datasets=("lm1b",),
        prompts_per_dataset=2,
        max_drafts=(2,),
        configs=("target-only", "block"),
        max_new_tokens=4,
        out=root / "out",
    )


def fail_first_target_only(monkeypatch, error: BaseException) -> None:
    """target-only raises ``error`` on the first prompt (its warm-up and every other run go through)."""
    generate = runner.Executor._generate

    def flaky(self, item, max_new_tokens):
        if item.config == "target-only" and item.dataset != "warm-up" and item.round == 0:
            raise error
        return generate(self, item, max_new_tokens)

    monkeypatch.setattr(runner.Executor, "_generate", flaky)


def no_model_loads(monkeypatch) -> None:
    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("blockspec.models.load.load_model", load_model)


# --- a failing run --------------------------------------------------------------------------------------------


def test_a_failing_run_is_recorded_and_the_bench_goes_on(small, tmp_path, monkeypatch):
    fail_first_target_only(monkeypatch, RuntimeError("out of memory"))
    records = list(rec.read(runner.run(replace(small, out=tmp_path), progress=False)))
    assert len(records) == 2 * 2
    (failed,) = [r for r in records if not r.ok]
    assert (failed.config, failed.seed) == ("target-only", small.seed)  # the first prompt's
    assert failed.status == rec.FAILED and failed.error == "RuntimeError: out of memory" and failed.new_tokens == 0
    assert all(r.new_tokens > 0 for r in records if r.ok)


def test_a_resume_does_not_retry_failed_runs_unless_asked(small, tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        fail_first_target_only(patch, RuntimeError("out of memory"))
        records_file = runner.run(replace(small, out=tmp_path), progress=False)
    before = records_file.read_text()
    runner.run(replace(small, out=tmp_path), progress=False)
    assert records_file.read_text() == before  # the failed run is not retried
    runner.run(replace(small, out=tmp_path, retry_failed=True), progress=False)
    records = list(rec.read(records_file))
    assert len(records) == 2 * 2 + 1 and sum(not r.ok for r in records) == 1
    built = report.build_report(records)
    assert built.left_out.failed == () and built.baselines[0].prompts == 2  # the retry replaced the failure


def test_ctrl_c_still_stops_the_bench(small, tmp_path, monkeypatch):
    fail_first_target_only(monkeypatch, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        runner.run(replace(small, out=tmp_path), progress=False)
    assert not (tmp_path / runner.RECORDS).exists()  # target-only of the first prompt is the first run


def test_failed_runs_do_not_count_towards_the_precision_stop(tmp_path):
    path = tmp_path / runner.RECORDS

    def write(failed_prompt: int | None) -> None:
        path.unlink(missing_ok=True)
        for p in range(runner.MIN_PROMPTS):
            for config in ("token", "block"):
                failed = p == failed_prompt and config == "block"
                rec.append(
                    path,
                    rec.Record(
                        dataset="d",
                        prompt_id=f"d/{p}",
                        config=config,
                        max_draft=2,
                        temperature=1.0,
                        batch_size=1,
                        seed=p,
                        new_tokens=0 if failed else 6,
                        wall_time=0.0 if failed else 1.0,
                        prefill_time=None,
                        accepted=[] if failed else [1, 2],
                        verified=[] if failed else [2, 2],
                        expected_token=[] if failed else [1.0, 1.5 + p / 10],
                        expected_block=[] if failed else [1.2, 1.6 + p / 10],
                        status=rec.FAILED if failed else rec.OK,
                        error="ValueError: x" if failed else None,
                    ),
                )

    write(failed_prompt=None)
    assert runner.gain_is_known(path, precision=10.0)
    write(failed_prompt=0)  # only MIN_PROMPTS - 1 prompts have a block run
    assert not runner.gain_is_known(path, precision=10.0)


# --- resuming: the stored settings ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(small, tmp_path_factory):
    """A run directory of ``small``, complete; tests copy it before changing it."""
    out = tmp_path_factory.mktemp("recorded")
    runner.run(replace(small, out=out, configs=("target-only",), prompts_per_dataset=1), progress=False)
    return replace(small, out=out, configs=("target-only",), prompts_per_dataset=1)


def copy_of(config: runner.BenchConfig, out) -> runner.BenchConfig:
    out.mkdir(exist_ok=True)
    for name in (runner.RECORDS, runner.CONFIG):
        (out / name).write_bytes((config.out / name).read_bytes())
    return replace(config, out=out)


def test_the_run_directory_stores_its_settings_and_machine(recorded):
    stored = json.loads((recorded.out / runner.CONFIG).read_text())
    resolved = stored.pop("resolved")
    assert recorded.backend == "auto" and stored == runner.settings(replace(recorded, backend="hf"))  # as it resolved
    assert stored["target"] == recorded.target and stored["seed"] == recorded.seed and stored["chat"] is True
    assert stored["cpu_flags"] == machine.cpu_flags() and stored["threads"] == machine.threads()
    assert resolved["dtype"] == "float32" and resolved["draft_quant"] == {}  # target-only drafts nothing
    assert set(resolved["versions"]) == {"python", "blockspec", "torch", "transformers"}
    assert resolved["models"] == {"target": identity.fingerprint(recorded.target)}  # nothing drafts
    assert None not in resolved["models"].values()
    (record,) = rec.read(recorded.out / runner.RECORDS)
    assert (record.meta["dtype"], record.meta["versions"], record.meta["models"]) == (
        resolved["dtype"],
        resolved["versions"],
        resolved["models"],
    )


@pytest.mark.parametrize(
    "change",
    [
        {"draft": "another-draft"},
        {"seed": 5},
        {"dtype": "bfloat16"},
        {"max_new_tokens": 9},
        {"chat": False},
        {"target": "t", "device": "meta"},
    ],
)
def test_a_resume_with_other_settings_is_refused_naming_them_before_any_model_loads(
    recorded, tmp_path, monkeypatch, change
):
    config = copy_of(recorded, tmp_path)
    no_model_loads(monkeypatch)
    with pytest.raises(ValueError, match="holds runs with other settings") as refused:
        runner.run(replace(config, **change), progress=False)
    for name, value in change.items():
        assert f"{name}: {asdict(recorded)[name]!r} there, {value!r} here" in str(refused.value)


def test_a_resume_on_another_backend_is_refused_naming_it(recorded, tmp_path, monkeypatch):
    """The directory stores the backend its runs resolved to (transformers, for these models), not "auto"."""
    config = copy_of(recorded, tmp_path)
    no_model_loads(monkeypatch)
    with pytest.raises(ValueError, match="backend: 'hf' there, 'llamacpp' here"):
        runner.run(replace(config, backend="llamacpp"), progress=False)


def test_a_resume_whose_auto_configurations_drafted_differently_is_refused_naming_them(tmp_path):
    """A directory where auto drafted with the int8 draft and auto-tree with the unquantized one (as benches did
    before auto-tree took auto's draft): no one quantization extends both, so the resume says which ran how."""
    config = runner.BenchConfig(configs=("auto", "auto-tree", "block"), out=tmp_path)
    stored = {"dtype": "bfloat16", "draft_quant": {"auto": "int8", "auto-tree": None, "block": None}}
    with pytest.raises(ValueError, match=r"\(auto int8, auto-tree unquantized\)"):
        runner.stored_arithmetic(config, stored)
    agreed = runner.stored_arithmetic(config, {**stored, "draft_quant": {**stored["draft_quant"], "auto-tree": "int8"}})
    assert (agreed.dtype, agreed.draft_quant) == ("bfloat16", "int8")


def test_a_resume_on_another_machine_kind_or_thread_count_is_refused(recorded, tmp_path, monkeypatch):
    config = copy_of(recorded, tmp_path)
    no_model_loads(monkeypatch)
    monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx512_made_up"])
    with pytest.raises(ValueError, match=r"cpu_flags: \[.*\] there, \['avx512_made_up'\] here"):
        runner.run(config, progress=False)
    monkeypatch.setattr(machine, "cpu_flags", lambda: json.loads((config.out / runner.CONFIG).read_text())["cpu_flags"])
    monkeypatch.setattr(machine, "threads", lambda: 1000)
    with pytest.raises(ValueError, match="threads: .* there, 1000 here"):
        runner.run(config, progress=False)


def test_a_resume_may_grow_the_plan_and_change_what_only_steers_it(recorded, tmp_path):
    config = copy_of(recorded, tmp_path)
    before = list(rec.read(config.out / runner.RECORDS))
    grown = replace(
        config,
        prompts_per_dataset=2,
        configs=("target-only", "block"),
        max_drafts=(2, 3),
        temperatures=(1.0, 0.0),
        time_budget=600.0,
        precision=0.5,
        retry_failed=True,
        allow_download=True,
    )
    records = list(rec.read(runner.run(grown, progress=False)))
    assert records[: len(before)] == before  # the recorded run is kept, not redone
    assert len(records) == 2 * 2 * (1 + 2)  # 2 prompts, 2 temperatures: target-only, block at K = 2 and 3


def test_a_run_directory_without_stored_settings_is_reported_but_not_resumed(recorded, tmp_path, monkeypatch, capsys):
    config = copy_of(recorded, tmp_path)
    (config.out / runner.CONFIG).unlink()
    no_model_loads(monkeypatch)
    with pytest.raises(ValueError, match="their settings are unknown, so they cannot be resumed: use a new --out"):
        runner.run(config, progress=False)
    assert report.main(["--records", str(config.out / runner.RECORDS), "--no-plots"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["records"] == 1


def test_records_of_another_schema_are_neither_resumed_nor_reported(recorded, tmp_path, monkeypatch, capsys):
    config = copy_of(recorded, tmp_path)
    path = config.out / runner.RECORDS
    path.write_text(
        "".join(json.dumps({**json.loads(line), "schema": 3}) + "\n" for line in path.read_text().splitlines())
    )
    no_model_loads(monkeypatch)
    with pytest.raises(ValueError, match="record schema 3, but this blockspec reads schema 4 only"):
        runner.run(config, progress=False)
    assert report.main(["--records", str(path), "--no-plots"]) == 2
    assert "record schema 3" in capsys.readouterr().err


# --- resuming: what the settings resolved to -----------------------------------------------------------------


@pytest.fixture
def auto_run(tmp_path, monkeypatch):
    """A complete run directory of one prompt through target-only with ``dtype="auto"``, the probe's pick pinned to
    float32, on models of its own (a test may replace them in place)."""
    pin_arithmetic(monkeypatch, "float32")
    config = runner.BenchConfig(
        target=save_tiny(tmp_path / "target"),
        draft=save_tiny(tmp_path / "draft", noise=0.3),
        dtype="auto",
        datasets=("lm1b",),
        prompts_per_dataset=1,
        configs=("target-only",),
        max_drafts=(2,),
        max_new_tokens=4,
        out=tmp_path / "out",
    )
    runner.run(config, progress=False)
    return config


def pin_arithmetic(monkeypatch, dtype: str, draft_quant: str | None = None) -> None:
    """What ``auto.choose_arithmetic`` picks, as a probe of a quiet (or a busy) machine might."""
    monkeypatch.setattr(
        "blockspec.auto.choose_arithmetic", lambda device: Arithmetic(dtype, draft_quant, "pinned", None)
    )


def replace_the_target_in_place(config, monkeypatch):
    before = identity.fingerprint(config.target)
    save_tiny(config.target, seed=1)  # other weights, the same config and shapes
    return rf"resolved\.models\.target: '{before}' there, '{identity.fingerprint(config.target)}' here"


def upgrade_torch(config, monkeypatch):
    found = provenance.versions
    monkeypatch.setattr(provenance, "versions", lambda backend: {**found(backend), "torch": "9.9.9"})
    return r"resolved\.versions\.torch: '[^']+' there, '9\.9\.9' here"


@pytest.mark.parametrize("change", [replace_the_target_in_place, upgrade_torch])
def test_a_resume_that_resolves_other_weights_or_libraries_is_refused_before_any_model_loads(
    auto_run, monkeypatch, change
):
    before = (auto_run.out / runner.RECORDS).read_text()
    refused = change(auto_run, monkeypatch)
    no_model_loads(monkeypatch)
    with pytest.raises(ValueError, match=rf"holds runs with other settings \({refused}\): use another --out"):
        runner.run(replace(auto_run, prompts_per_dataset=2), progress=False)
    assert (auto_run.out / runner.RECORDS).read_text() == before


def test_a_resume_under_dtype_auto_runs_in_the_arithmetic_its_runs_resolved_to(auto_run, monkeypatch, caplog):
    """The probe of a busy machine may pick another dtype or draft quantization than the first call's did: the
    resume runs in the ones stored with the directory's runs, and says so, rather than refusing a directory that
    could then never be finished."""
    pin_arithmetic(monkeypatch, "bfloat16")
    with caplog.at_level(logging.INFO, logger="blockspec.bench.runner"):
        records = list(rec.read(runner.run(replace(auto_run, prompts_per_dataset=2), progress=False)))
    assert [r.meta["dtype"] for r in records] == ["float32", "float32"]
    assert f"float32, unquantized auto draft, as resolved by the runs in {auto_run.out}" in caplog.text
    stored = json.loads((auto_run.out / runner.CONFIG).read_text())
    stored["resolved"]["draft_quant"] = {"auto": "int8"}  # as a first call whose probe picked an int8 draft stores
    (auto_run.out / runner.CONFIG).write_text(json.dumps(stored))
    loads = []

    def load_model(name, *, dtype, quant, **_):
        loads.append((name, dtype, quant))
        if name == auto_run.draft:
            raise AssertionError("a model was loaded")

    monkeypatch.setattr("blockspec.models.load.load_model", load_model)
    with pytest.raises(AssertionError, match="a model was loaded"):
        runner.run(replace(auto_run, configs=("target-only", "auto")), progress=False)
    assert loads == [(auto_run.target, "float32", None), (auto_run.draft, "float32", "int8")]


def test_a_resume_whose_auto_draft_quantization_resolves_otherwise_is_refused(auto_run, monkeypatch):
    stored = json.loads((auto_run.out / runner.CONFIG).read_text())
    stored["dtype"] = "float32"  # a directory of an explicit dtype: the probe still picks the auto draft's arithmetic
    stored["resolved"]["draft_quant"] = {"auto": "int8"}  # as a first call whose probe picked an int8 draft stores
    (auto_run.out / runner.CONFIG).write_text(json.dumps(stored))
    explicit = replace(auto_run, dtype="float32")
    no_model_loads(monkeypatch)
    with pytest.raises(ValueError, match=r"resolved\.draft_quant\.auto: 'int8' there, None here"):
        runner.run(replace(explicit, configs=("target-only", "auto")), progress=False)
    # a configuration the directory has not run yet has no runs to disagree with
    with pytest.raises(AssertionError, match="a model was loaded"):
        runner.run(replace(explicit, configs=("target-only", "lookup+model")), progress=False)
    stored = json.loads((auto_run.out / runner.CONFIG).read_text())
    assert stored["resolved"]["draft_quant"] == {"auto": "int8", "lookup+model": None}  # kept for the next resume


def test_a_run_directory_of_an_older_blockspec_is_reported_but_not_resumed(recorded, tmp_path, monkeypatch, capsys):
    config = copy_of(recorded, tmp_path)
    stored = json.loads((config.out / runner.CONFIG).read_text())
    del stored["resolved"]
    (config.out / runner.CONFIG).write_text(json.dumps(stored))
    path = config.out / runner.RECORDS
    older = {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.23.0"}  # versions as they were recorded
    path.write_text(
        "".join(
            json.dumps(
                {**data, "meta": {k: v for k, v in {**data["meta"], "versions": older}.items() if k != "models"}}
            )
            + "\n"
            for data in map(json.loads, path.read_text().splitlines())
        )
    )
    no_model_loads(monkeypatch)
    with pytest.raises(
        ValueError, match="made by an older blockspec.* finish it with that version, or use a new --out"
    ):
        runner.run(replace(config, prompts_per_dataset=2), progress=False)
    assert report.main(["--records", str(path), "--no-plots"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "bfloat16"),
        ("target_quant", "int8"),
        ("draft_quant", "int8"),
        ("versions", {"torch": "9.9.9"}),
        ("models", {"target": "0" * 64, "draft": "1" * 64}),
    ],
)
def test_the_report_refuses_records_of_other_builds(recorded, tmp_path, capsys, field, value):
    (record,) = rec.read(recorded.out / runner.RECORDS)
    record = replace(record, config="hf-assisted", meta={**record.meta, "draft_quant": None})
    other = replace(record, prompt_id="lm1b/other", seed=1, meta={**record.meta, field: value})
    with pytest.raises(ValueError, match="records of other builds"):
        report.build_report([record, other])
    path = tmp_path / runner.RECORDS
    for each in (record, other):
        rec.append(path, each)
    assert report.main(["--records", str(path), "--no-plots"]) == 2
    assert "records of other builds" in capsys.readouterr().err


def test_a_hub_model_the_bench_downloads_is_fingerprinted_once_loaded_and_resumes(auto_run, tmp_path, monkeypatch):
    from blockspec.models import load as loading

    load, cached = loading.load_model, []

    def download_then_load(name, **kwargs):  # "org/tiny" is the tiny target, in the hub cache once loaded
        cached.append(name)
        return load(auto_run.target if name == "org/tiny" else name, **kwargs)

    monkeypatch.setattr(loading, "load_model", download_then_load)
    monkeypatch.setattr(identity, "hub_snapshot", lambda name: Path(auto_run.target) if cached else None)
    config = replace(auto_run, target="org/tiny", allow_download=True, out=tmp_path / "hub")
    runner.run(config, progress=False)
    resolved = json.loads((config.out / runner.CONFIG).read_text())["resolved"]
    assert resolved["models"]["target"] == identity.fingerprint(auto_run.target)
    assert len(list(rec.read(runner.run(replace(config, prompts_per_dataset=2), progress=False)))) == 2


def test_a_hub_model_whose_snapshot_holds_only_its_config_is_fingerprinted_once_its_weights_are_here(
    auto_run, tmp_path, monkeypatch
):
    """A config alone in the hub cache (an earlier look-up fetched it) is no model yet: fingerprinted before the
    download, the bench would store a fingerprint its later resumes never find again."""
    from blockspec.models import load as loading

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    shutil.copy(Path(auto_run.target) / "config.json", snapshot)
    load = loading.load_model

    def download_then_load(name, **kwargs):
        if name == "org/tiny":
            shutil.copytree(auto_run.target, snapshot, dirs_exist_ok=True)
        return load(str(snapshot) if name == "org/tiny" else name, **kwargs)

    monkeypatch.setattr(loading, "load_model", download_then_load)
    monkeypatch.setattr(identity, "hub_snapshot", lambda name: snapshot if name == "org/tiny" else None)
    config = replace(auto_run, target="org/tiny", allow_download=True, out=tmp_path / "hub")
    runner.run(config, progress=False)
    resolved = json.loads((config.out / runner.CONFIG).read_text())["resolved"]
    assert resolved["models"]["target"] == identity.fingerprint(auto_run.target)
    assert len(list(rec.read(runner.run(replace(config, prompts_per_dataset=2), progress=False)))) == 2


def test_the_draft_is_fingerprinted_only_once_a_configuration_drafts_with_it(auto_run, monkeypatch):
    """A bench of target-only runs loads no draft: other draft weights neither stop its resume nor are stored;
    the first call that drafts stores the draft's fingerprint, and later ones are held to it."""
    save_tiny(auto_run.draft, seed=1, noise=0.3)  # other draft weights
    runner.run(replace(auto_run, prompts_per_dataset=2), progress=False)
    drafting = replace(auto_run, prompts_per_dataset=2, configs=("target-only", "block"))
    records = list(rec.read(runner.run(drafting, progress=False)))
    assert json.loads((auto_run.out / runner.CONFIG).read_text())["resolved"]["models"] == {
        "target": identity.fingerprint(auto_run.target),
        "draft": identity.fingerprint(auto_run.draft),
    }
    report.build_report(records)  # target-only runs without a draft's fingerprint pool with those that draft
    save_tiny(auto_run.draft, seed=2, noise=0.3)
    no_model_loads(monkeypatch)
    with pytest.raises(ValueError, match=r"resolved\.models\.draft: '[0-9a-f]+' there, '[0-9a-f]+' here"):
        runner.run(drafting, progress=False)


def test_a_bench_on_llama_cpp_stores_its_build_and_without_it_names_the_set_up_step(monkeypatch):
    """llama.cpp's compile flags decide its kernels, so its figures: a bench on it stores its build info. Without
    llama-cpp-python it stops, before any model loads, with the step that installs it (not a missing package's
    metadata)."""
    import importlib.metadata

    from blockspec.models import llamacpp

    version = importlib.metadata.version
    with monkeypatch.context() as absent:
        absent.setattr(llamacpp, "_lib", None)
        absent.setitem(sys.modules, "llama_cpp", None)
        absent.setitem(sys.modules, "llama_cpp.llama_cpp", None)

        def no_llama_cpp(package):
            if package == "llama-cpp-python":
                raise importlib.metadata.PackageNotFoundError(package)
            return version(package)

        absent.setattr(importlib.metadata, "version", no_llama_cpp)
        with pytest.raises(ImportError, match=re.escape(f"needs llama-cpp-python: {llamacpp.INSTALL_HINT}")):
            provenance.versions("llamacpp")
        assert "llamacpp_build" not in provenance.versions("hf")
    pytest.importorskip("llama_cpp")
    found = provenance.versions("llamacpp")
    assert found["llamacpp_build"] == llamacpp.library().llama_print_system_info().decode().strip()
    assert found["llama-cpp-python"] == version("llama-cpp-python")


def test_a_model_fingerprint_follows_its_config_and_weights_not_its_readme(tmp_path):
    from blockspec.models.presets import PRESETS

    folder = save_tiny(tmp_path / "model")
    first = identity.fingerprint(folder)
    (Path(folder) / "README.md").write_text("notes")
    assert identity.fingerprint(folder) == first
    save_tiny(folder, seed=1)  # the same names, dtypes and shapes: a safetensors header alone would not tell
    assert identity.fingerprint(folder) != first
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1000))
    one = identity.fingerprint(str(gguf))
    gguf.write_bytes(b"GGUF" + bytes(999) + b"\1")
    assert identity.fingerprint(str(gguf)) not in (one, None)
    assert identity.fingerprint("qwen2.5-coder-0.5b") == PRESETS["qwen2.5-coder-0.5b"].sha256
    assert identity.fingerprint(str(tmp_path / "missing")) is None


# --- one bench per run directory, and its settings file -------------------------------------------------------

HOLD = """
import sys
from pathlib import Path
from blockspec.bench import records
with records.one_writer(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()  # until the test closes it
"""


@pytest.fixture
def other_bench():
    """Starts another process that holds a run directory as a bench writing into it does: ``start(out)``."""
    children = []

    def start(out) -> subprocess.Popen:
        child = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        children.append(child)
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        return child

    yield start
    for child in children:
        child.kill()
        child.wait()


def test_a_second_bench_into_a_directory_in_use_is_refused_naming_its_pid(
    recorded, tmp_path, monkeypatch, capsys, other_bench
):
    config = copy_of(recorded, tmp_path)
    before = (config.out / runner.RECORDS).read_text()
    holder = other_bench(config.out)
    no_model_loads(monkeypatch)
    in_use = f"{config.out} is in use by another bench (pid {holder.pid}): let it finish, or use another --out"
    with pytest.raises(ValueError) as refused:
        runner.run(replace(config, prompts_per_dataset=2), progress=False)
    assert str(refused.value) == in_use
    flags = ["--target", config.target, "--draft", config.draft, "--dtype", "float32", "--datasets", "lm1b"]
    flags += ["--prompts", "2", "--configs", "target-only", "--max-new-tokens", "4", "--out", str(config.out)]
    assert cli_main(["bench", *flags]) == 2
    assert capsys.readouterr().err == f"blockspec: error: {in_use} (run with --debug for the traceback)\n"
    assert (config.out / runner.RECORDS).read_text() == before
    assert holder.stdin is not None
    holder.stdin.close()
    assert holder.wait() == 0 and not (config.out / rec.LOCK).exists()  # released as it ends


def test_a_lock_left_by_a_killed_bench_is_taken_over_with_a_warning(recorded, tmp_path, caplog, other_bench):
    config = copy_of(recorded, tmp_path)
    holder = other_bench(config.out)
    os.kill(holder.pid, signal.SIGKILL)  # no clean-up: its pid stays in the lock file
    holder.wait()
    assert (config.out / rec.LOCK).read_text() == f"{holder.pid}\n"
    with caplog.at_level(logging.WARNING, logger="blockspec.bench.records"):
        records = list(rec.read(runner.run(replace(config, prompts_per_dataset=2), progress=False)))
    assert f"taking over the lock of pid {holder.pid}, which ended without releasing it" in caplog.text
    assert len(records) == 2 and not (config.out / rec.LOCK).exists()


class HalfWritten:
    """A file whose first write stops half-way with ENOSPC, as on a full disk."""

    def __init__(self, file):
        self.file = file

    def write(self, text):
        self.file.write(text[: len(text) // 2])
        self.file.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.file.close()


def test_a_bench_cut_off_while_storing_its_settings_can_still_be_resumed(recorded, tmp_path, monkeypatch):
    config = copy_of(recorded, tmp_path)
    stored = (config.out / runner.CONFIG).read_text()
    real_open = io.open

    def disk_full_for_settings(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        writes = "w" in mode or "x" in mode
        return HalfWritten(handle) if writes and Path(str(file)).name.startswith(runner.CONFIG) else handle

    with monkeypatch.context() as patch:
        patch.setattr(builtins, "open", disk_full_for_settings)
        patch.setattr(io, "open", disk_full_for_settings)
        with pytest.raises(OSError, match="No space left on device"):
            runner.run(replace(config, prompts_per_dataset=2), progress=False)
    assert (config.out / runner.CONFIG).read_text() == stored  # the settings before, whole
    assert sorted(p.name for p in config.out.iterdir()) == [runner.CONFIG, runner.RECORDS]  # no temporary file
    assert len(list(rec.read(runner.run(replace(config, prompts_per_dataset=2), progress=False)))) == 2


def test_out_pointing_at_a_file_fails_before_any_model_loads(small, tmp_path, monkeypatch):
    no_model_loads(monkeypatch)
    path = tmp_path / "results.txt"
    path.write_text("not a directory")
    with pytest.raises(ValueError, match=f"{path} is a file"):
        runner.run(replace(small, out=path), progress=False)


def test_load_model_is_asked_to_download_only_when_allowed(small, tmp_path, monkeypatch):
    asked = []

    def load_model(name, **kwargs):
        asked.append(kwargs["allow_download"])
        raise RuntimeError("stop here")

    monkeypatch.setattr("blockspec.models.load.load_model", load_model)
    for allow in (False, True):
        with pytest.raises(RuntimeError, match="stop here"):
            runner.run(replace(small, out=tmp_path / str(allow), allow_download=allow), progress=False)
    assert asked == [False, True]


# --- a damaged records file -----------------------------------------------------------------------------------


def test_a_corrupt_line_in_the_middle_of_the_records_is_reported_with_its_line_number(recorded, tmp_path, caplog):
    config = copy_of(recorded, tmp_path)
    path = config.out / runner.RECORDS
    good = path.read_text()
    path.write_text(good + '{"dataset": "lm1b", "prompt_id": \n' + good)
    with caplog.at_level(logging.WARNING, logger="blockspec.bench.records"):
        assert len(list(rec.read(path))) == 2
    assert f"{path}:2: not a JSON line" in caplog.text


@pytest.mark.parametrize("line", ["[1, 2]", '"x"', "3", "null"])
def test_a_json_line_that_is_not_an_object_crashes_neither_resume_nor_report(recorded, tmp_path, caplog, line, capsys):
    config = copy_of(recorded, tmp_path)
    path = config.out / runner.RECORDS
    path.write_text(line + "\n" + path.read_text())
    with caplog.at_level(logging.WARNING, logger="blockspec.bench.records"):
        assert len(list(rec.read(runner.run(config, progress=False)))) == 1  # resumed: nothing left to run
    assert f"{path}:1: not a record" in caplog.text
    assert report.main(["--records", str(path), "--no-plots"]) == 0
    capsys.readouterr()


def test_a_truncated_last_line_is_tolerated_and_dropped_before_the_next_record(recorded, tmp_path, caplog):
    config = copy_of(recorded, tmp_path)
    path = config.out / runner.RECORDS
    whole = path.read_text()
    path.write_text(whole + whole[:40])  # a run killed while writing its record
    with caplog.at_level(logging.WARNING, logger="blockspec.bench.records"):
        assert len(list(rec.read(path))) == 1
    assert caplog.text == ""
    rec.append(path, next(rec.read(path)))
    assert path.read_text() == whole * 2  # the partial line is gone: no unreadable line in the middle


# --- the machine: contention, kind, threads -------------------------------------------------------------------


def test_every_run_records_the_machine_and_the_cpu_time_of_other_processes(small, tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "own_seconds", lambda: 0.0)
    monkeypatch.setattr(machine, "busy_seconds", lambda: 3.0 * time.monotonic())  # others keep 3 cores busy
    records = list(rec.read(runner.run(replace(small, out=tmp_path), progress=False)))
    for record in records:
        assert record.meta["others_cores"] == pytest.approx(3.0, rel=0.01)
        assert record.meta["others_cpu_s"] >= 3.0 * record.wall_time  # measured around the timed generate call
        assert record.meta["cpu_flags"] == machine.cpu_flags() and record.meta["threads"] == machine.threads()
    built = report.build_report(records)
    assert len(built.left_out.contended) == len(records)
    assert all(b.tokens_per_s is None for b in built.baselines)


def test_the_cpu_time_of_another_process_is_measured(monkeypatch):
    monkeypatch.setattr(machine, "busy_seconds", PROC_BUSY_SECONDS)
    start = machine.cpu_clock()
    # a child burns 0.3 CPU-seconds (CPU time, not wall time: it holds however busy the machine is)
    subprocess.run([sys.executable, "-c", "import time\nwhile time.process_time() < 0.3: pass"], check=True)
    load = machine.others_load(start, machine.cpu_clock())
    assert load["others_cpu_s"] >= 0.25 and load["others_cores"] > 0


def test_cpu_flags_are_the_avx2_avx512_and_amx_words_of_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu avx avx2 avx512f avx512_vnni amx_bf16 amx_tile xavx2x\n"
        "processor\t: 1\nflags\t\t: fpu avx avx2 avx512f avx512_vnni amx_bf16 amx_tile xavx2x\n"
    )
    assert machine.cpu_flags(cpuinfo) == ["amx_bf16", "amx_tile", "avx2", "avx512_vnni", "avx512f"]
    assert machine.cpu_flags(tmp_path / "missing") == []
