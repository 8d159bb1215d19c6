"""`generate --tree` / `--paths` and the bench's tree and paths configurations on the command line: the shape is parsed
and every combination a tree or paths cannot run is refused before a model loads; end to end, greedy trees and paths
decode the target's text, on transformers and on llama.cpp."""

from __future__ import annotations

import re

import pytest
from kits.tiny import save_tiny

from blockspec import cli
from blockspec.models import load

pytestmark = pytest.mark.usefixtures("probes_in_a_temporary_cache")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return save_tiny(root / "target"), save_tiny(root / "draft", noise=0.3)


@pytest.fixture
def loads(monkeypatch):
    """Replaces load_model: records each call's keywords, then stops the command (these tests forbid a load or
    only observe how it was asked for)."""
    calls = []

    def fake_load_model(name, **kwargs):
        calls.append((name, kwargs))
        raise ValueError("stopped before decoding")

    monkeypatch.setattr(load, "load_model", fake_load_model)
    return calls


def error_line(capsys) -> str:
    """stderr, which must be exactly one line: the error and the --debug hint."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("blockspec: error: "), err
    return err


def test_the_tree_is_parsed_into_its_shape_and_a_chain_is_the_default():
    parse = cli.build_parser().parse_args
    assert parse(["generate", "--tree", "2,1,1", "hi"]).tree == (2, 1, 1)
    assert parse(["generate", "--tree", "3", "hi"]).tree == (3,)
    assert parse(["generate", "--tree", "auto", "hi"]).tree == "auto"
    assert parse(["generate", "hi"]).tree is None
    assert parse(["bench", "--configs", "block", "tree-2,1,1"]).configs == ["block", "tree-2,1,1"]


@pytest.mark.parametrize(
    "shape, message",
    [
        ("2;1", "integers separated by commas (e.g. 2,1,1), got '2;1'"),
        ("2,,1", "integers separated by commas"),
        ("2, 1", "integers separated by commas"),
        ("two", "integers separated by commas"),
        ("2,0,1", "ints >= 1"),
        ("-1,2", "ints >= 1"),
        ("8,8", "drafts 72 nodes per step, more than 64"),  # 8 + 64
        ("1000,1000,1000,1000", "more than 64"),  # counted, not built
    ],
)
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_bad_shape_is_refused_by_the_parser_before_loading_a_model(shape, message, command, loads, capsys):
    # --tree=SHAPE: argparse reads a value starting with "-" after a space as another option
    argv = ["generate", f"--tree={shape}", "hello"] if command == "generate" else ["bench", f"--configs=tree-{shape}"]
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and loads == []
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--draft", "none"], "--tree needs a draft model"),
        (["--policy", "sv"], "--tree does not combine with --policy sv"),
        (["--drafter", "lookup"], "--tree does not combine with --drafter lookup"),
        (["--drafter", "lookup+model"], "--tree does not combine with --drafter lookup+model"),
        (["--max-draft", "4"], "--max-draft does not apply with --tree: the shape sets what a step drafts (2,1,1: 6"),
    ],
)
def test_what_a_tree_does_not_combine_with_is_refused_before_loading_a_model(flags, message, loads, capsys):
    assert cli.main(["generate", "--tree", "2,1,1", *flags, "hello"]) == 2
    assert message in error_line(capsys) and loads == []


@pytest.mark.parametrize("shape", [["--tree", "2,1,1"], ["--paths", "2"]], ids=["tree", "paths"])
def test_backend_auto_runs_a_tree_or_paths_where_it_runs_a_chain(loads, monkeypatch, shape, capsys):
    """Where auto picks llama.cpp (a preset on the CPU with llama-cpp-python installed), a tree or paths load their
    models there too, as a chain does: both backends score trees."""
    monkeypatch.setattr(
        load, "resolve_backend", lambda backend, device, *names: "llamacpp" if backend == "auto" else backend
    )
    flags = ["--draft-quant", "none", "hello"]
    assert cli.main(["generate", *shape, *flags]) == 2
    assert [kwargs["backend"] for _, kwargs in loads] == ["llamacpp"]
    assert "transformers" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, summary, most",
    [
        (["--tree", "2,1,1", "--policy", "auto"], "tree 2,1,1 (6 nodes)", 6),
        (["--tree", "2,1,1", "--policy", "fixed"], "tree 2,1,1 (6 nodes)", 6),
        (["--paths", "3"], "3 paths of 4 (distinct, 12 nodes)", 12),  # --max-draft 4: not auto's 8
        (["--paths", "3", "--paths-drawn", "iid"], "3 paths of 4 (iid, 12 nodes)", 4),  # merged: one greedy chain
    ],
)
def test_generate_with_a_greedy_tree_or_paths_gives_the_greedy_text_of_the_target(
    tiny_pair, flags, summary, most, capsys
):
    """--policy auto (the default) drafts the tree or paths as given, as fixed does: no latency probe, no fallback to
    the target alone; the last stderr line names the tree or the paths and their nodes."""
    target, draft = tiny_pair
    common = ["--target", target, "--dtype", "float32", "--max-new-tokens", "12", "--temperature", "0", "--no-chat"]
    assert cli.main(["generate", *common, "--draft", draft, "--draft-quant", "none", *flags, "abc de"]) == 0
    spec = capsys.readouterr()
    assert cli.main(["generate", *common, "--draft", "none", "abc de"]) == 0
    plain = capsys.readouterr()
    assert spec.out == plain.out and spec.out.strip()
    assert "step latency" not in spec.err and "speculation cannot pay" not in spec.err
    last = spec.err.splitlines()[-1]
    assert last.startswith(f"[block, {summary}, ") and "acceptance length" in last, last
    drafted = float(last.split("), ")[1].split()[0])  # nodes verified per step: more than a chain of depth would
    assert most / 2 < drafted <= most, last


@pytest.mark.parametrize(
    "flags, leaves, most",
    [
        (["--tree", "2,2"], 4, 64),
        (["--paths", "3"], 3, 85),
        (["--tree", "auto", "--max-draft", "6"], 4, 64),  # its widest candidates: (4,) and (2, 2)
    ],
)
def test_prompts_times_leaves_past_llamacpps_sequences_are_refused_before_loading_a_model(
    flags, leaves, most, loads, capsys
):
    """Each prompt and each leaf of its tree beyond the first take one of a llama.cpp context's 256 sequence ids."""
    prompts = [f"p{i}" for i in range(most + 1)]
    assert cli.main(["generate", "--backend", "llamacpp", *flags, *prompts]) == 2
    message = f"{len(prompts)} prompts with {leaves} leaves per tree need {len(prompts) * leaves} sequence ids"
    assert message in error_line(capsys) and loads == []
    assert cli.main(["generate", "--backend", "llamacpp", *flags, *prompts[:most]]) == 2  # within: loading is next
    assert "stopped before decoding" in capsys.readouterr().err and loads


