"""The benchmark report on synthetic records: exact arithmetic, bootstrap coverage over PROMPTS, table, JSON, plots.

Synthetic model of a run: prompt p has a difficulty (its mean accepted length under token verification,
mu_p) and its own block gain g_p; a step accepts Binomial(K, mean / K) tokens, so the pooled block
efficiency of block is (1 + gain) times that of token in expectation when the g_p average to ``gain``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from blockspec.bench import records as records_io
from blockspec.bench.records import Record
from blockspec.bench.report import (
    ALL,
    HEADER,
    ReportConfig,
    build_report,
    format_table,
    main,
    render,
    summary,
)
from blockspec.bench.report.stats import Estimate

K = 8
STEPS = 20  # per prompt: equal step counts make the pooled BE ratio's expectation exactly 1 + gain


def synthetic(
    rng: np.random.Generator,
    prompts: int = 40,
    gain: float = 0.10,
    gain_spread: float = 0.0,
    dataset: str = "synth",
    temperature: float = 1.0,
    max_draft: int = K,
    with_baselines: bool = True,
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
        common: dict[str, Any] = dict(
            dataset=dataset,
            prompt_id=prompt_id,
            max_draft=max_draft,
            temperature=temperature,
            batch_size=1,
            seed=p,
            prefill_time=0.01,
        )
        for config, mu in (("token", mu_token), ("block", mu_block)):
            accepted = rng.binomial(max_draft, mu / max_draft, size=STEPS).tolist()
            new_tokens = sum(accepted) + STEPS
            out.append(
                Record(
                    config=config,
                    new_tokens=new_tokens,
                    wall_time=STEPS * 0.05 * (1.02 if config == "block" else 1.0),
                    accepted=accepted,
                    verified=[max_draft] * STEPS,
                    expected_token=(mu_token + rng.normal(0, 0.2, STEPS)).tolist(),
                    expected_block=(mu_block + rng.normal(0, 0.2, STEPS)).tolist(),
                    **common,
                )
            )
        if with_baselines:
            base: dict[str, Any] = dict(common, max_draft=0)
            out.append(Record(config="target-only", new_tokens=64, wall_time=64 * 0.03, **base))
            out.append(Record(config="hf-assisted", new_tokens=64, wall_time=64 * 0.02, **base))
    return out


def value(estimate: Estimate | None) -> float:
    assert estimate is not None
    return estimate.value


def interval(estimate: Estimate | None) -> tuple[float, float]:
    """(lo, hi) of an estimate that must have an interval."""
    assert estimate is not None and estimate.lo is not None and estimate.hi is not None, estimate
    return estimate.lo, estimate.hi


def width(estimate: Estimate | None) -> float:
    lo, hi = interval(estimate)
    return hi - lo


def decode_time(record: Record) -> float:
    assert record.prefill_time is not None
    return record.wall_time - record.prefill_time


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
    assert value(row.gain) == pytest.approx((1 + np.mean(block)) / (1 + np.mean(token)) - 1, abs=1e-12)
    assert (row.prompts, row.steps_token, row.steps_block) == (6, 6 * STEPS, 6 * STEPS)


def test_paired_analytic_gain_equals_the_mean_of_the_per_step_expected_values():
    """Exact arithmetic: 1 + mean over the steps of BOTH runs, for each rule; gain = ratio - 1.

    Uneven step counts per record, so a mean of per-prompt means (a plausible mistake) would differ.
    """
    rng = np.random.default_rng(2)
    records = []
    for record in synthetic(rng, prompts=5, with_baselines=False):
        n = int(rng.integers(1, 30))
        records.append(
            replace(record, expected_token=rng.uniform(0, 3, n).tolist(), expected_block=rng.uniform(0, 4, n).tolist())
        )
    row = row_of(build_report(records, ReportConfig(n_boot=100)), "synth")
    all_token = [e for r in records for e in r.expected_token]
    all_block = [e for r in records for e in r.expected_block]
    assert row.analytic_be_token == pytest.approx(1 + np.mean(all_token), rel=1e-12)
    assert row.analytic_be_block == pytest.approx(1 + np.mean(all_block), rel=1e-12)
    assert value(row.analytic_gain) == pytest.approx((1 + np.mean(all_block)) / (1 + np.mean(all_token)) - 1, rel=1e-12)
    per_prompt_means = np.mean([np.mean(r.expected_token) for r in records])
    assert row.analytic_be_token is not None
    assert abs(row.analytic_be_token - (1 + per_prompt_means)) > 1e-6  # the test can tell the two apart


def test_bootstrap_ci_covers_a_known_ten_percent_gain_and_excludes_zero():
    """Every prompt's block BE is 10 % above its token BE in expectation; accepted lengths and expected
    values are noisy. One fixed-seed draw: calibration over many draws is the repeated-experiment test's job."""
    report = build_report(synthetic(np.random.default_rng(4), prompts=60, gain=0.10))
    row = row_of(report)
    for estimate in (row.gain, row.analytic_gain):
        lo, hi = interval(estimate)
        assert lo < 0.10 < hi, estimate
        assert lo > 0, estimate
    # the analytic gain shares its drafts between rules: its interval is the narrower one
    assert width(row.analytic_gain) < width(row.gain)


