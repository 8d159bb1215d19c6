"""The benchmark report on synthetic records: exact arithmetic, bootstrap coverage over PROMPTS, table, JSON, plots.

Synthetic model of a run: prompt p has a difficulty (its mean accepted length under token verification,
mu_p) and its own block gain g_p; a step accepts Binomial(K, mean / K) tokens, so the pooled block
efficiency of block is (1 + gain) times that of token in expectation when the g_p average to ``gain``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from blockspec.bench import records as records_io
from blockspec.bench.records import Record
from blockspec.bench.report import (
    ALL, HEADER, ReportConfig, build_report, format_table, main, render, summary,
)

K = 8
STEPS = 20  # per prompt: equal step counts make the pooled BE ratio's expectation exactly 1 + gain


def synthetic(
    rng: np.random.Generator, prompts: int = 40, gain: float = 0.10, gain_spread: float = 0.0,
    dataset: str = "synth", temperature: float = 1.0, draft_len: int = K, with_baselines: bool = True,
) -> list[Record]:
    """token / block (and target-only, hf-assisted) records of one dataset.

    Each prompt's block gain is gain +- gain_spread (sign drawn per prompt): a per-prompt effect that only
    a prompt-level bootstrap sees.
    """
    out = []
    for p in range(prompts):
        prompt_id = f"{dataset}/{p:04d}"
        mu_token = rng.uniform(0.5, 3.5)  # per-prompt difficulty
        # a random sign (not alternating): the prompts' mean gain then varies between experiments, as it does
        # between real prompt samples, so the estimate's error includes the between-prompt variance
        g = gain + gain_spread * rng.choice([-1.0, 1.0])
        mu_block = (1 + g) * (1 + mu_token) - 1  # BE_block = (1 + g) * BE_token for this prompt
        common = dict(dataset=dataset, prompt_id=prompt_id, draft_len=draft_len, temperature=temperature,
                      batch_size=1, seed=p, prefill_time=0.01)
        for config, mu in (("token", mu_token), ("block", mu_block)):
            accepted = rng.binomial(draft_len, mu / draft_len, size=STEPS).tolist()
            new_tokens = sum(accepted) + STEPS
            out.append(Record(
                config=config, new_tokens=new_tokens, wall_time=STEPS * 0.05 * (1.02 if config == "block" else 1.0),
                accepted=accepted, draft_lens=[draft_len] * STEPS,
                expected_token=(mu_token + rng.normal(0, 0.2, STEPS)).tolist(),
                expected_block=(mu_block + rng.normal(0, 0.2, STEPS)).tolist(), **common,
            ))
        if with_baselines:
            base = dict(common, draft_len=0)
            out.append(Record(config="target-only", new_tokens=64, wall_time=64 * 0.03, **base))
            out.append(Record(config="hf-assisted", new_tokens=64, wall_time=64 * 0.02, **base))
    return out


def row_of(report, dataset=ALL):
    rows = report.rows_of(dataset)
    assert len(rows) == 1
    return rows[0]


def test_measured_be_is_one_plus_pooled_mean_accepted():
    records = synthetic(np.random.default_rng(1), prompts=6)
    row = row_of(build_report(records, ReportConfig(n_boot=200)), "synth")
    token = [a for r in records if r.config == "token" for a in r.accepted]
    block = [a for r in records if r.config == "block" for a in r.accepted]
    assert row.be_token == pytest.approx(1 + np.mean(token), abs=1e-12)
    assert row.be_block == pytest.approx(1 + np.mean(block), abs=1e-12)
    assert row.gain.value == pytest.approx((1 + np.mean(block)) / (1 + np.mean(token)) - 1, abs=1e-12)
    assert (row.prompts, row.steps_token, row.steps_block) == (6, 6 * STEPS, 6 * STEPS)


def test_paired_analytic_gain_equals_the_mean_of_the_per_step_expected_values():
    """Exact arithmetic: 1 + mean over the steps of BOTH runs, for each rule; gain = ratio - 1.

    Uneven step counts per record, so a mean of per-prompt means (a plausible mistake) would differ.
    """
    rng = np.random.default_rng(2)
    records = []
    for record in synthetic(rng, prompts=5, with_baselines=False):
        n = int(rng.integers(1, 30))
        records.append(replace(record, expected_token=rng.uniform(0, 3, n).tolist(),
                               expected_block=rng.uniform(0, 4, n).tolist()))
    row = row_of(build_report(records, ReportConfig(n_boot=100)), "synth")
    all_token = [e for r in records for e in r.expected_token]
    all_block = [e for r in records for e in r.expected_block]
    assert row.analytic_be_token == pytest.approx(1 + np.mean(all_token), rel=1e-12)
    assert row.analytic_be_block == pytest.approx(1 + np.mean(all_block), rel=1e-12)
    assert row.analytic_gain.value == pytest.approx((1 + np.mean(all_block)) / (1 + np.mean(all_token)) - 1, rel=1e-12)
    per_prompt_means = np.mean([np.mean(r.expected_token) for r in records])
    assert abs(row.analytic_be_token - (1 + per_prompt_means)) > 1e-6  # the test can tell the two apart


def test_bootstrap_ci_covers_a_known_ten_percent_gain_and_excludes_zero():
    """Every prompt's block BE is 10 % above its token BE in expectation; accepted lengths and expected
    values are noisy. One fixed-seed draw: calibration over many draws is the repeated-experiment test's job."""
    report = build_report(synthetic(np.random.default_rng(4), prompts=60, gain=0.10))
    row = row_of(report)
    for estimate in (row.gain, row.analytic_gain):
        assert estimate.lo < 0.10 < estimate.hi, estimate
        assert estimate.lo > 0, estimate
    # the analytic gain shares its drafts between rules: its interval is the narrower one
    assert row.analytic_gain.hi - row.analytic_gain.lo < row.gain.hi - row.gain.lo