def test_tree_auto_needs_the_auto_policy_and_is_refused_with_fixed_before_loading_a_model(loads, capsys):
    assert cli.main(["generate", "--tree", "auto", "--policy", "fixed", "hello"]) == 2
    assert "--tree auto chooses each step's shape from measured costs" in error_line(capsys) and loads == []


def test_generate_with_tree_auto_drafts_the_shapes_that_pay_and_gives_the_greedy_text_of_the_target(
    tiny_pair, monkeypatch, capsys
):
    """--tree auto takes the step latency (here an AVX-512-like one, where drafting pays), then each step drafts the
    shape predicted fastest; greedy, the text is the target's; the last stderr line says the shape adapted, within
    --max-draft nodes, and the alpha it learnt."""
    from kits.svkit import CHEAP_VERIFICATION, profile

    from blockspec import auto

    monkeypatch.setattr(auto, "latency_probe", lambda target, draft, batch: profile(CHEAP_VERIFICATION, draft_ms=10))
    target, draft = tiny_pair
    common = ["--target", target, "--dtype", "float32", "--max-new-tokens", "12", "--temperature", "0", "--no-chat"]
    flags = ["--draft", draft, "--draft-quant", "none", "--tree", "auto", "--max-draft", "5"]
    assert cli.main(["generate", *common, *flags, "abc de"]) == 0
    spec = capsys.readouterr()
    assert cli.main(["generate", *common, "--draft", "none", "abc de"]) == 0
    assert spec.out == capsys.readouterr().out and spec.out.strip()
    assert "step latency" in spec.err
    last = spec.err.splitlines()[-1]
    assert last.startswith("[block, tree auto (up to 5 nodes; alpha_1..4 ") and "acceptance length" in last, last
    drafted = re.search(r", ([0-9.]+) drafted per step\]", last)
    assert drafted is not None and float(drafted[1]) > 0, last