def test_bootstrap_ci_covers_zero_when_there_is_no_gain():
    """One fixed-seed draw (a 95 % CI misses 1 draw in 20; calibration is the repeated-experiment test's job)."""
    row = row_of(build_report(synthetic(np.random.default_rng(4), prompts=60, gain=0.0)))
    assert interval(row.gain)[0] < 0 < interval(row.gain)[1]
    assert interval(row.analytic_gain)[0] < 0 < interval(row.analytic_gain)[1]


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
        lo, hi = interval(row.gain)
        covered += lo <= gain <= hi
        lo, hi = interval(row.analytic_gain)
        analytic_covered += lo <= gain <= hi
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
    assert width(row.gain) > 1.5 * (step_hi - step_lo), (row.gain, step_lo, step_hi)


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

    def rate(config):
        return sum(r.new_tokens for r in records if r.config == config) / sum(
            r.wall_time for r in records if r.config == config
        )

    assert row.tokens_per_s_block == pytest.approx(rate("block"))
    assert row.speedup_block_vs_target == pytest.approx(rate("block") / rate("target-only"))
    assert row.speedup_token_vs_hf == pytest.approx(rate("token") / rate("hf-assisted"))
    assert value(row.speedup_block_vs_token) == pytest.approx(rate("block") / rate("token"))
    lo, hi = interval(row.speedup_block_vs_token)
    assert lo <= value(row.speedup_block_vs_token) <= hi


def test_table_has_every_dataset_row_and_column():
    rng = np.random.default_rng(9)
    records = (
        synthetic(rng, prompts=8, dataset="gsm8k")
        + synthetic(rng, prompts=8, dataset="humaneval")
        + synthetic(rng, prompts=8, dataset="gsm8k", max_draft=4, with_baselines=False)
        + synthetic(rng, prompts=8, dataset="gsm8k", temperature=0.5, with_baselines=False)
    )
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
    assert {(r.temperature, r.max_draft) for r in report.rows_of(ALL)} == {(1.0, 8), (1.0, 4), (0.5, 8)}
    assert row_of(report, "humaneval").prompts == 8
    assert [r.prompts for r in report.rows_of(ALL) if (r.temperature, r.max_draft) == (1.0, 8)] == [16]


def test_summary_json_keys():
    report = build_report(synthetic(np.random.default_rng(10), prompts=8), ReportConfig(n_boot=100))
    data = json.loads(json.dumps(summary(report)))
    assert {
        "convention",
        "confidence",
        "n_boot",
        "seed",
        "records",
        "datasets",
        "summary",
        "baselines",
        "fastest",
    } <= data.keys()
    row = data["summary"][0]
    assert {
        "be_token",
        "be_block",
        "gain",
        "analytic_gain",
        "speedup_block_vs_token",
        "speedup_block_vs_target",
        "speedup_block_vs_hf",
    } <= row.keys()
    assert {"value", "lo", "hi"} == row["gain"].keys()
    rates = {
        "target-only": 1 / 0.03,
        "hf-assisted": 1 / 0.02,
        "token": row["tokens_per_s_token"],
        "block": row["tokens_per_s_block"],
    }
    fastest = max(rates, key=lambda name: rates[name])
    assert data["fastest"] == [
        dict(
            temperature=1.0,
            batch_size=1,
            config=fastest,
            max_draft=0 if fastest.endswith("-only") or fastest.startswith("hf") else K,
            tokens_per_s=pytest.approx(rates[fastest]),
        )
    ]


