"""`generate --paths` and the bench's paths configurations on the command line: the flags are parsed and every
combination paths cannot run is refused before a model loads; end to end, greedy paths decode the target's text."""

from __future__ import annotations

import pytest
from kits.tiny import save_tiny

from blockspec import cli
from blockspec.models import hf

pytestmark = pytest.mark.usefixtures("probes_in_a_temporary_cache")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_tiny(root / "target"), save_tiny(root / "draft", noise=0.3)


@pytest.fixture
def loads(monkeypatch):
    """Replaces load_model: records each call's keywords, then stops the command."""
    calls = []

    def fake_load_model(name, **kwargs):
        calls.append((name, kwargs))
        raise ValueError("stopped before decoding")

    monkeypatch.setattr(hf, "load_model", fake_load_model)
    return calls


def error_line(capsys) -> str:
    """stderr, which must be exactly one line: the error and the --debug hint."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("blockspec: error: "), err
    return err


def test_the_paths_and_their_drawing_are_parsed_and_a_chain_is_the_default():
    parse = cli.build_parser().parse_args
    args = parse(["generate", "--paths", "3", "--paths-drawn", "iid", "hi"])
    assert (args.paths, args.paths_drawn) == (3, "iid")
    args = parse(["generate", "hi"])
    assert (args.paths, args.paths_drawn) == (None, "distinct")
    assert parse(["bench", "--configs", "paths-3", "paths-iid-2"]).configs == ["paths-3", "paths-iid-2"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--paths", "0", "hi"], ">= 1"),
        (["generate", "--paths", "2", "--paths-drawn", "sorted", "hi"], "invalid choice: 'sorted'"),
        (["bench", "--configs", "paths-iid"], "a paths configuration is paths-K"),
        (["bench", "--configs", "paths-0"], "K >= 1"),
    ],
)
def test_bad_paths_are_refused_by_the_parser_before_loading_a_model(argv, message, loads, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and loads == [] and message in err, err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--draft", "none"], "--paths needs a draft model"),
        (["--policy", "sv"], "--paths does not combine with --policy sv"),
        (["--drafter", "lookup"], "--paths does not combine with --drafter lookup"),
        (["--tree", "2,1"], "--tree and --paths both shape a step's draft"),
        (["--max-draft", "8", "--paths", "9"], "9 paths of 8 tokens draft up to 72 nodes per step, more than 64"),
        (["--backend", "llamacpp"], "--paths runs on transformers only: the llama.cpp adapter scores no trees"),
    ],
)
def test_what_paths_do_not_combine_with_is_refused_before_loading_a_model(flags, message, loads, capsys):
    assert cli.main(["generate", "--paths", "3", *flags, "hello"]) == 2
    assert message in error_line(capsys) and loads == []


def test_a_drawing_without_paths_is_refused_before_loading_a_model(loads, capsys):
    assert cli.main(["generate", "--paths-drawn", "iid", "hello"]) == 2
    assert "--paths-drawn iid says how --paths are drawn: pass --paths too" in error_line(capsys) and loads == []


def test_backend_auto_runs_paths_on_transformers_and_says_so(loads, monkeypatch, capsys):
    monkeypatch.setattr(
        hf, "resolve_backend", lambda backend, device, *names: "llamacpp" if backend == "auto" else backend
    )
    flags = ["--dtype", "float32", "--draft-quant", "none", "hello"]  # no arithmetic probe
    assert cli.main(["generate", "--paths", "2", *flags]) == 2
    assert "not llama.cpp: the llama.cpp adapter scores no trees (--paths)" in capsys.readouterr().err
    assert [kwargs["backend"] for _, kwargs in loads] == ["hf"]


@pytest.mark.parametrize("drawn", ["distinct", "iid"])
def test_generate_with_greedy_paths_gives_the_greedy_text_of_the_target(tiny_pair, drawn, capsys):
    """--policy auto (the default) drafts the paths as given, --max-draft long (default 4, not auto's 8): no latency
    probe; the last stderr line names the paths."""
    target, draft = tiny_pair
    common = ["--target", target, "--dtype", "float32", "--max-new-tokens", "12", "--temperature", "0", "--no-chat"]
    paths = ["--draft", draft, "--draft-quant", "none", "--paths", "3", "--paths-drawn", drawn]
    assert cli.main(["generate", *common, *paths, "abc de"]) == 0
    spec = capsys.readouterr()
    assert cli.main(["generate", *common, "--draft", "none", "abc de"]) == 0
    plain = capsys.readouterr()
    assert spec.out == plain.out and spec.out.strip()
    assert "step latency" not in spec.err
    last = spec.err.splitlines()[-1]
    assert last.startswith(f"[block, 3 paths of 4 ({drawn}, 12 nodes), ") and "acceptance length" in last, last


def test_generate_samples_from_iid_paths(tiny_pair, capsys):
    target, draft = tiny_pair
    argv = ["--target", target, "--draft", draft, "--dtype", "float32", "--draft-quant", "none", "--no-chat"]
    paths = ["--paths", "2", "--max-draft", "3", "--paths-drawn", "iid"]
    assert cli.main(["generate", *argv, *paths, "--max-new-tokens", "8", "--seed", "0", "ab"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() and "[block, 2 paths of 3 (iid, 6 nodes), " in out.err.splitlines()[-1]


def test_bench_on_llamacpp_refuses_paths_configurations_before_loading_a_model(tmp_path, loads, capsys):
    out = str(tmp_path / "bench")
    assert cli.main(["bench", "--backend", "llamacpp", "--configs", "target-only", "paths-iid-2", "--out", out]) == 2
    assert "paths-iid-2 run on transformers only" in error_line(capsys) and loads == []