def test_generate_with_tree_auto_decodes_alone_where_no_draft_pays_and_says_why(tiny_pair, monkeypatch, capsys):
    """Draft forwards as dear as the target's and verification in proportion to its tokens: no shape beats the target
    alone even at the prior, so --tree auto drops the draft, says so once, and decodes the target's text."""
    from kits.svkit import LINEAR_VERIFICATION, profile

    from blockspec import auto

    monkeypatch.setattr(auto, "latency_probe", lambda target, draft, batch: profile(LINEAR_VERIFICATION, draft_ms=100))
    target, draft = tiny_pair
    common = ["--target", target, "--dtype", "float32", "--max-new-tokens", "8", "--temperature", "0", "--no-chat"]
    assert cli.main(["generate", *common, "--draft", draft, "--draft-quant", "none", "--tree", "auto", "ab"]) == 0
    spec = capsys.readouterr()
    assert cli.main(["generate", *common, "--draft", "none", "ab"]) == 0
    assert spec.out == capsys.readouterr().out
    assert "speculation cannot pay here: a target step costs 100 ms and verifying one drafted token 200 ms" in spec.err
    assert "--tree 2,1,1 drafts a tree anyway" in spec.err
    assert spec.err.splitlines()[-1].startswith("[target alone, ")


@pytest.mark.parametrize(
    "flags, summary",
    [
        (["--tree", "3,1"], "tree 3,1 (6 nodes)"),
        (["--paths", "2", "--max-draft", "3", "--paths-drawn", "iid"], "2 paths of 3 (iid, 6 nodes)"),
    ],
)
def test_generate_samples_from_a_tree_or_paths(tiny_pair, flags, summary, capsys):
    target, draft = tiny_pair
    argv = ["--target", target, "--draft", draft, "--dtype", "float32", "--draft-quant", "none", "--no-chat"]
    assert cli.main(["generate", *argv, *flags, "--max-new-tokens", "8", "--seed", "0", "ab"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() and f"[block, {summary}, " in out.err.splitlines()[-1]


# --- paths ----------------------------------------------------------------------------------------------------


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
    ],
)
def test_what_paths_do_not_combine_with_is_refused_before_loading_a_model(flags, message, loads, capsys):
    assert cli.main(["generate", "--paths", "3", *flags, "hello"]) == 2
    assert message in error_line(capsys) and loads == []


def test_a_drawing_without_paths_is_refused_before_loading_a_model(loads, capsys):
    assert cli.main(["generate", "--paths-drawn", "iid", "hello"]) == 2
    assert "--paths-drawn iid says how --paths are drawn: pass --paths too" in error_line(capsys) and loads == []


# --- on llama.cpp ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """The tiny pair as GGUFs (``kits.tinygguf``); transformers cannot rebuild a tokenizer from so small a GGUF
    vocabulary (tests/cli/test_sv_llamacpp.py), so the loaders are handed ``tiny_tokenizer`` for a GGUF file."""
    pytest.importorskip("llama_cpp")
    import transformers
    from kits.tiny import perturbed, tiny_model, tiny_tokenizer
    from kits.tinygguf import save_gguf

    root = tmp_path_factory.mktemp("gguf")
    target = tiny_model(sharpness=5.0)
    pair = save_gguf(target, root / "target.gguf"), save_gguf(perturbed(target, scale=0.3, seed=1), root / "draft.gguf")
    original = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(*args, **kwargs):
        return tiny_tokenizer() if kwargs.get("gguf_file") else original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
        yield pair


@pytest.mark.parametrize(
    "flags, summary",
    [
        (["--tree", "2,1,1"], "tree 2,1,1 (6 nodes)"),
        (["--paths", "2", "--max-draft", "3"], "2 paths of 3 (distinct, 6 nodes)"),
        (["--tree", "auto", "--max-draft", "5"], "tree auto (up to 5 nodes; "),
    ],
    ids=["tree", "paths", "tree auto"],
)
def test_generate_on_llama_cpp_with_a_greedy_tree_or_paths_gives_the_greedy_text_of_the_target(
    gguf_pair, flags, summary, monkeypatch, capsys
):
    """--backend llamacpp runs trees, paths and --tree auto (under a step latency where drafting pays), on two
    prompts of different lengths: the text is the target alone's."""
    from kits.svkit import CHEAP_VERIFICATION, profile

    from blockspec import auto

    monkeypatch.setattr(auto, "latency_probe", lambda target, draft, batch: profile(CHEAP_VERIFICATION, draft_ms=10))
    target, draft = gguf_pair
    common = ["--target", target, "--backend", "llamacpp", "--max-new-tokens", "12", "--temperature", "0", "--no-chat"]
    prompts = ["abc de", "a"]
    assert cli.main(["generate", *common, "--draft", draft, "--draft-quant", "none", *flags, *prompts]) == 0
    spec = capsys.readouterr()
    assert cli.main(["generate", *common, "--draft", "none", *prompts]) == 0
    assert spec.out == capsys.readouterr().out and spec.out.strip()
    last = spec.err.splitlines()[-1]
    assert last.startswith(f"[block, {summary}") and "acceptance length" in last, last
    drafted = re.search(r", ([0-9.]+) drafted per step\]", last)
    assert drafted is not None and float(drafted[1]) > 0, last