def test_missing_configs_do_not_crash_and_show_dashes():
    records = [r for r in synthetic(np.random.default_rng(11), prompts=6) if r.config in ("token", "block")]
    report = build_report(records, ReportConfig(n_boot=100))
    row = row_of(report)
    assert row.speedup_block_vs_hf is None and row.speedup_block_vs_target is None
    line = [line for line in format_table(report).splitlines() if "token vs block" in line][0]
    assert "| - " in line
    # only block, no token: no token-vs-block row (block goes to the batch table); only baselines: no rows
    only_block = build_report([r for r in records if r.config == "block"], ReportConfig(n_boot=100))
    assert only_block.rows == () and [r.config for r in only_block.batch] == ["block"]
    assert [(r.config, r.max_draft) for r in only_block.baselines] == [("block", K)] * 2  # "synth" and pooled
    assert summary(only_block)["fastest"][0]["config"] == "block"
    only_token = build_report([r for r in records if r.config == "token"], ReportConfig(n_boot=100))
    assert only_token.rows == () and [(r.config, r.max_draft) for r in only_token.baselines] == [("token", K)] * 2
    format_table(only_block)  # neither raises
    summary(only_block)
    baselines = [r for r in synthetic(np.random.default_rng(12), prompts=3) if r.config == "target-only"]
    assert build_report(baselines).rows == () and "target-only" in format_table(build_report(baselines))
    assert build_report([]).rows == ()
    # an interrupted run: one prompt ran token but not block, and hf-assisted records carry no steps
    partial = build_report(records[:-1], ReportConfig(n_boot=100))
    assert row_of(partial).prompts == 5


