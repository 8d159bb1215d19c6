"""The alignment sweep (`blockspec align`, the runner's "align" preset) on tiny saved models and synthetic records:
the plan, the records, resume and budget, the paired analytic gain by hand, bootstrap coverage over PROMPTS, overlap
1 and gain 0 for a draft equal to the target, the report's table, JSON and plot, and the command line."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from kits.tiny import perturbed, save_tiny, tiny_model

from blockspec import SamplingParams, SpeculativeDecoder, cli
from blockspec import defaults as blockspec_defaults
from blockspec.bench import records as rec
from blockspec.bench import report, runner
from blockspec.bench.records import Record
from blockspec.bench.report import ALL, ReportConfig, alignment
from blockspec.bench.report.stats import Estimate
from blockspec.cli.bench import bench_config

FAST = ReportConfig(n_boot=300)


def aligned(records: list[Record], config: ReportConfig) -> alignment.AlignReport:
    """The alignment report of records that must make one."""
    built = alignment.build_report(records, config)
    assert built is not None
    return built


def value(estimate: Estimate | None) -> float:
    assert estimate is not None
    return estimate.value


def interval(estimate: Estimate | None) -> tuple[float, float]:
    """(lo, hi) of an estimate that must have an interval."""
    assert estimate is not None and estimate.lo is not None and estimate.hi is not None, estimate
    return estimate.lo, estimate.hi


pytestmark = pytest.mark.usefixtures("probes_in_a_temporary_cache", "quiet_machine")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("align-models")
    return save_tiny(root / "target"), save_tiny(root / "draft", noise=0.3)


@pytest.fixture(scope="module")
def sweep(models, tmp_path_factory):
    """The align preset on the tiny pair: 3 prompts of lm1b at two draft temperatures."""
    target, draft = models
    return replace(
        runner.PRESETS["align"],
        target=target,
        draft=draft,
        dtype="float32",
        datasets=("lm1b",),
        prompts_per_dataset=3,
        draft_temperatures=(0.5, 1.0),
        max_new_tokens=8,
        chat=False,
        out=tmp_path_factory.mktemp("align"),
    )


@pytest.fixture(scope="module")
def swept(sweep):
    """The records of ``sweep``, run once for the module."""
    return list(rec.read(runner.run(sweep, progress=False)))


def test_plan_interleaves_every_draft_temperature_prompt_by_prompt_with_one_seed_per_prompt():
    config = replace(
        runner.PRESETS["align"], configs=("target-only", "block"), draft_temperatures=(0.5, 1.0, 2.0), seed=7
    )
    runs = runner.plan(config, {"a": [("a/0", [1]), ("a/1", [2]), ("a/2", [3])], "b": [("b/0", [4])]})
    assert [(r.prompt_id, r.config, r.draft_temperature) for r in runs[:8]] == [
        ("a/0", "target-only", None),
        ("a/0", "block", 0.5),
        ("a/0", "block", 1.0),
        ("a/0", "block", 2.0),
        ("b/0", "target-only", None),
        ("b/0", "block", 0.5),
        ("b/0", "block", 1.0),
        ("b/0", "block", 2.0),
    ]
    assert len(runs) == 4 * 4 and len({r.key for r in runs}) == len(runs) and runs[-1].prompt_id == "a/2"
    assert {r.seed for r in runs if r.prompt_id == "a/1"} == {8}  # seed + 1 at every T_d: shared draws
    assert {r.draft_temperature for r in runner.plan(runner.PRESETS["quick"], {"a": [("a/0", [1])]})} == {None}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"temperatures": (1.0, 0.0)}, "target temperature must be > 0"),
        ({"draft_temperatures": (1.0, -0.5)}, "draft temperatures must be >= 0"),
        ({"draft_temperatures": (1.0, 1.0)}, "draft temperatures repeat"),
        ({"batch_sizes": (1, 2)}, "batch size 1 only"),
        ({"configs": ("target-only", "auto")}, "apply to the fixed-length configs"),
    ],
)
def test_the_config_refuses_what_a_draft_temperature_cannot_mean(change, message):
    with pytest.raises(ValueError, match=message):
        replace(runner.PRESETS["align"], **change)


def test_draft_sampling_is_refused_at_target_temperature_zero():
    target = tiny_model(sharpness=5.0)
    decoder = SpeculativeDecoder(target, perturbed(target, scale=0.3, seed=1), rule="block", max_draft=2)
    with pytest.raises(ValueError, match="draft_sampling needs a sampled target"):
        decoder.generate([[1, 2]], max_new_tokens=4, sampling=SamplingParams(0.0), draft_sampling=SamplingParams(1.0))


def test_one_record_per_prompt_and_draft_temperature_with_aligned_per_step_values(sweep, swept):
    prompts = sorted({r.prompt_id for r in swept})
    assert len(prompts) == 3 and sorted(r.key for r in swept) == sorted(
        ("lm1b", p, "block", 4, 1.0, 1, t) for p in prompts for t in (0.5, 1.0)
    )
    for record in swept:
        steps = len(record.accepted)
        assert steps and len(record.verified) == len(record.expected_token) == len(record.expected_block) == steps
        assert len(record.overlap) == steps and (record.new_tokens == 8 or record.finish_reason == "eos")
        assert all(0 <= a <= k <= 4 for a, k in zip(record.accepted, record.verified))
        assert all(o is None if k == 0 else 0 <= o <= 1 + 1e-6 for o, k in zip(record.overlap, record.verified))
        assert all(
            0 <= e <= k + 1e-5 for e, k in zip(record.expected_token + record.expected_block, record.verified * 2)
        )
        assert record.meta["target"] == sweep.target and record.meta["dtype"] == "float32" and record.meta["date"]
    seeds = {(r.prompt_id, r.draft_temperature): r.seed for r in swept}
    assert all(seeds[(p, 0.5)] == seeds[(p, 1.0)] for p in prompts) and sorted(set(seeds.values())) == [0, 1, 2]


def test_resuming_adds_nothing_and_a_spent_budget_stops_scheduling(sweep, swept, tmp_path):
    records_file = sweep.out / runner.RECORDS
    before = records_file.read_text()
    runner.run(sweep, progress=False)
    assert records_file.read_text() == before
    boxed = replace(sweep, out=tmp_path, time_budget=0.0)
    assert len(list(rec.read(runner.run(boxed, progress=False)))) == 1  # the first run always goes
    assert len(list(rec.read(runner.run(replace(boxed, time_budget=None), progress=False)))) == len(swept)
    with pytest.raises(ValueError, match="other settings"):
        runner.run(replace(boxed, max_new_tokens=9), progress=False)


def test_the_reported_gain_and_overlap_are_the_pooled_values_of_the_records(swept):
    built = aligned(swept, FAST)
    for label in ("lm1b", ALL):
        for draft_temperature in (0.5, 1.0):
            mine = [r for r in swept if r.draft_temperature == draft_temperature]
            exp_t = [e for r in mine for e in r.expected_token]
            exp_b = [e for r in mine for e in r.expected_block]
            pairs = [(o, k) for r in mine for o, k in zip(r.overlap, r.verified) if o is not None]
            (row,) = [r for r in built.rows_of(label) if r.draft_temperature == draft_temperature]
            assert row.prompts == len(mine) == 3 and row.steps == len(exp_t)
            assert row.analytic_be_token == pytest.approx(1 + np.mean(exp_t), abs=1e-12)
            assert row.analytic_be_block == pytest.approx(1 + np.mean(exp_b), abs=1e-12)
            assert value(row.gain) == pytest.approx((1 + np.mean(exp_b)) / (1 + np.mean(exp_t)) - 1, abs=1e-12)
            overlap = sum(o * k for o, k in pairs) / sum(k for _, k in pairs)  # per verified position
            assert value(row.overlap) == pytest.approx(overlap, abs=1e-12)
            assert row.be_block == pytest.approx(1 + np.mean([a for r in mine for a in r.accepted]), abs=1e-12)
            lo, hi = interval(row.gain)  # three prompts: an interval
            assert lo <= value(row.gain) <= hi


def test_the_report_writes_the_alignment_table_json_and_plot_and_no_empty_bench_plots(sweep, swept, tmp_path, capsys):
    assert report.main(["--records", str(sweep.out / runner.RECORDS), "--out", str(tmp_path), "--n-boot", "200"]) == 0
    out = capsys.readouterr().out
    aligned = json.loads(out.strip().splitlines()[-1])["alignment"]
    pooled = aligned["pooled"]
    assert aligned["records"] == len(swept) == 6
    assert [row["draft_temperature"] for row in pooled] == [0.5, 1.0] and all(row["dataset"] == ALL for row in pooled)
    assert {"overlap", "gain", "analytic_be_token", "analytic_be_block"} <= set(pooled[0])
    assert "# alignment sweep" in out and "## dataset: lm1b" in out and "overlap (CI)" in out
    assert (tmp_path / "alignment.md").read_text().strip() in out
    assert json.loads((tmp_path / "summary.json").read_text())["alignment"]["pooled"] == pooled
    assert (tmp_path / "alignment_gain_vs_overlap.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "block_efficiency_vs_k.png").exists()  # no bench table: no empty bench plots


def test_the_bench_tables_leave_the_runs_at_a_draft_temperature_to_the_alignment_report(swept):
    plain = [replace(r, draft_temperature=None, overlap=[]) for r in swept if r.draft_temperature == 1.0]
    both = report.summary(report.build_report(plain + swept, FAST))
    alone = report.summary(report.build_report(plain, FAST))
    assert (both.pop("records"), alone.pop("records")) == (len(plain) + len(swept), len(plain)) and both == alone
    assert alignment.build_report(plain, FAST) is None


def test_a_draft_equal_to_the_target_at_its_temperature_has_overlap_one_and_no_gain(sweep, tmp_path):
    same = replace(
        sweep, draft=sweep.target, prompts_per_dataset=2, draft_temperatures=(1.0, 2.0), max_new_tokens=12, out=tmp_path
    )
    records = list(rec.read(runner.run(same, progress=False)))
    matched = [r for r in records if r.draft_temperature == 1.0]
    assert all(abs(o - 1) < 1e-5 for r in matched for o in r.overlap if o is not None)
    rows = {r.draft_temperature: r for r in aligned(records, FAST).rows_of(ALL)}
    assert value(rows[1.0].overlap) == pytest.approx(1.0, abs=1e-5)
    assert value(rows[1.0].gain) == pytest.approx(0.0, abs=1e-5)
    assert rows[1.0].analytic_be_token == pytest.approx(rows[1.0].analytic_be_block, abs=1e-5)
    assert value(rows[2.0].overlap) < value(rows[1.0].overlap) - 0.02  # a mismatched temperature: a worse draft


# ------------------------------------------------------------------------------------------ synthetic records


def synthetic(rng: np.random.Generator, prompts: int, gain: float, datasets=("x", "y"), steps: int = 15):
    """Block records at T_d = 1 whose per-prompt analytic BE block is (1 + gain) times BE token, up to per-step
    noise; prompts differ in difficulty (mean E_token)."""
    out = []
    for dataset in datasets:
        for p in range(prompts):
            mu = rng.uniform(0.5, 3.0)
            exp_t = np.clip(mu + rng.normal(0, 0.3, steps), 0, 4)
            exp_b = (1 + gain) * (1 + exp_t) - 1 + rng.normal(0, 0.05, steps)
            out.append(
                Record(
                    dataset=dataset,
                    prompt_id=f"{dataset}/{p}",
                    config="block",
                    max_draft=4,
                    temperature=1.0,
                    batch_size=1,
                    seed=p,
                    new_tokens=64,
                    wall_time=1.0,
                    prefill_time=0.1,
                    verified=[4] * steps,
                    accepted=rng.integers(0, 5, steps).tolist(),
                    expected_token=exp_t.tolist(),
                    expected_block=exp_b.tolist(),
                    overlap=rng.uniform(0.5, 0.9, steps).tolist(),
                    draft_temperature=1.0,
                )
            )
    return out


def test_the_bootstrap_interval_covers_a_known_gain():
    built = aligned(synthetic(np.random.default_rng(3), prompts=20, gain=0.08), ReportConfig(n_boot=1000))
    (row,) = built.rows_of(ALL)
    lo, hi = interval(row.gain)
    assert lo < 0.08 < hi and hi - lo < 0.05
    assert lo > 0  # the gain is resolved, not just covered


def test_no_interval_with_fewer_than_two_prompts_in_a_dataset():
    built = aligned(synthetic(np.random.default_rng(0), prompts=1, gain=0.1, datasets=("x",)), FAST)
    (row,) = built.rows_of(ALL)
    assert row.gain is not None and row.overlap is not None
    assert value(row.gain) == pytest.approx(0.1, abs=0.02) and row.gain.lo is None and row.gain.hi is None
    assert row.overlap.lo is None and "[" not in alignment.format_table(built).split("## all datasets pooled")[1]
    assert alignment.summary(built)["pooled"][0]["gain"]["lo"] is None


# ------------------------------------------------------------------------------------------------ command line


def align_config(argv: list[str]) -> runner.BenchConfig:
    """The BenchConfig `blockspec <argv>` runs."""
    return bench_config(cli.build_parser().parse_args(argv))


def test_align_defaults_are_the_align_presets_and_its_help_explains_the_measurement(capsys):
    preset = runner.PRESETS["align"]
    assert align_config(["align"]) == preset
    assert (preset.target, preset.draft) == (blockspec_defaults.TARGET, blockspec_defaults.DRAFT)
    assert preset.draft_temperatures == (0.4, 0.7, 1.0, 1.5, 2.0) and preset.temperatures == (1.0,)
    assert (preset.max_drafts, preset.max_new_tokens, preset.prompts_per_dataset) == ((4,), 64, 4)
    assert preset.datasets == ("gsm8k", "humaneval", "sharegpt") and preset.configs == ("block",)
    assert preset.dtype == "bfloat16" and preset.batch_sizes == (1,)
    assert align_config(
        ["align", "--temperature", "0.8", "--max-draft", "6", "--draft-temperatures", "1", "2"]
    ) == replace(preset, temperatures=(0.8,), max_drafts=(6,), draft_temperatures=(1.0, 2.0))
    assert align_config(["bench", "--preset", "align", "--draft-temperatures", "0.5"]).draft_temperatures == (0.5,)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["align", "--help"])
    text = capsys.readouterr().out
    assert "overlap" in text and "paired analytic gain" in text and "lossless" in text


def test_align_command_end_to_end_on_saved_tiny_models(models, tmp_path, capsys):
    target, draft = models
    common = [
        "align",
        "--target",
        target,
        "--draft",
        draft,
        "--dtype",
        "float32",
        "--datasets",
        "lm1b",
        "--prompts",
        "2",
        "--draft-temperatures",
        "0.7",
        "1.3",
        "--max-new-tokens",
        "5",
        "--no-chat",
    ]
    assert cli.main([*common, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    summary_line = json.loads(out.strip().splitlines()[-1])
    assert summary_line["records"] == 4 and len(summary_line["alignment"]["pooled"]) == 2
    for name in ("records.jsonl", "config.json", "alignment.md", "summary.json", "alignment_gain_vs_overlap.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert cli.main([*common, "--temperature", "0", "--out", str(tmp_path / "greedy")]) == 2
    assert "target temperature must be > 0" in capsys.readouterr().err
