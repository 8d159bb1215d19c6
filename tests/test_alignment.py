"""`blockspec align` (the alignment sweep) on tiny in-process models and synthetic records: plan, records, resume,
time budget, the paired analytic gain by hand, bootstrap coverage over PROMPTS, overlap 1 and gain 0 for a
draft equal to the target, the table, the JSON line, the plot and the command line."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from blockspec import SamplingParams, SpeculativeDecoder
from blockspec.cli import commands as cli
from blockspec import defaults as blockspec_defaults
from blockspec.bench import alignment
from blockspec.bench.alignment import ALL, AlignConfig, AlignRecord, build_report, format_table, summary
from blockspec.bench.report import ReportConfig
from tiny import perturbed, save_tiny, tiny_model

PROMPTS = [("a", "a/0", [1, 2, 3, 4, 5]), ("a", "a/1", [6, 7, 8]), ("b", "b/0", [9, 10]), ("b", "b/1", [11, 12, 13])]
FAST = ReportConfig(n_boot=300)


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(sharpness=5.0)
    return target, perturbed(target, scale=0.3, seed=1)


@pytest.fixture(scope="module")
def swept(pair, tmp_path_factory):
    """The sweep of PROMPTS at two draft temperatures, run once for the module."""
    config = AlignConfig(target="tiny", draft="tiny-noisy", dtype="float32", draft_temperatures=(0.5, 1.0),
                         max_new_tokens=8, out=tmp_path_factory.mktemp("align"))
    records_file = alignment.run(config, prompts=PROMPTS, models=pair, progress=False)
    return config, records_file


def test_plan_interleaves_every_draft_temperature_prompt_by_prompt_with_one_seed_per_prompt():
    config = AlignConfig(draft_temperatures=(0.5, 1.0, 2.0), seed=7)
    cells = alignment.plan(config, PROMPTS + [("a", "a/2", [1])])
    assert [(c.prompt_id, c.draft_temperature) for c in cells[:6]] == [
        ("a/0", 0.5), ("a/0", 1.0), ("a/0", 2.0), ("b/0", 0.5), ("b/0", 1.0), ("b/0", 2.0)]
    assert len(cells) == 5 * 3 and cells[-1].prompt_id == "a/2"
    assert {c.seed for c in cells if c.prompt_id in ("a/1", "b/1")} == {8}


def test_config_refuses_a_greedy_target_and_negative_draft_temperatures():
    with pytest.raises(ValueError, match="target temperature must be > 0"):
        AlignConfig(temperature=0.0)
    with pytest.raises(ValueError, match="draft temperatures"):
        AlignConfig(draft_temperatures=(1.0, -0.5))


def test_draft_sampling_is_refused_at_target_temperature_zero(pair):
    decoder = SpeculativeDecoder(*pair, verifier="block", max_draft=2)
    with pytest.raises(ValueError, match="draft_sampling needs a sampled target"):
        decoder.generate([[1, 2]], max_new_tokens=4, sampling=SamplingParams(0.0), draft_sampling=SamplingParams(1.0))


def test_one_record_per_prompt_and_draft_temperature_with_aligned_per_step_values(swept):
    config, records_file = swept
    records = list(alignment.read(records_file))
    assert sorted(r.key for r in records) == sorted(
        (d, p, t, 4, 1.0) for d, p, _ in PROMPTS for t in (0.5, 1.0))
    for record in records:
        steps = len(record.accepted)
        assert steps and len(record.verified) == len(record.expected_token) == len(record.expected_block) == steps
        assert len(record.overlap) == steps and (record.new_tokens == 8 or record.finish_reason == "eos")
        assert all(0 <= a <= k <= 4 for a, k in zip(record.accepted, record.verified))
        assert all(o is None if k == 0 else 0 <= o <= 1 + 1e-6 for o, k in zip(record.overlap, record.verified))
        assert all(0 <= e <= k + 1e-5 for e, k in zip(record.expected_token + record.expected_block,
                                                       record.verified * 2))
        assert record.meta["target"] == "tiny" and record.meta["dtype"] == "float32" and record.meta["date"]
        assert record.seed == int(record.prompt_id[-1])  # seed + n with seed 0


def test_resuming_skips_done_records_and_a_truncated_last_line(swept, pair, tmp_path):
    config, records_file = swept
    lines = records_file.read_text().splitlines(keepends=True)
    boxed = replace(config, out=tmp_path)
    (tmp_path / alignment.RECORDS).write_text("".join(lines[:-1]) + lines[-1][:40])  # cut mid-line, no newline
    alignment.run(boxed, prompts=PROMPTS, models=pair, progress=False)
    resumed = list(alignment.read(tmp_path / alignment.RECORDS))
    assert sorted(r.key for r in resumed) == sorted(r.key for r in alignment.read(records_file))
    before = (tmp_path / alignment.RECORDS).read_text()
    alignment.run(boxed, prompts=PROMPTS, models=pair, progress=False)  # all done: nothing is added
    assert (tmp_path / alignment.RECORDS).read_text() == before
    with pytest.raises(ValueError, match="other settings"):
        alignment.run(replace(boxed, draft="another"), prompts=PROMPTS, models=pair, progress=False)


def test_a_spent_time_budget_stops_scheduling_and_a_rerun_completes(pair, tmp_path):
    config = AlignConfig(target="t", draft="d", draft_temperatures=(0.5, 1.0), max_new_tokens=4, out=tmp_path,
                         time_budget=0.0)
    records_file = alignment.run(config, prompts=PROMPTS[:2], models=pair, progress=False)
    assert len(list(alignment.read(records_file))) == 1  # the first run always goes, then the budget is spent
    alignment.run(replace(config, time_budget=None), prompts=PROMPTS[:2], models=pair, progress=False)
    assert len(list(alignment.read(records_file))) == 4


def test_the_reported_gain_and_overlap_are_the_pooled_values_of_the_records(swept):
    _, records_file = swept
    records = list(alignment.read(records_file))
    report = build_report(records, FAST)
    for label in ("a", "b", ALL):
        for draft_temperature in (0.5, 1.0):
            mine = [r for r in records if r.draft_temperature == draft_temperature and label in (ALL, r.dataset)]
            exp_t = [e for r in mine for e in r.expected_token]
            exp_b = [e for r in mine for e in r.expected_block]
            pairs = [(o, k) for r in mine for o, k in zip(r.overlap, r.verified) if o is not None]
            (row,) = [r for r in report.rows_of(label) if r.draft_temperature == draft_temperature]
            assert row.prompts == len(mine) and row.steps == len(exp_t)
            assert row.analytic_be_token == pytest.approx(1 + np.mean(exp_t), abs=1e-12)
            assert row.analytic_be_block == pytest.approx(1 + np.mean(exp_b), abs=1e-12)
            assert row.gain.value == pytest.approx((1 + np.mean(exp_b)) / (1 + np.mean(exp_t)) - 1, abs=1e-12)
            overlap = sum(o * k for o, k in pairs) / sum(k for _, k in pairs)  # per verified position
            assert row.overlap.value == pytest.approx(overlap, abs=1e-12)
            assert row.be_block == pytest.approx(1 + np.mean([a for r in mine for a in r.accepted]), abs=1e-12)
            assert row.gain.lo <= row.gain.value <= row.gain.hi  # two prompts per dataset: an interval


def test_report_writes_table_json_line_and_plot_and_reruns_from_records(swept, tmp_path, capsys):
    _, records_file = swept
    assert alignment.main(["--records", str(records_file), "--out", str(tmp_path), "--n-boot", "200"]) == 0
    out = capsys.readouterr().out
    pooled = json.loads(out.strip().splitlines()[-1])["pooled"]
    assert [row["draft_temperature"] for row in pooled] == [0.5, 1.0] and all(row["dataset"] == ALL for row in pooled)
    assert {"overlap", "gain", "analytic_be_token", "analytic_be_block"} <= set(pooled[0])
    assert "## all datasets pooled" in out and "## dataset: a" in out and "overlap (CI)" in out
    assert (tmp_path / "alignment.md").read_text().strip() == out.strip().rsplit("\n", 1)[0].strip()
    assert json.loads((tmp_path / "alignment.json").read_text())["pooled"] == pooled
    assert (tmp_path / "alignment_gain_vs_overlap.png").read_bytes()[:4] == b"\x89PNG"


def test_a_draft_equal_to_the_target_at_its_temperature_has_overlap_one_and_no_gain(tmp_path):
    same = tiny_model(sharpness=5.0), tiny_model(sharpness=5.0)  # identical weights (seeded init)
    config = AlignConfig(target="t", draft="t", draft_temperatures=(1.0, 2.0), max_new_tokens=12, out=tmp_path)
    records = list(alignment.read(alignment.run(config, prompts=PROMPTS[:2], models=same, progress=False)))
    matched = [r for r in records if r.draft_temperature == 1.0]
    assert all(abs(o - 1) < 1e-5 for r in matched for o in r.overlap if o is not None)
    report = build_report(records, FAST)
    rows = {r.draft_temperature: r for r in report.rows_of(ALL)}
    assert rows[1.0].overlap.value == pytest.approx(1.0, abs=1e-5)
    assert rows[1.0].gain.value == pytest.approx(0.0, abs=1e-5)
    assert rows[1.0].analytic_be_token == pytest.approx(rows[1.0].analytic_be_block, abs=1e-5)
    assert rows[2.0].overlap.value < rows[1.0].overlap.value - 0.02  # a mismatched temperature: a worse draft


# ------------------------------------------------------------------------------------------ synthetic records


def synthetic(rng: np.random.Generator, prompts: int, gain: float, datasets=("x", "y"), steps: int = 15):
    """Records whose per-prompt analytic BE block is (1 + gain) times BE token, up to per-step noise; prompts differ
    in difficulty (mean E_token)."""
    out = []
    for d, dataset in enumerate(datasets):
        for p in range(prompts):
            mu = rng.uniform(0.5, 3.0)
            exp_t = np.clip(mu + rng.normal(0, 0.3, steps), 0, 4)
            exp_b = (1 + gain) * (1 + exp_t) - 1 + rng.normal(0, 0.05, steps)
            out.append(AlignRecord(
                dataset=dataset, prompt_id=f"{dataset}/{p}", draft_temperature=1.0, max_draft=4, temperature=1.0,
                seed=p, max_new_tokens=64, new_tokens=64, finish_reason="length", verified=[4] * steps,
                accepted=rng.integers(0, 5, steps).tolist(), expected_token=exp_t.tolist(),
                expected_block=exp_b.tolist(), overlap=rng.uniform(0.5, 0.9, steps).tolist(),
            ))
    return out


def test_the_bootstrap_interval_covers_a_known_gain():
    report = build_report(synthetic(np.random.default_rng(3), prompts=20, gain=0.08), ReportConfig(n_boot=1000))
    (row,) = report.rows_of(ALL)
    assert row.gain.lo < 0.08 < row.gain.hi and row.gain.hi - row.gain.lo < 0.05
    assert row.gain.lo > 0  # the gain is resolved, not just covered


def test_no_interval_with_fewer_than_two_prompts(tmp_path):
    records = synthetic(np.random.default_rng(0), prompts=1, gain=0.1, datasets=("x",))
    report = build_report(records, FAST)
    (row,) = report.rows_of(ALL)
    assert row.gain.value == pytest.approx(0.1, abs=0.02) and row.gain.lo is None and row.gain.hi is None
    assert row.overlap.lo is None and "[" not in format_table(report).split("## all datasets pooled")[1]
    assert summary(report)["pooled"][0]["gain"]["lo"] is None


def test_other_record_files_are_refused(tmp_path):
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps({"schema": 2, "dataset": "x"}) + "\n")
    with pytest.raises(ValueError, match="not an alignment record"):
        list(alignment.read(path))


# ------------------------------------------------------------------------------------------------ command line


def test_align_help_explains_the_measurement_and_defaults_come_from_the_config():
    parser = cli.build_parser()
    args = parser.parse_args(["align"])
    defaults = AlignConfig()
    assert (args.target, args.draft) == (defaults.target, defaults.draft)
    assert (defaults.target, defaults.draft) == (blockspec_defaults.TARGET, blockspec_defaults.DRAFT)
    assert tuple(args.draft_temperatures) == defaults.draft_temperatures == (0.4, 0.7, 1.0, 1.5, 2.0)
    assert (args.temperature, args.max_draft, args.max_new_tokens, args.prompts_per_dataset) == (1.0, 4, 64, 4)
    assert tuple(args.datasets) == ("gsm8k", "humaneval", "sharegpt") and args.out == defaults.out
    text = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "align")[1].format_help()
    assert "overlap" in text and "paired analytic gain" in text and "lossless" in text


def test_align_command_end_to_end_on_saved_tiny_models(tmp_path, capsys):
    target, draft = save_tiny(tmp_path / "target"), save_tiny(tmp_path / "draft", noise=0.3)
    common = ["align", "--target", target, "--draft", draft, "--dtype", "float32", "--datasets", "lm1b",
              "--prompts", "2", "--draft-temperatures", "0.7", "1.3", "--max-new-tokens", "5", "--no-chat"]
    assert cli.main([*common, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    summary_line = json.loads(out.strip().splitlines()[-1])
    assert summary_line["records"] == 4 and len(summary_line["pooled"]) == 2
    for name in ("records.jsonl", "alignment.md", "alignment.json", "alignment_gain_vs_overlap.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert cli.main([*common, "--temperature", "0", "--out", str(tmp_path / "greedy")]) == 2
    assert "target temperature must be > 0" in capsys.readouterr().err