def test_render_writes_tables_and_png_plots(tmp_path):
    pytest.importorskip("matplotlib")
    rng = np.random.default_rng(13)
    records = synthetic(rng, prompts=6, dataset="a") + synthetic(rng, prompts=6, dataset="b", max_draft=4)
    paths = render(build_report(records, ReportConfig(n_boot=100)), tmp_path / "out")
    names = {p.name for p in paths}
    assert {"report.md", "summary.json", "block_efficiency_vs_k.png", "speedup_vs_k.png", "accepted_hist.png"} == names
    for path in paths:
        assert path.stat().st_size > 0
        if path.suffix == ".png":
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_panel_with_nothing_plotted_gets_no_legend_and_no_warning():
    pytest.importorskip("matplotlib")
    from blockspec.bench.report.plots import _legend, new_figure

    _, (empty, full) = new_figure(2, "two panels")
    full.plot([1, 2], [1, 2], label="a line")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns on a legend with no labelled artist
        _legend(empty, 7)
        _legend(full, 7)
    assert empty.get_legend() is None and full.get_legend() is not None


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
    out = subprocess.run(
        [sys.executable, "-m", "blockspec.bench.report", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--records" in out.stdout and "--out" in out.stdout


def test_no_interval_while_a_dataset_has_a_single_prompt():
    """Regression: with one prompt per dataset the dataset-stratified bootstrap resampled each prompt to itself
    and gave a zero-width interval, which stopped the first paper run after one round."""
    rng = np.random.default_rng(3)
    records = synthetic(rng, prompts=1, dataset="a") + synthetic(rng, prompts=1, dataset="b")
    row = row_of(build_report(records))
    assert row.analytic_gain is not None and row.gain is not None
    assert row.analytic_gain.lo is None and row.gain.lo is None
    two_each = synthetic(rng, prompts=2, dataset="a") + synthetic(rng, prompts=2, dataset="b")
    interval(row_of(build_report(two_each)).analytic_gain)  # asserts there is one


# --- batch sizes and Speculative Verification --------------------------------------------------------------------


def batch_record(
    config: str,
    max_draft: int,
    dataset: str,
    batch: int,
    *,
    new_tokens: int,
    wall_time: float,
    accepted: list[int],
    verified: list[int],
    drafted: list[int] | None = None,
    batch_size: int = 4,
    prefill_time: float = 0.01,
) -> Record:
    """A batched record whose steps each have every row active (rows = batch_size per step)."""
    steps = len(accepted) // batch_size
    return Record(
        dataset=dataset,
        prompt_id=f"{dataset}/{batch * batch_size:04d}",
        config=config,
        max_draft=max_draft,
        temperature=1.0,
        batch_size=batch_size,
        seed=batch * batch_size,
        new_tokens=new_tokens,
        wall_time=wall_time,
        prefill_time=prefill_time,
        accepted=accepted,
        verified=verified,
        drafted=drafted if drafted is not None else [max(verified)] * steps,
        rows=[batch_size] * steps,
        prompt_ids=[f"{dataset}/{batch * batch_size + b:04d}" for b in range(batch_size)],
    )


def drawn_batch_record(
    rng: np.random.Generator,
    config: str,
    max_draft: int,
    dataset: str,
    batch: int,
    speed: float,
    *,
    lowest: int,
    batch_size: int,
    prefill=lambda decode: 0.01,
    drafted: list[int] | None = None,
) -> Record:
    """``batch_record`` of 8 steps with random counts: each row-step verifies ``lowest``..``max_draft`` drafted
    tokens (none for the target alone) and accepts some of them, decoding at about ``speed`` tok/s after a prefill
    of ``prefill(decode seconds)``."""
    n = 8 * batch_size
    verified = [0] * n if max_draft == 0 else rng.integers(lowest, max_draft + 1, n).tolist()
    accepted = [int(rng.integers(0, v + 1)) for v in verified]
    new_tokens = sum(accepted) + n
    decode = new_tokens / (speed * rng.uniform(0.9, 1.1))
    prefill_time = prefill(decode)
    return batch_record(
        config,
        max_draft,
        dataset,
        batch,
        new_tokens=new_tokens,
        wall_time=decode + prefill_time,
        accepted=accepted,
        verified=verified,
        drafted=drafted,
        prefill_time=prefill_time,
        batch_size=batch_size,
    )


def batch_records(rng: np.random.Generator) -> list[Record]:
    """target-only, token K=2, block K=2 and K=4, 3 i.i.d. paths of 3 tokens (paths-iid-3) and sv-block (K <= 4)
    on 3 batches of 4 prompts of 2 datasets.
    Block K=2 decodes fastest but has the longest prefill: counting prefill would make token K=2 the best."""
    speeds = {
        ("target-only", 0): 10.0,
        ("token", 2): 14.0,
        ("block", 2): 15.0,
        ("block", 4): 13.0,
        ("paths-iid-3", 3): 12.0,
        ("sv-block", 4): 16.0,  # last: a test takes the last record for an sv-block one
    }
    return [
        drawn_batch_record(
            rng,
            config,
            k,
            dataset,
            batch,
            speed,
            lowest=0 if config.startswith("sv") else k,
            batch_size=4,
            prefill=(lambda decode: decode / 2) if (config, k) == ("block", 2) else (lambda decode: 0.01),
            drafted=[k] * 8,
        )
        for dataset in ("a", "b")
        for batch in range(3)
        for (config, k), speed in speeds.items()
    ]


def test_the_tree_or_chain_choice_is_compared_with_the_chain_alone_on_decode_time():
    """auto-tree over auto, paired by batch: the ratio of their decode tok/s (auto's long prefill would flip a ratio
    of whole wall times), in a section of its own that a run without auto does not get."""
    rng = np.random.default_rng(3)
    runs = (("target-only", 0, 4.0, 0.1), ("auto", 8, 10.0, 9.0), ("auto-tree", 8, 9.0, 0.1))  # K, tok/s, prefill
    records = [
        drawn_batch_record(
            rng, config, k, dataset, batch, speed, lowest=1, batch_size=1, prefill=lambda decode, s=prefill: s
        )
        for dataset in ("a", "b")
        for batch in range(3)
        for config, k, speed, prefill in runs
    ]

    def rate(config):
        found = [r for r in records if r.config == config]
        return sum(r.new_tokens for r in found) / sum(decode_time(r) for r in found)

    report = build_report(records, ReportConfig(n_boot=300))
    rows = {r.config: r for r in report.batch}
    ratio = value(rows["auto-tree"].speedup_vs_auto)
    assert ratio == pytest.approx(rate("auto-tree") / rate("auto")) and ratio < 1
    lo, hi = interval(rows["auto-tree"].speedup_vs_auto)
    assert lo < ratio < hi
    assert rows["auto"].speedup_vs_auto is None and rows["target-only"].speedup_vs_auto is None
    table = format_table(report)
    assert "## the tree or the chain, chosen each step: auto-tree against auto" in table
    assert f"| 1 | 1 | 8 | 6       | {ratio:.3f}x [" in table
    alone = build_report([r for r in records if r.config != "auto"], ReportConfig(n_boot=300))
    assert "auto-tree against auto" not in format_table(alone)


def test_batch_table_arithmetic_best_fixed_and_sv_over_it():
    records = batch_records(np.random.default_rng(20))
    report = build_report(records, ReportConfig(n_boot=300))
    assert report.rows == () and report.baselines == ()  # the token-vs-block tables are batch 1 only
    rows = {(r.config, r.max_draft): r for r in report.batch}
    assert set(rows) == {
        ("target-only", 0),
        ("token", 2),
        ("block", 2),
        ("block", 4),
        ("sv-block", 4),
        ("paths-iid-3", 3),
    }

    def of(config, k):
        return [r for r in records if (r.config, r.max_draft) == (config, k)]

    def rate(config, k):
        found = of(config, k)
        return sum(r.new_tokens for r in found) / sum(decode_time(r) for r in found)

    best = max([("token", 2), ("block", 2), ("block", 4)], key=lambda key: rate(*key))
    assert [key for key, r in rows.items() if r.best_fixed] == [best]
    sv = rows[("sv-block", 4)]
    assert sv.batches == 6 and value(sv.tokens_per_s) == pytest.approx(rate("sv-block", 4))
    assert value(sv.speedup_vs_target) == pytest.approx(rate("sv-block", 4) / rate("target-only", 0))
    assert value(sv.speedup_vs_best_fixed) == pytest.approx(rate("sv-block", 4) / rate(*best))
    lo, hi = interval(sv.speedup_vs_best_fixed)
    assert lo < value(sv.speedup_vs_best_fixed) < hi
    accepted = sum(sum(r.accepted) for r in of("sv-block", 4))
    verified = sum(sum(r.verified) for r in of("sv-block", 4))
    new = sum(r.new_tokens for r in of("sv-block", 4))
    assert value(sv.rejected) == pytest.approx(1 - accepted / verified)
    assert value(sv.verified_per_emitted) == pytest.approx(verified / new)
    assert sv.drafted_per_emitted == pytest.approx(6 * 8 * 4 * 4 / new)  # 4 drafted per row, 8 steps of 4 rows
    assert sv.block_efficiency == pytest.approx(1 + accepted / (6 * 32))
    target = rows[("target-only", 0)]
    assert target.rejected is None and value(target.verified_per_emitted) == 0 and target.speedup_vs_target is None
    # a tree or paths row is compared with the best chain too
    assert value(rows[("paths-iid-3", 3)].speedup_vs_best_fixed) == pytest.approx(rate("paths-iid-3", 3) / rate(*best))
    assert all(r.speedup_vs_best_fixed is None for key, r in rows.items() if key[0] not in ("sv-block", "paths-iid-3"))
    table = format_table(report)
    assert "## batch sizes and Speculative Verification" in table and f"| {best[0]} * " in table
    data = json.loads(json.dumps(summary(report)))
    assert data["batch_best_fixed"] == [
        dict(temperature=1.0, batch_size=4, config=best[0], max_draft=best[1], tokens_per_s=pytest.approx(rate(*best)))
    ]


def test_batch_comparisons_use_the_batches_every_configuration_ran():
    records = batch_records(np.random.default_rng(21))
    missing = records[-1]  # the last batch of dataset b, sv-block: an interrupted run
    records = [r for r in records if r is not missing and not (r.key[:2] == missing.key[:2] and r.config == "token")]
    rows = {(r.config, r.max_draft): r for r in build_report(records, ReportConfig(n_boot=100)).batch}
    assert rows[("token", 2)].batches == 5 and rows[("block", 2)].batches == 6 and rows[("sv-block", 4)].batches == 5
    common = {r.key[:2] for r in records if r.config == "sv-block"}
    fixed = [r for r in records if r.config in ("token", "block") and r.key[:2] in common]
    best = max(
        {(r.config, r.max_draft) for r in fixed},
        key=lambda key: (
            sum(r.new_tokens for r in fixed if (r.config, r.max_draft) == key)
            / sum(decode_time(r) for r in fixed if (r.config, r.max_draft) == key)
        ),
    )
    sv = [r for r in records if r.config == "sv-block"]
    chosen = [r for r in fixed if (r.config, r.max_draft) == best]
    expected = (sum(r.new_tokens for r in sv) / sum(decode_time(r) for r in sv)) / (
        sum(r.new_tokens for r in chosen) / sum(decode_time(r) for r in chosen)
    )
    assert value(rows[("sv-block", 4)].speedup_vs_best_fixed) == pytest.approx(expected)


def test_batch_table_only_with_batched_sv_or_unpaired_records_and_no_interval_from_one_batch_per_dataset():
    rng = np.random.default_rng(22)
    assert build_report(synthetic(rng, prompts=4)).batch == ()
    block_only = [r for r in synthetic(rng, prompts=4) if r.config != "token"]  # e.g. greedy, where both coincide
    report = build_report(block_only)
    assert {r.config for r in report.batch} == {"block", "target-only", "hf-assisted"}
    assert report.rows == ()  # no pairs for the token-vs-block table
    one_each = [r for r in batch_records(rng) if r.key[1].endswith("/0000")]
    rows = build_report(one_each).batch
    assert rows and all(r.tokens_per_s is not None and r.tokens_per_s.lo is None for r in rows)  # no interval


def test_hf_assisted_in_the_batch_table_counts_prefill_on_both_sides():
    """transformers does not report its prefill: its row compares whole wall times, target-only's included,
    while the other rows compare decode times."""
    records = []
    for r in synthetic(np.random.default_rng(24), prompts=4):
        if r.config == "token":  # block alone: the batch table is made
            continue
        if r.config == "target-only":  # 1.92 s in all, 0.5 s of it prefill
            r = replace(r, prefill_time=0.5)
        records.append(replace(r, prefill_time=None) if r.config == "hf-assisted" else r)
    rows = {r.config: r for r in build_report(records, ReportConfig(n_boot=100)).batch}
    assert value(rows["hf-assisted"].speedup_vs_target) == pytest.approx((64 / 1.28) / (64 / 1.92))
    assert value(rows["hf-assisted"].tokens_per_s) == pytest.approx(64 / 1.28)
    assert value(rows["target-only"].tokens_per_s) == pytest.approx(64 / 1.42)


def test_records_of_another_schema_are_refused_naming_the_file_and_line(tmp_path, capsys):
    records = synthetic(np.random.default_rng(23), prompts=6)
    path = tmp_path / "old.jsonl"
    for schema in (3, 5):
        lines = [json.dumps({**dataclasses.asdict(r), "schema": s}) for r, s in zip(records[:2], (4, schema))]
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(
            ValueError, match=f"{path}:2: record schema {schema}, but this blockspec reads schema 4 only"
        ):
            list(records_io.read(path))
        assert main(["--records", str(path), "--no-plots"]) == 2
        assert f"record schema {schema}" in capsys.readouterr().err


def test_gzipped_records_read_as_the_plain_file_and_report_the_same(tmp_path, capsys):
    """Kept runs are stored as records.jsonl.gz: the reader and the report CLI take it as they take the plain file."""
    import gzip

    records = synthetic(np.random.default_rng(29), prompts=6)
    plain = tmp_path / "records.jsonl"
    for record in records:
        records_io.append(plain, record)
    packed = tmp_path / "records.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert list(records_io.read(packed)) == list(records_io.read(plain)) == records
    outputs = []
    for path in (plain, packed):
        assert main(["--records", str(path), "--no-plots", "--n-boot", "50"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


def test_a_damaged_gzip_file_is_refused_with_its_name(tmp_path):
    import gzip

    records = synthetic(np.random.default_rng(31), prompts=2)
    whole = gzip.compress("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in records).encode())
    for name, data in (("cut.jsonl.gz", whole[: len(whole) // 2]), ("plain-text.jsonl.gz", b"not gzip")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=f"{name}: not a readable gzip file"):
            list(records_io.read(tmp_path / name))
    with pytest.raises(FileNotFoundError):
        list(records_io.read(tmp_path / "missing.jsonl.gz"))


def test_the_report_lists_failed_runs_and_leaves_out_the_speedups_of_a_prompt_whose_baseline_failed():
    records = synthetic(np.random.default_rng(24), prompts=10)
    target = [r for r in records if r.config == "target-only"]
    records[records.index(target[0])] = replace(
        target[0], new_tokens=0, wall_time=0.0, status=records_io.FAILED, error="RuntimeError: out of memory"
    )
    built = build_report(records, ReportConfig(n_boot=100))
    rest = [r for r in records if r.prompt_id != target[0].prompt_id]

    def rate(config):
        return sum(r.new_tokens for r in rest if r.config == config) / sum(
            r.wall_time for r in rest if r.config == config
        )

    assert row_of(built).speedup_block_vs_target == pytest.approx(rate("block") / rate("target-only"))
    assert row_of(built).prompts == 10  # the failed baseline takes nothing else away
    table = format_table(built)
    assert "failed runs (1)" in table and "RuntimeError: out of memory" in table
    assert f"target-only failed on {target[0].prompt_id} (T=1, B=1): the speedups over target-only leave" in table
    (failed,) = json.loads(json.dumps(summary(built)))["left_out"]["failed"]
    assert failed["prompt_id"] == target[0].prompt_id and failed["error"] == "RuntimeError: out of memory"


def test_a_report_that_lists_failed_runs_exits_1_so_scripts_see_them(tmp_path, capsys):
    """A bench whose every run failed (a float16 overflow, out of memory) must not exit 0 like a complete one."""
    from blockspec.bench import report

    records = synthetic(np.random.default_rng(24), prompts=3)
    path = tmp_path / "records.jsonl"
    for record in records:
        records_io.append(path, record)
    assert report.main(["--records", str(path), "--no-plots"]) == 0
    records_io.append(
        path,
        replace(
            records[0],
            status=records_io.FAILED,
            error="RuntimeError: out of memory",
            prompt_id="extra/0",
            new_tokens=0,
            wall_time=0.0,
        ),
    )
    assert report.main(["--records", str(path), "--no-plots"]) == 1
    assert "1 runs failed (listed in the report with their errors)" in capsys.readouterr().err


def test_runs_measured_under_contention_are_left_out_of_the_speeds_and_counted():
    from blockspec.bench.report import MAX_OTHERS_CORES

    records = synthetic(np.random.default_rng(25), prompts=10)
    quiet = build_report(records, ReportConfig(n_boot=100))
    target = [r for r in records if r.config == "target-only"]
    for n, record in enumerate(target[:6]):  # five read 10x slow with others busy; one sits on the threshold
        others = MAX_OTHERS_CORES if n == 5 else 1.0
        records[records.index(record)] = replace(
            record, wall_time=record.wall_time * (1 if n == 5 else 10), meta={"others_cores": others}
        )
    built = build_report(records, ReportConfig(n_boot=100))
    assert [b.tokens_per_s for b in built.baselines if b.config == "target-only"] == [pytest.approx(64 / 1.92)] * 2
    kept = {r.prompt_id for r in target[5:]}
    block = sum(r.new_tokens for r in records if r.config == "block" and r.prompt_id in kept) / sum(
        r.wall_time for r in records if r.config == "block" and r.prompt_id in kept
    )
    assert row_of(built).speedup_block_vs_target == pytest.approx(block / (64 / 1.92))
    assert row_of(built).be_block == row_of(quiet).be_block  # accepted lengths do not depend on timing
    assert f"5 runs measured while other processes used more than {MAX_OTHERS_CORES} CPU-seconds" in format_table(built)
    left_out = json.loads(json.dumps(summary(built)))["left_out"]
    assert len(left_out["contended"]) == 5 and left_out["max_others_cores"] == MAX_OTHERS_CORES


def test_records_of_different_machine_kinds_or_thread_counts_are_never_pooled():
    records = synthetic(np.random.default_rng(26), prompts=4)
    same = [replace(r, meta={"cpu_flags": ["avx2"], "threads": 2}) for r in records]
    assert summary(build_report(same, ReportConfig(n_boot=10)))["machine"] == {"cpu_flags": ["avx2"], "threads": 2}
    for other in (
        {"cpu_flags": ["avx2", "avx512f"], "threads": 2},
        {"cpu_flags": ["avx2"], "threads": 4},
        {"threads": 2},
    ):
        mixed = same[:-1] + [replace(same[-1], meta=other)]
        with pytest.raises(ValueError, match="records from 2 machine kinds or thread counts"):
            build_report(mixed)
