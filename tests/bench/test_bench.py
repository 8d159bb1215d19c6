"""`blockspec bench` end to end on tiny saved models: plan, records, resume, time budget, report and plots."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest
from kits.svkit import CHEAP_VERIFICATION, LINEAR_VERIFICATION, profile
from kits.tiny import save_tiny

from blockspec import auto
from blockspec.bench import executor, runner
from blockspec.bench import records as rec

pytestmark = pytest.mark.usefixtures("probes_in_a_temporary_cache", "quiet_machine")
# What the arithmetic probe measures here, in ms per pass: int8 well ahead, so `auto` drafts with an int8 draft
PROBE = {"bfloat16": {"1": 30.0, "4": 60.0}, "float32": {"1": 20.0, "4": 30.0}, "int8": {"1": 5.0, "4": 6.0}}


@pytest.fixture(scope="module", autouse=True)
def an_int8_machine():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(auto, "cpu_probe", lambda refresh=False: PROBE)
        yield


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    return runner.BenchConfig(
        target=save_tiny(root / "target"),
        draft=save_tiny(root / "draft", noise=0.3),
        dtype="float32",
        datasets=("lm1b",),
        prompts_per_dataset=2,
        max_drafts=(2, 3),
        temperatures=(1.0,),
        max_new_tokens=6,
        chat=False,
        out=root / "out",
    )


def test_a_draft_of_another_vocabulary_is_refused_before_any_run(tiny_config, tmp_path):
    """Every run with it would fail: refused once, naming both models, not recorded run by run as failures."""
    from kits.tiny import tiny_model, tiny_tokenizer

    draft = tmp_path / "other-draft"
    tiny_model(vocab=20).save_pretrained(draft)
    tiny_tokenizer(20).save_pretrained(draft)
    config = replace(tiny_config, draft=str(draft), configs=("target-only", "block"), out=tmp_path / "out")
    with pytest.raises(ValueError, match=rf"^the draft \({re.escape(str(draft))}.*different tokenizers"):
        runner.run(config, progress=False)
    assert not (config.out / runner.RECORDS).exists()


def test_plan_interleaves_configurations_prompt_by_prompt_with_one_seed_per_prompt():
    config = runner.BenchConfig(max_drafts=(2, 4), temperatures=(1.0, 0.0), seed=7)
    runs = runner.plan(config, {"a": [("a/0", [1]), ("a/1", [2])], "b": [("b/0", [3])]})
    first = [(r.prompt_id, r.config, r.max_draft) for r in runs[:8]]
    assert first == [
        ("a/0", "target-only", 0),
        ("a/0", "token", 2),
        ("a/0", "token", 4),
        ("a/0", "block", 2),
        ("a/0", "block", 4),
        ("a/0", "hf-assisted", 0),
        ("a/0", "auto", 4),
        ("a/0", "lookup+model", 4),
    ]
    assert len(runs) == 8 * 3 * 2 and len({r.key for r in runs}) == len(runs)
    assert {r.seed for r in runs if r.prompt_id == "a/1"} == {8}


def test_runner_writes_one_record_per_prompt_and_configuration_and_resumes(tiny_config):
    records_file = runner.run(tiny_config, progress=False)
    records = list(rec.read(records_file))
    assert len(records) == 2 * (1 + 2 + 2 + 1 + 1 + 1)
    for record in records:
        assert record.new_tokens == 6 or record.finish_reason == "eos"
        assert record.wall_time > 0 and record.meta["dtype"] == "float32" and record.meta["threads"] >= 1
        if record.config in ("token", "block"):  # per-step bookkeeping, the same draft under both rules
            assert (
                len(record.accepted) == len(record.verified) == len(record.expected_token) == len(record.expected_block)
            )
            assert all(0 <= a <= k for a, k in zip(record.accepted, record.verified))
    runner.run(tiny_config, progress=False)  # resumed: everything is recorded already
    assert len(list(rec.read(records_file))) == len(records)


def test_a_spent_time_budget_stops_scheduling_and_a_rerun_completes(tiny_config, tmp_path):
    boxed = replace(tiny_config, out=tmp_path, time_budget=0.0)
    assert len(list(rec.read(runner.run(boxed, progress=False)))) == 1  # the first run, then the budget is spent
    complete = runner.run(replace(boxed, time_budget=None), progress=False)
    assert len(list(rec.read(complete))) == 16


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_bench_command_prints_the_report_and_writes_plots(tiny_config, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "blockspec.cli",
            "bench",
            "--target",
            tiny_config.target,
            "--draft",
            tiny_config.draft,
            "--dtype",
            "float32",
            "--datasets",
            "lm1b",
            "--prompts",
            "1",
            "--max-draft",
            "2",
            "--max-new-tokens",
            "5",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["records"] == 6 and "summary" in summary
    # stderr is no terminal here: one line per finished run instead of a progress bar
    runs = re.findall(r"bench run (\d+)/6: lm1b/\S+ (\S+) K=\d+ T=1 B=1: \d+ tokens in [\d.]+ s", out.stderr)
    assert [int(n) for n, _ in runs] == [1, 2, 3, 4, 5, 6] and "bench runs:" not in out.stderr
    assert "1 + mean accepted" in out.stdout
    for name in ("records.jsonl", "report.md", "block_efficiency_vs_k.png", "speedup_vs_k.png", "accepted_hist.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_the_run_stops_once_the_gain_is_known_to_the_requested_precision(tiny_config, tmp_path):
    six = replace(tiny_config, prompts_per_dataset=runner.MIN_PROMPTS + 1, max_drafts=(2,), configs=("token", "block"))
    loose = runner.run(replace(six, out=tmp_path / "loose", precision=10.0), progress=False)
    # Known once MIN_PROMPTS prompts (rounds) are in, however loose the precision: 2 records per round.
    assert len(list(rec.read(loose))) == 2 * runner.MIN_PROMPTS
    strict = runner.run(replace(six, out=tmp_path / "strict", precision=1e-9), progress=False)
    assert len(list(rec.read(strict))) == 2 * (runner.MIN_PROMPTS + 1)


def test_a_run_resumed_at_another_temperature_gets_its_own_minimum_of_prompts(tiny_config, tmp_path):
    """The sampled half, already precise, must not stop the greedy half after its first round; and the greedy
    half, block alone (both rules coincide there), stops once it has its own minimum."""
    six = replace(
        tiny_config,
        prompts_per_dataset=runner.MIN_PROMPTS + 1,
        max_drafts=(2,),
        configs=("token", "block"),
        precision=10.0,
        out=tmp_path,
    )
    runner.run(six, progress=False)
    records = list(rec.read(runner.run(replace(six, temperatures=(0.0,), configs=("block",)), progress=False)))
    assert sum(r.temperature == 0.0 for r in records) == runner.MIN_PROMPTS


# --- hf-lookup: transformers' prompt lookup decoding ------------------------------------------------------------


def test_hf_lookup_is_planned_at_batch_size_one_only():
    config = runner.BenchConfig(prompts_per_dataset=2, batch_sizes=(1, 2), configs=("target-only", "hf-lookup"))
    runs = runner.plan(config, {"a": [("a/0", [1]), ("a/1", [2])]})
    assert [(r.prompt_id, r.max_draft) for r in runs if r.config == "hf-lookup"] == [("a/0", 0), ("a/1", 0)]
    assert all(r.batch_size == 1 for r in runs if r.config == "hf-lookup")


def test_hf_lookup_greedy_output_is_the_target_alone_and_it_drafts_from_the_context(tiny_config, monkeypatch):
    from blockspec.engine import SpeculativeDecoder
    from blockspec.models.load import load_model
    from blockspec.sampling import SamplingParams

    target = load_model(tiny_config.target, dtype="float32")
    prompt, greedy = list(range(1, 9)) * 3 + [1, 2], SamplingParams(temperature=0)  # repeats: something to look up
    outputs, forwards = [], []
    generate = target.model.generate

    def generate_and_keep(*args, **kwargs):  # run_lookup returns counts; the test needs the tokens
        outputs.append(generate(*args, **kwargs))
        return outputs[-1]

    monkeypatch.setattr(target.model, "generate", generate_and_keep)
    hook = target.model.register_forward_pre_hook(lambda module, args: forwards.append(module))
    result = executor.run_lookup(target, prompt, greedy, 24, seed=0)
    hook.remove()
    alone = SpeculativeDecoder(target).generate([prompt], max_new_tokens=24, sampling=greedy)
    assert outputs[0][0, len(prompt) :].tolist() == alone.sequences[0]
    assert result["new_tokens"] == len(alone.sequences[0]) and result["finish_reason"] == alone.finish_reasons[0]
    assert len(forwards) < result["new_tokens"]  # drafts were accepted: fewer target forwards than tokens


def test_hf_lookup_records_state_its_settings(tiny_config, tmp_path):
    config = replace(tiny_config, out=tmp_path, configs=("target-only", "hf-lookup"), temperatures=(1.0, 0.0))
    records = [r for r in rec.read(runner.run(config, progress=False)) if r.config == "hf-lookup"]
    assert len(records) == 2 * 2 and all(r.ok for r in records)  # 2 prompts at 2 temperatures
    for record in records:
        assert record.meta["prompt_lookup"] == {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2}
        assert (record.max_draft, record.batch_size, record.prefill_time, record.accepted) == (0, 1, None, [])
        assert record.wall_time > 0 and (record.new_tokens == 6 or record.finish_reason == "eos")


# --- blockspec's defaults and the int8 draft --------------------------------------------------------------------

DEFAULTS = ("target-only", "block", "block-int8", "auto", "lookup", "lookup+model", "hf-assisted", "hf-lookup")


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
def test_the_int8_draft_and_blockspecs_defaults_run_beside_transformers(tiny_config, tmp_path, monkeypatch):
    """block-int8 drafts with the int8 draft at each K; auto and lookup+model with the draft the machine's probe
    chose (int8 here) and their own lengths (at most max K, from step latency measured as cheap); lookup with no
    draft model. The batch table lists every configuration with its speedup over transformers' counterpart."""
    from blockspec.bench.report import build_report

    monkeypatch.setattr(auto, "latency_probe", lambda target, draft, batch: profile(CHEAP_VERIFICATION, draft_ms=2))

    config = replace(tiny_config, out=tmp_path, configs=DEFAULTS, temperatures=(1.0, 0.0))
    records = list(rec.read(runner.run(config, progress=False)))
    assert len(records) == 2 * 2 * (1 + 2 + 2 + 1 + 1 + 1 + 1 + 1) and all(r.ok for r in records)
    quant = {(r.config, r.meta.get("draft_quant", "-")) for r in records}
    assert quant == {
        ("target-only", "-"),
        ("lookup", "-"),
        ("hf-lookup", "-"),
        ("block", None),
        ("hf-assisted", None),
        ("block-int8", "int8"),
        ("auto", "int8"),
        ("lookup+model", "int8"),
    }
    assert {r.max_draft for r in records if r.config in ("auto", "lookup+model")} == {3}
    assert {r.max_draft for r in records if r.config == "lookup"} == {0}
    assert any(k > 0 for r in records if r.config == "lookup" for k in r.verified)  # it looked up
    assert any(k > 0 for r in records if r.config == "auto" for k in r.verified)  # it speculated
    assert all(r.meta["dtype"] == "float32" for r in records)
    rows = {(row.config, row.temperature, row.max_draft): row for row in build_report(records).batch}
    assert {name for name, _, _ in rows} == set(DEFAULTS)
    for name in ("block-int8", "auto", "lookup", "lookup+model"):
        assert rows[(name, 1.0, 3 if name != "lookup" else 0)].speedup_vs_hf is not None, name
    assert rows[("target-only", 1.0, 0)].speedup_vs_hf is None