def test_bootstrap_ci_covers_zero_when_there_is_no_gain():
    """One fixed-seed draw (a 95 % CI misses 1 draw in 20; calibration is the repeated-experiment test's job)."""
    row = row_of(build_report(synthetic(np.random.default_rng(4), prompts=60, gain=0.0)))
    assert row.gain.lo < 0 < row.gain.hi
    assert row.analytic_gain.lo < 0 < row.analytic_gain.hi


@pytest.mark.parametrize("gain", [0.10, 0.0])
def test_bootstrap_coverage_over_repeated_experiments(gain):
    """Over 40 independent synthetic experiments (30 prompts, per-prompt gains gain +- 25 %), the 95 % CI covers
    the true gain at least 34 times.

    Power: at a true 95 % coverage this fails with probability 0.003; a step bootstrap (about 70 % coverage
    on this data) passes with probability 0.04. With these seeds the report covers 37/40 (measured) and
    36/40 (analytic) for both gains, and the same records split into one-step "prompts" (a step bootstrap)
    cover only 29/40 and 27/40.
    """
    rng = np.random.default_rng(5)
    config = ReportConfig(n_boot=400)
    covered = analytic_covered = 0
    for _ in range(40):
        records = synthetic(rng, prompts=30, gain=gain, gain_spread=0.25, with_baselines=False)
        row = row_of(build_report(records, config))
        covered += row.gain.lo <= gain <= row.gain.hi
        analytic_covered += row.analytic_gain.lo <= gain <= row.analytic_gain.hi
    assert covered >= 34 and analytic_covered >= 34, (covered, analytic_covered)


def step_bootstrap_gain_ci(records, n_boot=2000, seed=0):
    """The WRONG interval: resample steps of each run independently, ignoring which prompt they came from."""
    rng = np.random.default_rng(seed)
    token = np.array([a for r in records if r.config == "token" for a in r.accepted], float)
    block = np.array([a for r in records if r.config == "block" for a in r.accepted], float)
    t = token[rng.integers(0, len(token), (n_boot, len(token)))].mean(1)
    b = block[rng.integers(0, len(block), (n_boot, len(block)))].mean(1)
    return np.quantile((1 + b) / (1 + t) - 1, [0.025, 0.975])


