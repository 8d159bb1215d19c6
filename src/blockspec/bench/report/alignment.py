"""The alignment report: how the block-vs-token gain depends on draft quality, from the runs at a draft temperature
of their own (``Record.draft_temperature``; the "align" preset of the runner, ``blockspec align``).

Per draft temperature T_d: the mean draft-target overlap (sum_v min(q_i(v), p_i(v)) over verified positions) and
the paired analytic gain (1 + mean E_block) / (1 + mean E_token) - 1, with intervals over prompts. Only analytic
values are used (no wall clock), so one block run per cell serves both rules. Glossary: docs/guide/bench.md.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .. import records as records_io
from ..records import Record
from .markdown import interval, markdown_table, num, percent
from .plots import new_figure
from .stats import Estimate, ReportConfig, bootstrap
from .units import ALL

log = logging.getLogger(__name__)

CONVENTION = (
    "Per draft temperature T_d (target at T, K drafted tokens per step, block verification): overlap = mean over "
    "verified positions of sum_v min(draft, target) ({conf:.0f}% CI); analytic BE = 1 + mean per-step exact "
    "E[accepted | draft] under each rule, pooled over all steps, the same drafts for both rules; gain = analytic "
    "BE block / analytic BE token - 1, with a {conf:.0f}% percentile bootstrap CI resampling prompts (stratified "
    "by dataset; none until every dataset has 2 prompts), {n_boot} resamples, seed {seed}; measured BE block = 1 + "
    "mean accepted of the block runs"
)


@dataclass(frozen=True)
class AlignRow:
    """One (dataset or ALL, T, K, T_d) cell of the report."""

    dataset: str
    temperature: float
    max_draft: int
    draft_temperature: float
    prompts: int
    steps: int
    overlap: Estimate | None  # None when no position was verified
    analytic_be_token: float | None
    analytic_be_block: float | None
    gain: Estimate | None  # the paired analytic gain
    be_block: float | None  # measured: 1 + mean accepted of the block runs


@dataclass(frozen=True)
class AlignReport:
    datasets: tuple[str, ...]
    rows: tuple[AlignRow, ...]  # per (T, K): every dataset, then ALL; T_d ascending within each
    n_records: int
    config: ReportConfig

    def rows_of(self, dataset: str) -> list[AlignRow]:
        return [row for row in self.rows if row.dataset == dataset]


def _unit_columns(units: list[list[Record]]) -> dict[str, np.ndarray]:
    """Per-prompt sums [P] over each prompt's records: the bootstrap's columns."""

    def column(value) -> np.ndarray:
        return np.array([sum(value(r) for r in records) for records in units], float)

    def block(value):
        return lambda r: value(r) if r.config == "block" else 0

    return {
        "exp_t": column(lambda r: sum(r.expected_token)),
        "exp_b": column(lambda r: sum(r.expected_block)),
        "steps": column(lambda r: len(r.expected_token)),
        "accepted": column(block(lambda r: sum(r.accepted))),
        "block_steps": column(block(lambda r: len(r.accepted))),
        # overlap weighted by the verified length of its step: a mean over verified positions
        "overlap": column(lambda r: sum(o * k for o, k in zip(r.overlap, r.verified) if o is not None)),
        "verified": column(lambda r: sum(k for o, k in zip(r.overlap, r.verified) if o is not None)),
    }


def _row(
    label: str,
    records: list[Record],
    temperature: float,
    max_draft: int,
    draft_temperature: float,
    config: ReportConfig,
) -> AlignRow:
    if any(len(r.expected_token) != len(r.expected_block) for r in records):
        raise ValueError(f"{label} T_d={draft_temperature:g}: expected_token and expected_block differ in length")
    by_unit: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for record in records:
        by_unit[(record.dataset, record.prompt_id)].append(record)
    units = sorted(by_unit)
    columns = _unit_columns([by_unit[u] for u in units])
    strata = np.array([dataset for dataset, _ in units])
    steps, verified, block_steps = (columns[name].sum() for name in ("steps", "verified", "block_steps"))
    return AlignRow(
        dataset=label,
        temperature=temperature,
        max_draft=max_draft,
        draft_temperature=draft_temperature,
        prompts=len(units),
        steps=int(steps),
        overlap=bootstrap(lambda s: s["overlap"] / s["verified"], columns, strata, config) if verified else None,
        analytic_be_token=1 + columns["exp_t"].sum() / steps if steps else None,
        analytic_be_block=1 + columns["exp_b"].sum() / steps if steps else None,
        gain=bootstrap(lambda s: (s["steps"] + s["exp_b"]) / (s["steps"] + s["exp_t"]) - 1, columns, strata, config)
        if steps
        else None,
        be_block=1 + columns["accepted"].sum() / block_steps if block_steps else None,
    )


def build_report(records: list[Record], config: ReportConfig = ReportConfig()) -> AlignReport | None:
    """Rows per (T, K): every dataset, then all datasets pooled (``ALL``), each at every draft temperature, from
    the successful fixed-K runs at a draft temperature of their own; None when there are none."""
    unique: dict[tuple, Record] = {}
    for record in records:
        if record.draft_temperature is None or not record.ok or record.config not in records_io.FIXED_CONFIGS:
            continue
        if record.key in unique:
            log.warning("duplicate record %s: keeping the first", record.key)
            continue
        unique[record.key] = record
    if not unique:
        return None
    found = list(unique.values())
    datasets = tuple(sorted({r.dataset for r in found}))
    rows = []
    for temperature, max_draft in sorted({(r.temperature, r.max_draft) for r in found}):
        here = [r for r in found if (r.temperature, r.max_draft) == (temperature, max_draft)]
        for label in (*datasets, ALL):
            group = [r for r in here if label in (ALL, r.dataset)]
            for draft_temperature in sorted({r.draft_temperature for r in group if r.draft_temperature is not None}):
                cell = [r for r in group if r.draft_temperature == draft_temperature]
                rows.append(_row(label, cell, temperature, max_draft, draft_temperature, config))
    return AlignReport(datasets, tuple(rows), len(found), config)


HEADER = (
    "T",
    "K",
    "T_d",
    "prompts",
    "steps",
    "overlap (CI)",
    "analytic BE token",
    "analytic BE block",
    "gain block vs token (CI)",
    "measured BE block",
)


def _cells(row: AlignRow) -> list[str]:
    return [
        f"{row.temperature:g}",
        str(row.max_draft),
        f"{row.draft_temperature:g}",
        str(row.prompts),
        str(row.steps),
        interval(row.overlap),
        num(row.analytic_be_token),
        num(row.analytic_be_block),
        percent(row.gain),
        num(row.be_block),
    ]


def format_table(report: AlignReport) -> str:
    """Markdown: the convention, the table pooled over datasets, then one table per dataset."""
    cfg = report.config
    parts = [
        "# alignment sweep: block-vs-token gain vs draft-target overlap",
        CONVENTION.format(conf=100 * cfg.confidence, n_boot=cfg.n_boot, seed=cfg.seed) + ".",
    ]
    for label in (ALL, *report.datasets):
        body = [_cells(row) for row in report.rows_of(label)]
        if body:
            title = "all datasets pooled" if label == ALL else f"dataset: {label}"
            parts.append(f"## {title}\n\n{markdown_table(HEADER, body)}")
    return "\n\n".join(parts)


def summary(report: AlignReport) -> dict:
    """The JSON summary (under "alignment" in the benchmark report's): the rows pooled over datasets."""
    cfg = report.config
    return {
        "convention": CONVENTION.format(conf=100 * cfg.confidence, n_boot=cfg.n_boot, seed=cfg.seed),
        "records": report.n_records,
        "datasets": list(report.datasets),
        "pooled": [asdict(row) for row in report.rows_of(ALL)],
    }


def plot(report: AlignReport, path: Path) -> Path:
    """Gain (with its CI) vs mean overlap, one point per draft temperature (labelled T_d on the pooled
    series), one series per dataset and the pooled one in black; one panel per (T, K)."""
    panels = sorted({(row.temperature, row.max_draft) for row in report.rows})
    figure, axes = new_figure(len(panels), "paired analytic block-vs-token gain vs draft-target overlap")
    for ax, (temperature, max_draft) in zip(axes, panels):
        ax.axhline(0.0, color="grey", lw=0.8)
        for index, label in enumerate((*report.datasets, ALL)):
            points = [
                (r, r.overlap, r.gain)
                for r in report.rows_of(label)
                if (r.temperature, r.max_draft) == (temperature, max_draft)
                and r.gain is not None
                and r.overlap is not None
            ]
            if not points:
                continue
            pooled = label == ALL
            rows = [r for r, _, _ in points]
            xs, ys = [overlap.value for _, overlap, _ in points], [100 * gain.value for _, _, gain in points]
            ax.errorbar(
                xs,
                ys,
                xerr=_errors(overlap for _, overlap, _ in points),
                yerr=_errors((gain for _, _, gain in points), 100),
                fmt="s-" if pooled else "o--",
                color="black" if pooled else f"C{index}",
                capsize=3,
                lw=2 if pooled else 1,
                alpha=1 if pooled else 0.7,
                label="pooled" if pooled else label,
            )
            if pooled:
                for n, (row, x, y) in enumerate(zip(rows, xs, ys)):  # labels alternate above / below
                    ax.annotate(
                        f"T_d={row.draft_temperature:g}",
                        (x, y),
                        textcoords="offset points",
                        xytext=(5, 5 if n % 2 == 0 else -13),
                        fontsize=8,
                    )
        ax.set(
            title=f"T={temperature:g}, K={max_draft} (bars: bootstrap CI over prompts)",
            xlabel="mean overlap sum_v min(draft, target) per verified position",
            ylabel="block vs token gain, analytic (%)",
        )
        ax.legend(fontsize=7)
    figure.savefig(path, dpi=110)
    return path


def _errors(estimates, scale: float = 1.0) -> list[list[float]]:
    """Asymmetric error bars [[below...], [above...]] (0 where there is no interval)."""
    below, above = [], []
    for e in estimates:
        below.append(0.0 if e.lo is None else scale * (e.value - e.lo))
        above.append(0.0 if e.hi is None else scale * (e.hi - e.value))
    return [below, above]
