"""Every CLI error is one line on stderr and an exit status, never a traceback (unless --debug), and every value
that can be checked without a model is checked before a model loads."""

from __future__ import annotations

import pytest
import torch

from blockspec import cli
from blockspec.cli import env as env_cli
from blockspec.models import load


@pytest.fixture
def loads(monkeypatch):
    """Replaces load_model: records each call, then stops the command (a model load is what these tests forbid or
    only need to observe)."""
    calls = []

    def fake_load_model(name, **kwargs):
        calls.append((name, kwargs))
        raise AssertionError(f"loaded {name}")

    monkeypatch.setattr(load, "load_model", fake_load_model)
    return calls


def error_line(capsys) -> str:
    """stderr, which must be exactly one line: the error and the --debug hint."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("blockspec: error: "), err
    assert err.rstrip().endswith("(run with --debug for the traceback)")
    return err


def test_a_model_path_that_does_not_exist_is_one_line_not_a_traceback(tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    assert cli.main(["generate", "--target", missing, "--draft", "none", "--dtype", "bfloat16", "hello"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    *status, last = err.splitlines()
    assert last.startswith("blockspec: error: ") and missing in last
    assert status == [f"loading target {missing} (bfloat16, cpu)"]  # what it was doing when it failed


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
def test_a_device_torch_cannot_use_is_refused_before_loading_a_model(loads, capsys):
    assert cli.main(["generate", "--device", "cuda", "hello"]) == 2
    assert "cuda" in error_line(capsys) and loads == []


def test_bench_out_pointing_at_a_file_fails_before_loading_a_model(tmp_path, loads, capsys):
    taken = tmp_path / "results.txt"
    taken.write_text("not a directory\n")
    assert cli.main(["bench", "--out", str(taken)]) == 2
    assert str(taken) in error_line(capsys) and loads == []


def test_a_temperature_too_small_to_sample_from_is_refused_before_loading_a_model(loads, capsys):
    assert cli.main(["generate", "--temperature", "1e-9", "hello"]) == 2
    assert "temperature" in error_line(capsys) and loads == []


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--max-new-tokens", "0", "hello"],
        ["generate", "--max-draft", "0", "hello"],
        ["bench", "--max-draft", "4", "0"],
        ["bench", "--time-budget", "0"],
        ["align", "--max-new-tokens", "0"],
        ["sv", "calibrate", "--max-draft", "0"],
    ],
)
def test_counts_below_one_are_refused_in_one_line_before_loading_a_model(argv, loads, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and loads == []
    assert err.count("\n") == 1 and "error: argument --" in err and "got 0" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--verifier", "none", "hello"],
        ["generate", "--draft-len", "3", "hello"],
        ["bench", "--draft-lens", "2", "4"],
        ["align", "--draft-len", "5"],
        ["sv", "calibrate", "--draft-len", "6"],
        ["sv", "replay", "--recording", "r.pt", "--sv-profile", "p.json", "--latency", "l.json", "--methods", "block"],
    ],
)
def test_the_former_flag_names_are_refused_in_one_line(argv, loads, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and loads == []
    assert err.count("\n") == 1 and "unrecognized arguments: " in err, err


def test_a_rule_is_a_name_of_the_registry_checked_before_loading_a_model(loads, capsys):
    from blockspec.verify import RULES

    with pytest.raises(SystemExit) as exit:
        cli.main(["generate", "--rule", "nope", "hello"])
    err = capsys.readouterr().err
    assert (
        exit.value.code == 2 and err.count("\n") == 1 and "argument --rule: must be one of " + ", ".join(RULES) in err
    )
    assert cli.main(["generate", "--rule", "greedy", "--temperature", "1", "hello"]) == 2
    assert "--rule greedy needs --temperature 0" in error_line(capsys) and loads == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ab\udcffc"], "the prompt is not valid UTF-8 text: character 2 is U+DCFF"),
        (["ok", "\udc80"], "prompt 1 is not valid UTF-8 text: character 0 is U+DC80"),
        (["--stop", "x\ud800", "ok"], "stop string 0 is not valid UTF-8 text: character 1 is U+D800"),
        (["--stop", "", "ok"], "stop_strings holds an empty string, which would end every row after one token"),
        (["--seed", "-1", "ok"], "seed -1 is out of range"),
        (["--seed", str(2**64 - 1), "a", "b"], "out of range: row b uses seed + b"),
    ],
)
def test_bad_text_stops_and_seeds_are_refused_before_loading_a_model(argv, message, loads, capsys):
    """Arguments that are not UTF-8 reach Python as lone surrogates (U+DC80..U+DCFF), which the tokenizer would
    turn into something else; the engine's own checks of stop strings and seeds run before the models load."""
    assert cli.main(["generate", *argv]) == 2
    assert message in error_line(capsys) and loads == []


def test_an_unexpected_exception_is_one_line_with_its_type_and_exit_1(monkeypatch, capsys):
    def broken(args):
        raise KeyError("shape")

    monkeypatch.setattr(env_cli, "run", broken)
    assert cli.main(["env"]) == 1
    assert error_line(capsys) == "blockspec: error: KeyError: 'shape' (run with --debug for the traceback)\n"


def test_a_multi_line_message_is_folded_into_one_line(monkeypatch, capsys):
    def fails(args):
        raise OSError("no model here.\nCheck the path\n  or the hub id.")

    monkeypatch.setattr(env_cli, "run", fails)
    assert cli.main(["env"]) == 2
    assert "no model here. Check the path or the hub id." in error_line(capsys)


@pytest.mark.parametrize("argv", [["--debug", "env"], ["env", "--debug"]])
def test_debug_shows_the_traceback_wherever_it_is_given(argv, monkeypatch, capsys):
    def broken(args):
        raise KeyError("shape")

    monkeypatch.setattr(env_cli, "run", broken)
    with pytest.raises(KeyError):
        cli.main(argv)
    assert capsys.readouterr().err == ""