def test_prompt_bootstrap_is_wider_than_a_step_bootstrap_under_per_prompt_effects():
    """Prompts differ strongly in their gain (10 +- 25 %): steps of one prompt are not independent, and an
    interval that resamples steps is too narrow. The report's interval must be clearly wider."""
    records = synthetic(np.random.default_rng(6), prompts=40, gain=0.10, gain_spread=0.25, with_baselines=False)
    row = row_of(build_report(records))
    step_lo, step_hi = step_bootstrap_gain_ci(records)
    assert (row.gain.hi - row.gain.lo) > 1.5 * (step_hi - step_lo), (row.gain, step_lo, step_hi)


def test_bootstrap_is_seeded_and_leaves_the_global_rng_alone():
    records = synthetic(np.random.default_rng(7), prompts=20)
    np.random.seed(123)
    before = np.random.random()
    np.random.seed(123)
    first, second = build_report(records), build_report(records)
    assert np.random.random() == before  # no global draws
    assert row_of(first).gain == row_of(second).gain
    assert row_of(build_report(records, ReportConfig(seed=1))).gain != row_of(first).gain


def test_speed_columns_and_baselines():
    row = row_of(build_report(synthetic(np.random.default_rng(8), prompts=10), ReportConfig(n_boot=100)), "synth")
    records = synthetic(np.random.default_rng(8), prompts=10)
    rate = lambda config: (sum(r.new_tokens for r in records if r.config == config)  # noqa: E731
                           / sum(r.wall_time for r in records if r.config == config))
    assert row.tokens_per_s_block == pytest.approx(rate("block"))
    assert row.speedup_block_vs_target == pytest.approx(rate("block") / rate("target-only"))
    assert row.speedup_token_vs_hf == pytest.approx(rate("token") / rate("hf-assisted"))
    assert row.speedup_block_vs_token.value == pytest.approx(rate("block") / rate("token"))
    assert row.speedup_block_vs_token.lo <= row.speedup_block_vs_token.value <= row.speedup_block_vs_token.hi


def test_table_has_every_dataset_row_and_column():
    rng = np.random.default_rng(9)
    records = (synthetic(rng, prompts=8, dataset="gsm8k") + synthetic(rng, prompts=8, dataset="humaneval")
               + synthetic(rng, prompts=8, dataset="gsm8k", draft_len=4, with_baselines=False)
               + synthetic(rng, prompts=8, dataset="gsm8k", temperature=0.5, with_baselines=False))
    report = build_report(records, ReportConfig(n_boot=100))
    table = format_table(report)
    assert "1 + mean accepted" in table and "pooled over all steps" in table and "resamples prompts" in table
    for title in ("## dataset: gsm8k", "## dataset: humaneval", "## summary: all datasets pooled"):
        assert title in table
    assert all(column in table for column in HEADER)
    gsm8k = table.split("## dataset: gsm8k")[1].split("## dataset: humaneval")[0]
    spec_rows = [line for line in gsm8k.splitlines() if "token vs block" in line]
    assert len(spec_rows) == 3  # (T=1, K=8), (T=1, K=4), (T=0.5, K=8)
    assert sum("| target-only " in line for line in gsm8k.splitlines()) == 1
    assert sum("| hf-assisted " in line for line in gsm8k.splitlines()) == 1
    assert {(r.temperature, r.draft_len) for r in report.rows_of(ALL)} == {(1.0, 8), (1.0, 4), (0.5, 8)}
    assert row_of(report, "humaneval").prompts == 8
    assert [r.prompts for r in report.rows_of(ALL) if (r.temperature, r.draft_len) == (1.0, 8)] == [16]