def test_where_speculation_cannot_pay_auto_decodes_alone_and_lookup_model_looks_up_alone(
    tiny_config, tmp_path, monkeypatch
):
    monkeypatch.setattr(auto, "latency_probe", lambda target, draft, batch: profile(LINEAR_VERIFICATION, draft_ms=2))
    config = replace(tiny_config, out=tmp_path, configs=("auto", "lookup+model"), temperatures=(0.0,))
    records = list(rec.read(runner.run(config, progress=False)))
    assert len(records) == 4 and all(r.ok for r in records)
    assert all(k == 0 for r in records if r.config == "auto" for k in r.verified)
    assert any(k > 0 for r in records if r.config == "lookup+model" for k in r.verified)


def test_a_tree_is_planned_once_per_prompt_at_its_node_count():
    config = runner.BenchConfig(configs=("block", "tree-2,1,1", "tree-3"), max_drafts=(2, 4))
    runs = runner.plan(config, {"a": [("a/0", [1])]})
    assert [(r.config, r.max_draft) for r in runs] == [("block", 2), ("block", 4), ("tree-2,1,1", 6), ("tree-3", 3)]


@pytest.mark.parametrize(
    "name, message",
    [("tree-2,0", "ints >= 1"), ("tree-x", "integers separated by commas"), ("tree-02,1", "as 'tree-2,1'")],
)
def test_a_tree_configuration_the_library_refuses_or_written_otherwise_is_refused(name, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        runner.BenchConfig(configs=("block", name))


def test_a_tree_configuration_runs_beside_the_chains_and_the_batch_table_shows_it(tiny_config, tmp_path):
    """Its records name the shape and count nodes; the batch table lists it with its nodes as K, its BE (tokens
    per target forward), verified nodes per new token and speedup over target-only, and the report renders it."""
    from blockspec.bench.report import build_report, render

    config = replace(tiny_config, out=tmp_path, configs=("target-only", "block", "tree-2,1,1"), max_drafts=(2,))
    records = list(rec.read(runner.run(replace(config, temperatures=(0.0, 1.0)), progress=False)))
    trees = [r for r in records if r.config == "tree-2,1,1"]
    assert len(records) == 2 * 2 * 3 and all(r.ok for r in records) and len(trees) == 4
    for record in trees:
        assert record.max_draft == 6 and record.meta["tree"] == [2, 1, 1] and record.meta["draft_quant"] is None
        assert all(0 <= a <= 3 for a in record.accepted) and max(record.verified) > 3  # a depth, and nodes
        assert max(record.drafted) == 3  # levels: a draft forward each
    report = build_report(records)
    rows = {(row.config, row.temperature): row for row in report.batch}
    assert {name for name, _ in rows} == {"target-only", "block", "tree-2,1,1"}
    for temperature in (0.0, 1.0):
        row = rows[("tree-2,1,1", temperature)]
        assert row.max_draft == 6 and row.speedup_vs_target is not None
        assert row.block_efficiency is not None and 1 <= row.block_efficiency <= 4
        assert row.verified_per_emitted is not None and row.drafted_per_emitted is not None
    written = render(report, tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "| tree-2,1,1 " in text and "tokens_per_s_vs_batch.png" in {p.name for p in written}


def test_auto_tree_runs_at_the_largest_k_with_the_probes_draft_and_the_batch_table_compares_it(
    tiny_config, tmp_path, monkeypatch
):
    """Cheap verification: the adaptive shape drafts, at most the largest K nodes, with the draft the machine's
    probe chose (int8 here), as `generate --tree auto` does, and the batch table gives it its x best fixed K."""
    from blockspec.bench.report import build_report, render

    monkeypatch.setattr(auto, "latency_probe", lambda target, draft, batch: profile(CHEAP_VERIFICATION, draft_ms=10))
    config = replace(tiny_config, out=tmp_path, configs=("target-only", "block", "auto-tree"), max_drafts=(2, 4))
    records = list(rec.read(runner.run(config, progress=False)))
    shaped = [r for r in records if r.config == "auto-tree"]
    assert shaped and all(r.ok and r.max_draft == 4 for r in shaped)
    assert all(r.meta["tree"] == "auto" and r.meta["draft_quant"] == "int8" for r in shaped)
    assert any(k > 0 for r in shaped for k in r.verified) and all(k <= 4 for r in shaped for k in r.verified)
    report = build_report(records)
    rows = {row.config: row for row in report.batch}
    assert rows["auto-tree"].speedup_vs_best_fixed is not None and rows["auto-tree"].max_draft == 4
    render(report, tmp_path / "report")
    assert "| auto-tree " in (tmp_path / "report" / "report.md").read_text()


def tiny_gguf_pair(tmp_path, monkeypatch) -> dict:
    """A tiny GGUF target and draft (their tokenizer handed over as in tests/cli/test_sv_llamacpp.py), as
    BenchConfig's ``target`` and ``draft``; the latency probe pinned to cheap verification."""
    pytest.importorskip("llama_cpp")
    import transformers
    from kits.tiny import perturbed, tiny_model, tiny_tokenizer
    from kits.tinygguf import save_gguf

    original = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda *args, **kwargs: tiny_tokenizer() if kwargs.get("gguf_file") else original(*args, **kwargs),
    )
    monkeypatch.setattr(auto, "latency_probe", lambda target, draft, batch: profile(CHEAP_VERIFICATION, draft_ms=10))
    target = tiny_model(sharpness=5.0)
    return {
        "target": save_gguf(target, tmp_path / "target.gguf"),
        "draft": save_gguf(perturbed(target, scale=0.3, seed=1), tmp_path / "draft.gguf"),
    }


def test_auto_runs_gguf_models_on_llama_cpp_and_leaves_out_what_only_transformers_runs(tmp_path, monkeypatch, caplog):
    """The quick preset's backend, auto, on GGUF files on a CPU: llama.cpp, as generate runs them, with transformers'
    own baselines left out and said so, and the directory's settings naming llama.cpp; nothing but those: refused.
    Transformers keeps them all, and a backend given by name leaves llama.cpp to refuse them."""
    import logging

    config = runner.BenchConfig(
        **tiny_gguf_pair(tmp_path, monkeypatch),
        configs=("target-only", "hf-assisted", "block", "hf-lookup"),
        datasets=("lm1b",),
        prompts_per_dataset=1,
        max_drafts=(2,),
        max_new_tokens=4,
        chat=False,
        out=tmp_path / "out",
    )
    assert config.backend == runner.PRESETS["quick"].backend == "auto"
    with caplog.at_level(logging.WARNING, logger="blockspec.bench.runner"):
        records = list(rec.read(runner.run(config, progress=False)))
    assert [r.config for r in records] == ["target-only", "block"] and all(r.ok for r in records), records
    assert "leaving out hf-assisted, hf-lookup, which only transformers runs; --backend hf" in caplog.text
    stored = json.loads((config.out / runner.CONFIG).read_text())
    assert (stored["backend"], stored["configs"]) == ("llamacpp", ["target-only", "block"])
    with pytest.raises(ValueError, match="hf-assisted run on transformers only: add --backend hf"):
        runner.run(replace(config, configs=("hf-assisted",), out=tmp_path / "none"), progress=False)
    assert runner.on_backend(config, "hf") == replace(config, backend="hf")
    assert runner.on_backend(replace(config, backend="llamacpp"), "llamacpp").configs == config.configs


def test_trees_paths_and_auto_tree_run_on_llama_cpp(tmp_path, monkeypatch):
    """The tree configurations on --backend llamacpp (tiny GGUFs): every run ok, the static shapes with the draft as
    it is and auto-tree with the q4_0 draft the auto configurations use, trees drafted and verified, at a batch of
    two rows."""
    config = runner.BenchConfig(
        **tiny_gguf_pair(tmp_path, monkeypatch),
        backend="llamacpp",
        configs=("target-only", "tree-2,1,1", "paths-2", "auto-tree"),
        datasets=("lm1b",),
        prompts_per_dataset=2,
        batch_sizes=(2,),
        max_drafts=(3,),
        temperatures=(0.0, 1.0),
        max_new_tokens=6,
        chat=False,
        out=tmp_path / "out",
    )
    records = list(rec.read(runner.run(config, progress=False)))
    assert {r.config for r in records} == set(config.configs) and all(r.ok for r in records), records
    for record in records:  # auto-tree drafts with q4_0 there, as `generate --tree auto` does; the shapes as shipped
        if record.config != "target-only":
            quant = "q4_0" if record.config == "auto-tree" else None
            assert record.meta["draft_quant"] == quant and max(record.verified) > 0, record


def test_paths_are_planned_at_every_k_as_their_length():
    config = runner.BenchConfig(configs=("block", "paths-3", "paths-iid-2"), max_drafts=(2, 4))
    runs = runner.plan(config, {"a": [("a/0", [1])]})
    assert [(r.config, r.max_draft) for r in runs] == [
        ("block", 2),
        ("block", 4),
        ("paths-3", 2),
        ("paths-3", 4),
        ("paths-iid-2", 2),
        ("paths-iid-2", 4),
    ]


@pytest.mark.parametrize(
    "name, message",
    [
        ("paths-0", "K >= 1"),
        ("paths-x", "paths-K (K paths per step"),
        ("paths-distinct-3", "paths-iid-K"),
        ("paths-03", "as 'paths-3'"),
        ("paths-iid-17", "68 nodes per step, more than 64"),  # 17 paths of 4 tokens
    ],
)
def test_a_paths_configuration_the_library_refuses_or_written_otherwise_is_refused(name, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        runner.BenchConfig(configs=("block", name), max_drafts=(2, 4))


def test_paths_configurations_run_beside_the_chains_and_the_batch_table_shows_them(tiny_config, tmp_path):
    """Their records keep the paths, their length and drawing in meta, and verified counts nodes (at most k * K); the
    batch table lists them at K."""
    from blockspec.bench.report import build_report, render

    configs = ("target-only", "block", "paths-2", "paths-iid-3")
    records = list(rec.read(runner.run(replace(tiny_config, out=tmp_path, configs=configs), progress=False)))
    assert len(records) == 2 * (1 + 2 + 2 + 2) and all(r.ok for r in records)
    for name, paths, drawn in (("paths-2", 2, "distinct"), ("paths-iid-3", 3, "iid")):
        found = [r for r in records if r.config == name]
        assert sorted(r.max_draft for r in found) == [2, 2, 3, 3]
        for record in found:
            assert record.meta["paths"] == {"paths": paths, "length": record.max_draft, "drawn": drawn}
            assert max(record.drafted) == record.max_draft and max(record.verified) <= paths * record.max_draft
            assert all(0 <= a <= record.max_draft for a in record.accepted)
    report = build_report(records)
    assert {(row.config, row.max_draft) for row in report.batch} >= {("paths-2", 2), ("paths-iid-3", 3)}
    render(report, tmp_path / "report")
    assert "| paths-iid-3 " in (tmp_path / "report" / "report.md").read_text()