def test_ctrl_c_exits_130_with_one_line(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(env_cli, "run", interrupted)
    try:
        code = cli.main(["env"])
    except KeyboardInterrupt:  # caught here so that it fails this test instead of stopping pytest
        pytest.fail("Ctrl-C escaped main() as a traceback")
    assert code == 130
    assert capsys.readouterr().err.strip() == "blockspec: interrupted"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--backend", "llamacpp", "--target-quant", "int8"], "--target-quant int8 runs on transformers"),
        (["--target-quant", "int8"], "--target-quant int8 runs on transformers: add --backend hf"),  # auto: llama.cpp
        (["--backend", "llamacpp", "--draft-quant", "int8"], "--draft-quant is one of auto, none, q4_0; int8 runs on"),
        (["--backend", "hf", "--draft-quant", "q4_0"], "is llama.cpp's"),
        (["--backend", "llamacpp", "--policy", "sv", "--sv-predictor", "companion"], "use --sv-predictor draft"),
        (["--backend", "llamacpp", "--policy", "sv", "--companion", "prefix:8"], "runs on transformers only"),
    ],
)
def test_flags_the_chosen_backend_cannot_run_are_refused_before_loading_a_model(flags, message, loads, capsys):
    assert cli.main(["generate", *flags, "hello"]) == 2
    assert message in error_line(capsys) and loads == []


@pytest.mark.parametrize("config", ["hf-assisted", "block-int8", "sv-token", "sv-block"])
def test_bench_on_llamacpp_refuses_transformers_only_configurations_before_loading_a_model(
    config, tmp_path, loads, capsys
):
    out = str(tmp_path / "bench")  # sv-draft, beside it, runs on llama.cpp
    assert cli.main(["bench", "--backend", "llamacpp", "--configs", "sv-draft", config, "--out", out]) == 2
    assert f"{config} run on transformers only" in error_line(capsys) and loads == []


@pytest.mark.parametrize("command", [["generate", "hello"], ["bench"], ["sv", "calibrate"]])
def test_a_draft_length_past_the_limit_is_refused_by_the_parser(command, loads, capsys):
    """A huge --max-draft once made the adaptive policy spin for minutes before anything loaded."""
    with pytest.raises(SystemExit) as exit_:
        cli.main([*command, "--max-draft", "1000000000"])
    assert exit_.value.code == 2 and "must be an integer <= 64" in capsys.readouterr().err and loads == []


MODEL_CODE = """
import pathlib
pathlib.Path({marker!r}).write_text("the model folder's code ran")
from transformers import PretrainedConfig
class EvilConfig(PretrainedConfig):
    model_type = "blockspec-evil"
"""


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
@pytest.mark.parametrize("config_file", ["config.json", "tokenizer_config.json"])
def test_code_in_a_model_folder_never_runs_even_when_stdin_trusts_it(tmp_path, config_file):
    """transformers asks on stdin whether to run a folder's code (auto_map) when trust_remote_code is not given,
    and a piped "y" said yes: the folder is refused before anything loads, whatever stdin says."""
    import json
    import os
    import subprocess
    import sys

    folder, marker = tmp_path / "model", tmp_path / "code-ran"
    folder.mkdir()
    (folder / "evil.py").write_text(MODEL_CODE.format(marker=str(marker)))
    auto_map = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"}
    config = {"model_type": "blockspec-evil", "architectures": ["EvilForCausalLM"]}
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": auto_map}))
    if config_file == "tokenizer_config.json":  # the model's config is plain; the tokenizer's maps to code
        (folder / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        (folder / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.Evil", None]}}))
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "BLOCKSPEC_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "blockspec.cli", "generate", "--target", str(folder), "--draft", "none"]
    command += ["--dtype", "float32", "hi"]
    done = subprocess.run(command, input="y\n", capture_output=True, text=True, env=env, timeout=300)
    assert not marker.exists()
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"blockspec: error: {folder}: its {config_file} maps to Python code in the folder (auto_map); blockspec "
        "never runs code from a model folder (run with --debug for the traceback)"
    )


@pytest.mark.parametrize("how", ["tensor count", "metadata count", "100 bytes", "truncated"])
def test_a_damaged_gguf_file_is_one_line_naming_it_and_exit_2(tmp_path, monkeypatch, capsys, how):
    from kits.tiny import tiny_model
    from kits.tinygguf import damage_gguf, save_gguf

    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path / "cache"))  # its tokenizer's copy is tried there, and fails
    good = save_gguf(tiny_model(), tmp_path / "good.gguf")
    damaged = damage_gguf(good, tmp_path / "damaged.gguf", how)
    assert cli.main(["generate", "--target", damaged, "--draft", "none", "--dtype", "float32", "hello"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith(f"blockspec: error: {damaged}: not a valid GGUF file; it is truncated")


def test_a_draft_folder_with_code_is_refused_before_the_target_loads(tmp_path, loads, capsys):
    import json

    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "auto_map": {"AutoConfig": "x.Y"}}))
    assert cli.main(["generate", "--draft", str(folder), "--dtype", "float32", "hi"]) == 2
    assert "its config.json maps to Python code in the folder (auto_map)" in error_line(capsys) and loads == []


def test_a_broken_pipe_other_than_stdout_is_an_error_not_a_quiet_exit(monkeypatch, capsys):
    """Exit 141 without a word is for a closed stdout (`| head`) only: a socket or subprocess pipe that breaks is
    reported like any other error."""

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(env_cli, "run", broken)
    assert cli.main(["env"]) == 2
    assert "Broken pipe" in error_line(capsys)