def test_summary_json_keys():
    report = build_report(synthetic(np.random.default_rng(10), prompts=8), ReportConfig(n_boot=100))
    data = json.loads(json.dumps(summary(report)))
    assert {"convention", "confidence", "n_boot", "seed", "records", "datasets", "summary", "baselines",
            "fastest"} <= data.keys()
    row = data["summary"][0]
    assert {"be_token", "be_block", "gain", "analytic_gain", "speedup_block_vs_token",
            "speedup_block_vs_target", "speedup_block_vs_hf"} <= row.keys()
    assert {"value", "lo", "hi"} == row["gain"].keys()
    rates = {"target-only": 1 / 0.03, "hf-assisted": 1 / 0.02, "token": row["tokens_per_s_token"],
             "block": row["tokens_per_s_block"]}
    fastest = max(rates, key=rates.get)
    assert data["fastest"] == [dict(temperature=1.0, batch_size=1, config=fastest,
                                    draft_len=0 if fastest.endswith("-only") or fastest.startswith("hf") else K,
                                    tokens_per_s=pytest.approx(rates[fastest]))]


def test_missing_configs_do_not_crash_and_show_dashes():
    records = [r for r in synthetic(np.random.default_rng(11), prompts=6) if r.config in ("token", "block")]
    report = build_report(records, ReportConfig(n_boot=100))
    row = row_of(report)
    assert row.speedup_block_vs_hf is None and row.speedup_block_vs_target is None
    line = [line for line in format_table(report).splitlines() if "token vs block" in line][0]
    assert "| - " in line
    # only block, no token: the row exists with no pairs; only baselines: no spec rows at all
    only_block = build_report([r for r in records if r.config == "block"], ReportConfig(n_boot=100))
    assert row_of(only_block).prompts == 0 and row_of(only_block).gain is None
    format_table(only_block), summary(only_block)
    baselines = [r for r in synthetic(np.random.default_rng(12), prompts=3) if r.config == "target-only"]
    assert build_report(baselines).rows == () and "target-only" in format_table(build_report(baselines))
    assert build_report([]).rows == ()
    # an interrupted run: one prompt ran token but not block, and hf-assisted records carry no steps
    partial = build_report(records[:-1], ReportConfig(n_boot=100))
    assert row_of(partial).prompts == 5


def test_render_writes_tables_and_png_plots(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(13)
    records = synthetic(rng, prompts=6, dataset="a") + synthetic(rng, prompts=6, dataset="b", draft_len=4)
    paths = render(build_report(records, ReportConfig(n_boot=100)), tmp_path / "out")
    names = {p.name for p in paths}
    assert {"report.md", "summary.json", "block_efficiency_vs_k.png", "speedup_vs_k.png", "accepted_hist.png"} == names
    for path in paths:
        assert path.stat().st_size > 0
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_prints_the_table_and_ends_with_one_json_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "records.jsonl"
    for record in synthetic(np.random.default_rng(14), prompts=5):
        records_io.append(path, record)
    with path.open("a") as out:
        out.write('{"truncated": ')  # an interrupted runner's last line is skipped
    assert main(["--records", str(path), "--out", str(tmp_path / "out"), "--n-boot", "100"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("token vs block" in line for line in lines)
    assert json.loads(lines[-1])["n_boot"] == 100
    assert (tmp_path / "out" / "speedup_vs_k.png").exists()
    assert main(["--records", str(tmp_path / "missing.jsonl")]) == 2


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "blockspec.bench.report", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--records" in out.stdout and "--out" in out.stdout


def test_no_interval_while_a_dataset_has_a_single_prompt():
    """Regression: with one prompt per dataset the dataset-stratified bootstrap resampled each prompt to itself
    and gave a zero-width interval, which stopped the first paper run after one round."""
    rng = np.random.default_rng(3)
    records = synthetic(rng, prompts=1, dataset="a") + synthetic(rng, prompts=1, dataset="b")
    row = row_of(build_report(records))
    assert row.analytic_gain.lo is None and row.gain.lo is None
    two_each = synthetic(rng, prompts=2, dataset="a") + synthetic(rng, prompts=2, dataset="b")
    assert row_of(build_report(two_each)).analytic_gain.lo is not None
