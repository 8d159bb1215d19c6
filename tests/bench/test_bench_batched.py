"""`blockspec bench` with batch sizes and Speculative Verification: the plan, an end-to-end run on tiny saved
models (records, report table, JSON line, plot), resuming, and the CLI's errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from kits.tiny import save_tiny

from blockspec.bench import records as rec
from blockspec.bench import runner
from blockspec.bench.report import build_report, format_table, render, summary
from blockspec.policy import LatencyTable
from blockspec.policy.features import COMPANION_FEATURES, DRAFT_FEATURES
from blockspec.policy.latency import LatencyProfile
from blockspec.policy.predictor import Predictor, Profile

pytestmark = pytest.mark.usefixtures("quiet_machine")  # tests/bench/conftest.py

COMPANION = "prefix:1"  # the tiny target has 2 layers
SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}


def prompts(dataset: str, n: int) -> list[tuple[str, list[int]]]:
    return [(f"{dataset}/{i}", [i + 1, i + 2]) for i in range(n)]


# --- the plan ------------------------------------------------------------------------------------------------


def test_plan_runs_batches_of_consecutive_prompts_with_per_prompt_seeds():
    config = runner.BenchConfig(
        prompts_per_dataset=4,
        max_drafts=(2, 4),
        batch_sizes=(1, 2, 4),
        seed=10,
        configs=("target-only", "token", "block", "hf-assisted", "sv-block", "sv-draft"),
    )
    runs = runner.plan(config, {"a": prompts("a", 4), "b": prompts("b", 5)})
    assert len({r.key for r in runs}) == len(runs)
    batched = [r for r in runs if r.batch_size == 2]
    assert {r.prompt_ids for r in batched} == {("a/0", "a/1"), ("a/2", "a/3"), ("b/0", "b/1"), ("b/2", "b/3")}
    first = next(r for r in batched if r.prompt_id == "b/2")
    assert first.prompts == ((3, 4), (4, 5)) and first.seed == 12  # row b uses seed + its prompt index
    assert {(r.dataset, r.prompt_ids) for r in runs if r.batch_size == 4} == {
        ("a", ("a/0", "a/1", "a/2", "a/3")),
        ("b", ("b/0", "b/1", "b/2", "b/3")),
    }
    assert not any(r.prompt_id == "b/4" for r in runs if r.batch_size > 1)  # b/4 fills no batch of 2 or 4
    assert {r.batch_size for r in runs if r.config == "hf-assisted"} == {1}  # batch 1 only
    # SV: one run per batch, drafting at most max(verified); fixed K: one per K
    per_batch = [(r.config, r.max_draft) for r in runs if r.key[:2] == ("a", "a/0") and r.batch_size == 4]
    assert per_batch == [
        ("target-only", 0),
        ("token", 2),
        ("token", 4),
        ("block", 2),
        ("block", 4),
        ("sv-block", 4),
        ("sv-draft", 4),
    ]
    # round n holds batch n of every batch size (smallest first) and dataset, every configuration in turn
    groups = [(r.round, r.batch_size, r.dataset) for r in runs]
    order = [g for n, g in enumerate(groups) if n == 0 or g != groups[n - 1]]
    assert order == [
        (0, 1, "a"),
        (0, 1, "b"),
        (0, 2, "a"),
        (0, 2, "b"),
        (0, 4, "a"),
        (0, 4, "b"),
        (1, 1, "a"),
        (1, 1, "b"),
        (1, 2, "a"),
        (1, 2, "b"),
        (2, 1, "a"),
        (2, 1, "b"),
        (3, 1, "a"),
        (3, 1, "b"),
        (4, 1, "b"),
    ]
    assert [r.batch_size for r in runs].count(1) == 9 * (len(per_batch) + 1)  # 4 + 5 prompts; hf-assisted too


def test_batch_one_plan_is_unchanged():
    config = runner.BenchConfig(max_drafts=(2, 4), temperatures=(1.0, 0.0), seed=7)
    runs = runner.plan(config, {"a": prompts("a", 2), "b": prompts("b", 1)})
    assert [r.key[:3] for r in runs[:2]] == [("a", "a/0", "target-only"), ("a", "a/0", "token")]
    assert all(r.batch_size == 1 and r.seed == 7 + r.round for r in runs)


def test_batch_sizes_larger_than_the_prompt_sets_are_refused():
    with pytest.raises(ValueError, match="batch size 4 needs at least 4 prompts per dataset, not 2"):
        runner.BenchConfig(prompts_per_dataset=2, batch_sizes=(1, 4))
    config = runner.BenchConfig(prompts_per_dataset=4, batch_sizes=(4,))
    with pytest.raises(ValueError, match="these have fewer: {'b': 3}"):
        runner.plan(config, {"a": prompts("a", 4), "b": prompts("b", 3)})
    with pytest.raises(ValueError, match="unknown bench configurations"):
        runner.BenchConfig(configs=("sv",))


# --- end to end on tiny models ---------------------------------------------------------------------------------


def hand_profile(target: str, draft: str) -> Profile:
    """Predictors with hand-set weights (as in test_sv.py, biases raised for the tiny models' flat laws): gains
    rise with the draft's confidence and the companion's plug-in gain."""
    predictors = {
        method: {
            "draft": Predictor(DRAFT_FEATURES, (4.0, -0.5, -0.5, 1.0, 0.4)),
            "companion": Predictor(COMPANION_FEATURES, (1.0, -0.2, -0.3, 0.5, 0.2, 1.5, 0.5)),
        }
        for method in ("token", "block")
    }
    return Profile(
        target=target,
        draft=draft,
        companion=COMPANION,
        sampling=SAMPLING,
        predictors=predictors,
        prior={m: [0.8, 0.7, 0.6] for m in ("token", "block")},
        metrics={"note": "hand-set weights"},
    )


def hand_latency(target: str, draft: str) -> LatencyProfile:
    """Scoring up to three tokens per row costs little more than one, a fourth a lot: SV drafts and verifies 0 to 2
    tokens per row, depending on the predicted gains."""
    meta = {
        "date": "-",
        "target": target,
        "draft": draft,
        "companion": COMPANION,
        "dtype": "float32",
        "device": "cpu",
        "torch_threads": 1,
        "torch": "-",
        "machine": "-",
        "processor": "-",
        "context": 8,
        "repeats": 1,
    }
    return LatencyProfile(
        target=LatencyTable((1, 2), (1, 2, 3, 4), ((1.0, 1.01, 1.05, 2.5), (1.0, 1.01, 1.05, 2.5))),
        draft=LatencyTable((1, 2), (1, 2), ((1e-4, 1e-4), (1e-4, 1e-4))),
        companion=LatencyTable((1, 2), (1, 2, 3, 4), ((1e-4,) * 4, (1e-4,) * 4)),
        meta=meta,
    )


@pytest.fixture(scope="module")
def sv_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-batched")
    target, draft = save_tiny(root / "target"), save_tiny(root / "draft", noise=0.3)
    hand_profile(target, draft).save(root / "calibration.json")
    hand_latency(target, draft).save(root / "latency.json")
    return runner.BenchConfig(
        target=target,
        draft=draft,
        dtype="float32",
        datasets=("lm1b",),
        prompts_per_dataset=4,
        max_drafts=(2, 3),
        temperatures=(1.0,),
        max_new_tokens=6,
        batch_sizes=(1, 2),
        out=root / "out",  # chat as `blockspec bench`
        configs=("target-only", "token", "block", "sv-block", "sv-draft"),
        companion=COMPANION,
        sv_profile=root / "calibration.json",
        latency=root / "latency.json",
    )


RUNS_PER_BATCH = 1 + 2 + 2 + 1 + 1  # target-only, token and block at K = 2 and 3, sv-block and sv-draft


@pytest.fixture(scope="module")
def sv_records(sv_config):
    return list(rec.read(runner.run(sv_config, progress=False)))


def test_batched_run_writes_one_record_per_batch_and_configuration(sv_records):
    assert len(sv_records) == (4 + 2) * RUNS_PER_BATCH
    for record in sv_records:
        assert record.schema == rec.SCHEMA and len(record.prompt_ids) == record.batch_size
        assert record.prompt_id == record.prompt_ids[0] and len(record.finish_reasons) == record.batch_size
        assert record.new_tokens <= 6 * record.batch_size and record.wall_time > 0
        # per-step lists: drafted and rows per step, accepted and verified per row-step
        assert len(record.drafted) == len(record.rows) and len(record.accepted) == sum(record.rows)
        assert len(record.verified) == len(record.accepted) and max(record.rows) == record.batch_size
        assert all(0 <= a <= k for a, k in zip(record.accepted, record.verified))
        if record.config in ("token", "block"):
            assert len(record.expected_token) == len(record.expected_block) == len(record.accepted)
        else:
            assert record.expected_token == record.expected_block == []
        if record.config.startswith("sv"):
            assert record.max_draft == 3 and record.meta["companion"] == COMPANION
    by_seed = {r.seed: r.prompt_id for r in sv_records if r.batch_size == 1}  # prompt i has seed i
    for record in (r for r in sv_records if r.batch_size == 2):  # consecutive prompts, seeds seed + index
        assert record.seed in (0, 2) and record.prompt_ids == [by_seed[record.seed], by_seed[record.seed + 1]]
    for record in sv_records:  # a row verifies at most what was drafted in its step
        drafted = [d for d, n in zip(record.drafted, record.rows) for _ in range(n)]  # per row-step
        assert all(k <= d for k, d in zip(record.verified, drafted))
        if record.config in ("token", "block"):  # fixed K: K drafted per step while K + 1 tokens fit
            assert max(record.drafted) == record.max_draft
    assert any(k > 0 for r in sv_records if r.config.startswith("sv") for k in r.verified)  # SV speculates


def test_batched_report_table_json_and_plot(sv_records, tmp_path):
    pytest.importorskip("matplotlib")
    report = build_report(sv_records)
    configs = ("target-only", "token", "block", "sv-block", "sv-draft")
    assert {(r.batch_size, r.config) for r in report.batch} == {(b, c) for b in (1, 2) for c in configs}
    assert {row.batch_size for row in report.rows} == {1}  # the token-vs-block tables stay batch 1
    for row in report.batch:
        units = [
            r
            for r in sv_records
            if (r.config, r.max_draft, r.batch_size) == (row.config, row.max_draft, row.batch_size)
        ]
        assert row.batches == len(units)
        rate = sum(r.new_tokens for r in units) / sum(r.wall_time - r.prefill_time for r in units)
        assert row.tokens_per_s is not None and row.tokens_per_s.value == pytest.approx(rate)
        assert row.tokens_per_s.lo is not None  # >= 2 batches in the one dataset: an interval
        verified = sum(sum(r.verified) for r in units)
        per_emitted = verified / sum(r.new_tokens for r in units)
        assert row.verified_per_emitted is not None and row.verified_per_emitted.value == pytest.approx(per_emitted)
        if row.config != "target-only":
            accepted = sum(sum(r.accepted) for r in units)
            assert row.rejected is not None and row.rejected.value == pytest.approx(1 - accepted / verified)
            assert row.speedup_vs_target is not None
        assert (row.speedup_vs_best_fixed is not None) == row.config.startswith("sv")
    assert sum(row.best_fixed for row in report.batch) == 2  # one per batch size
    table = format_table(report)
    assert "## batch sizes and Speculative Verification" in table and "sv-draft" in table and " *" in table
    data = json.loads(json.dumps(summary(report)))
    assert len(data["batch"]) == len(report.batch) and len(data["batch_best_fixed"]) == 2
    paths = {p.name: p for p in render(report, tmp_path)}
    assert paths["tokens_per_s_vs_batch.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_resumed_batched_run_skips_done_records(sv_config, sv_records):
    assert len(list(rec.read(runner.run(sv_config, progress=False)))) == len(sv_records)  # nothing left to run


def test_time_budget_then_resume_with_batches(sv_config, tmp_path):
    boxed = replace(sv_config, out=tmp_path, time_budget=0.0, batch_sizes=(2,), configs=("target-only", "sv-block"))
    assert len(list(rec.read(runner.run(boxed, progress=False)))) == 1
    records = list(rec.read(runner.run(replace(boxed, time_budget=None), progress=False)))
    assert sorted((r.seed, r.config) for r in records) == [
        (0, "sv-block"),
        (0, "target-only"),
        (2, "sv-block"),
        (2, "target-only"),
    ]
    assert len({r.key for r in records}) == 4 and all(r.batch_size == 2 for r in records)


def test_missing_sv_profile_names_the_command_that_makes_it(sv_config, tmp_path, capsys):
    from blockspec.cli import main

    def bench(batch_sizes=("1", "2"), sv_profile=sv_config.sv_profile, latency=sv_config.latency) -> int:
        return main(
            [
                "bench",
                "--target",
                sv_config.target,
                "--draft",
                sv_config.draft,
                "--dtype",
                "float32",
                "--datasets",
                "lm1b",
                "--prompts",
                "2",
                "--batch-sizes",
                *batch_sizes,
                "--configs",
                "target-only",
                "sv-token",
                "--companion",
                COMPANION,
                "--sv-profile",
                str(sv_profile),
                "--latency",
                str(latency),
                "--out",
                str(tmp_path),
            ]
        )

    assert bench(sv_profile=tmp_path / "none.json") == 2
    assert "none.json does not exist: run `blockspec sv calibrate`" in capsys.readouterr().err
    assert bench(latency=tmp_path / "none.json") == 2
    assert "none.json does not exist: run `blockspec sv profile`" in capsys.readouterr().err
    assert bench(batch_sizes=("4",)) == 2
    assert "needs at least 4 prompts per dataset" in capsys.readouterr().err
    assert not (tmp_path / "records.jsonl").exists()


def test_bench_command_with_batch_sizes_prints_the_batch_table_and_json_line(sv_config, sv_records, capsys):
    """The CLI on the records of the run above (everything recorded: it only resumes and reports)."""
    pytest.importorskip("matplotlib")
    from blockspec.cli import main

    assert (
        main(
            [
                "bench",
                "--target",
                sv_config.target,
                "--draft",
                sv_config.draft,
                "--dtype",
                "float32",
                "--datasets",
                "lm1b",
                "--prompts",
                "4",
                "--max-draft",
                "2",
                "3",
                "--max-new-tokens",
                "6",
                "--batch-sizes",
                "1",
                "2",
                "--configs",
                "target-only",
                "token",
                "block",
                "sv-block",
                "sv-draft",
                "--companion",
                COMPANION,
                "--sv-profile",
                str(sv_config.sv_profile),
                "--latency",
                str(sv_config.latency),
                "--out",
                str(sv_config.out),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("| 1 ") and "sv-draft" in line for line in lines)
    data = json.loads(lines[-1])
    assert data["records"] == len(sv_records) and {r["batch_size"] for r in data["batch"]} == {1, 2}
    assert (sv_config.out / "tokens_per_s_vs_batch.png").stat().st_size > 0
