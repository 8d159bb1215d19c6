"""The command line: parsing and help, and `generate` end to end on tiny models saved to disk."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from blockspec import cli
from tiny import save_tiny


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_tiny(root / "target"), save_tiny(root / "draft", noise=0.3)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blockspec.cli", *args], capture_output=True, text=True, timeout=300)


def test_help_is_instant_and_shows_examples():
    """--help must not import torch (heavy imports are deferred to the subcommands)."""
    code = "import sys; from blockspec import cli\ntry: cli.main(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "blockspec generate" in out and out.strip().endswith("False")
    assert "--draft-len" in run("generate", "--help").stdout


def test_generate_defaults_come_from_one_place():
    args = cli.build_parser().parse_args(["generate", "hi"])
    assert (args.target, args.draft, args.verifier, args.draft_len) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "block", 4)
    assert (args.temperature, args.top_k, args.top_p, args.dtype, args.chat) == (1.0, 0, 1.0, "bfloat16", True)


def test_generate_end_to_end_on_tiny_models(tiny_pair):
    target, draft = tiny_pair
    common = ["--target", target, "--draft", draft, "--dtype", "float32", "--max-new-tokens", "12", "--seed", "1"]
    spec = run("generate", *common, "--temperature", "0", "abc de")
    plain = run("generate", *common, "--temperature", "0", "--verifier", "none", "abc de")
    assert spec.returncode == plain.returncode == 0, spec.stderr + plain.stderr
    assert spec.stdout == plain.stdout and spec.stdout.strip()  # same greedy text, streamed
    assert "acceptance length (1 + accepted/steps)" in spec.stderr and "tokens/s" in spec.stderr
    two = run("generate", *common, "ab", "cd efg")
    assert two.returncode == 0 and "--- prompt 0" in two.stdout and "--- prompt 1" in two.stdout


def test_generate_reports_bad_input_without_a_traceback(tiny_pair):
    target, draft = tiny_pair
    bad = run("generate", "--target", target, "--draft", draft, "--top-p", "0", "hello")
    assert bad.returncode == 2 and "top_p must lie in (0, 1]" in bad.stderr and "Traceback" not in bad.stderr
    missing = run("generate", "--target", "no/such/model.gguf", "--verifier", "none", "hello")
    assert missing.returncode == 2 and "no GGUF file" in missing.stderr


def test_models_and_env_print_machine_readable_reports():
    models = json.loads(run("models", "--json").stdout)
    assert {m["name"] for m in models} >= {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "smollm2-135m"}
    assert all(m["cache_state"] in {"converted", "gguf", "empty"} for m in models)
    env = json.loads(run("env", "--json").stdout)
    assert env["torch"].startswith("2.13") and env["torch_threads"] >= 1
