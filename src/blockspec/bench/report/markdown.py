"""Markdown of the benchmark report: the tables with their convention, and the cell formatters the other reports
share (``num``, ``interval``, ``percent``, ``markdown_table``)."""

from __future__ import annotations

from .batch import BATCH_CONVENTION, TREE_CHOICE_CONVENTION, BatchRow
from .paired import BASELINES, CONVENTION, BaselineRow, Row
from .stats import Estimate
from .tables import LeftOut, Report
from .units import ALL, MAX_OTHERS_CORES

DASH = "-"
HEADER = (
    "T",
    "K",
    "B",
    "config",
    "prompts",
    "BE token",
    "BE block",
    "gain (CI)",
    "analytic BE token",
    "analytic BE block",
    "analytic gain (CI)",
    "tok/s token / block",
    "x target-only token / block",
    "x hf-assisted token / block",
    "block / token wall (CI)",
)


def num(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return DASH if value is None else f"{value:{spec}}{suffix}"


def _pair(a: float | None, b: float | None, spec: str, suffix: str = "") -> str:
    return DASH if a is None and b is None else f"{num(a, spec, suffix)} / {num(b, spec, suffix)}"


def interval(estimate: Estimate | None, spec: str = ".3f", suffix: str = "", scale: float = 1.0) -> str:
    """``value<suffix> [lo, hi]`` (the interval only when there is one), every number scaled and formatted alike."""
    if estimate is None:
        return DASH
    text = f"{scale * estimate.value:{spec}}{suffix}"
    if estimate.lo is None or estimate.hi is None:
        return text
    return f"{text} [{scale * estimate.lo:{spec}}, {scale * estimate.hi:{spec}}]"


def percent(estimate: Estimate | None) -> str:
    return interval(estimate, "+.1f", "%", 100.0)


def _times(estimate: Estimate | None) -> str:
    return interval(estimate, ".3f", "x")


def _spec_cells(row: Row) -> list[str]:
    return [
        f"{row.temperature:g}",
        str(row.max_draft),
        str(row.batch_size),
        "token vs block",
        str(row.prompts),
        num(row.be_token),
        num(row.be_block),
        percent(row.gain),
        num(row.analytic_be_token),
        num(row.analytic_be_block),
        percent(row.analytic_gain),
        _pair(row.tokens_per_s_token, row.tokens_per_s_block, ".2f"),
        _pair(row.speedup_token_vs_target, row.speedup_block_vs_target, ".3f", "x"),
        _pair(row.speedup_token_vs_hf, row.speedup_block_vs_hf, ".3f", "x"),
        _times(row.speedup_block_vs_token),
    ]


def _baseline_cells(row: BaselineRow) -> list[str]:
    return [
        f"{row.temperature:g}",
        str(row.max_draft),
        str(row.batch_size),
        row.config,
        str(row.prompts),
        *[DASH] * 6,
        num(row.tokens_per_s, ".2f"),
        "1.000x" if row.config == "target-only" else num(row.speedup_vs_target, ".3f", "x"),
        DASH,
        DASH,
    ]


def markdown_table(header: tuple[str, ...], body: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *body)]
    line = lambda cells: "| " + " | ".join(cell.ljust(w) for cell, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


BATCH_HEADER = (
    "T",
    "B",
    "config",
    "K",
    "batches",
    "tok/s (CI)",
    "x target-only (CI)",
    "x best fixed K (CI)",
    "x transformers (CI)",
    "rejected / verified (CI)",
    "verified / emitted (CI)",
    "drafted / emitted",
    "BE",
)


def _batch_cells(row: BatchRow) -> list[str]:
    return [
        f"{row.temperature:g}",
        str(row.batch_size),
        row.config + (" *" if row.best_fixed else ""),
        str(row.max_draft),
        str(row.batches),
        interval(row.tokens_per_s, ".2f"),
        "1.000x" if row.config == "target-only" else _times(row.speedup_vs_target),
        "1.000x" if row.best_fixed else _times(row.speedup_vs_best_fixed),
        _times(row.speedup_vs_hf),
        percent(row.rejected).replace("+", ""),
        interval(row.verified_per_emitted),
        num(row.drafted_per_emitted),
        num(row.block_efficiency),
    ]


def format_batch_table(report: Report) -> str:
    """The batch table (markdown, with its convention), or "" when ``build_report`` made none."""
    if not report.batch:
        return ""
    cfg = report.config
    caption = BATCH_CONVENTION.format(conf=100 * cfg.confidence, n_boot=cfg.n_boot, seed=cfg.seed)
    body = [_batch_cells(row) for row in report.batch]
    return (
        f"## batch sizes and Speculative Verification: all datasets pooled\n\n{caption}.\n\n"
        f"{markdown_table(BATCH_HEADER, body)}"
    )


def format_tree_choice(report: Report) -> str:
    """The tree-or-chain choice against the chain alone (markdown, with its convention), or "" without both."""
    rows = [row for row in report.batch if row.speedup_vs_auto is not None]
    if not rows:
        return ""
    cfg = report.config
    caption = TREE_CHOICE_CONVENTION.format(conf=100 * cfg.confidence, n_boot=cfg.n_boot, seed=cfg.seed)
    body = [
        [f"{r.temperature:g}", str(r.batch_size), str(r.max_draft), str(r.batches), _times(r.speedup_vs_auto)]
        for r in rows
    ]
    table = markdown_table(("T", "B", "K", "batches", "auto-tree x auto (CI)"), body)
    return f"## the tree or the chain, chosen each step: auto-tree against auto\n\n{caption}.\n\n{table}"


def _run_name(run: dict) -> str:
    draft = f" T_d={run['draft_temperature']:g}" if "draft_temperature" in run else ""
    return (
        f"{run['prompt_id']} {run['config']} K={run['max_draft']} T={run['temperature']:g}{draft} B={run['batch_size']}"
    )


def format_left_out(left_out: LeftOut) -> str:
    """The report's section on the runs its figures leave out, or "" when there are none."""
    lines = []
    if left_out.failed:
        lines.append(
            f"- failed runs ({len(left_out.failed)}), in no figure (a resume reruns them only when asked "
            "to retry failed runs):"
        )
        lines += [f"    - {_run_name(run)}: {run['error']}" for run in left_out.failed]
        lines += [
            f"- {run['config']} failed on {run['prompt_id']} (T={run['temperature']:g}, B={run['batch_size']}): "
            f"the speedups over {run['config']} leave that prompt out"
            for run in left_out.failed
            if run["config"] in BASELINES
        ]
    if left_out.contended:
        lines.append(
            f"- {len(left_out.contended)} runs measured while other processes used more than "
            f"{MAX_OTHERS_CORES} CPU-seconds per wall second: left out of tok/s and speedups, kept in the "
            "block efficiencies:"
        )
        lines += [f"    - {_run_name(run)}: others used {run['others_cores']:.2f}" for run in left_out.contended]
    return "## runs left out\n\n" + "\n".join(lines) if lines else ""


def format_table(report: Report) -> str:
    """Markdown tables: one per dataset, then the summary pooled over datasets; the convention and the machine on
    top, then the runs left out, if any."""
    cfg = report.config
    parts = [CONVENTION.format(conf=100 * cfg.confidence, n_boot=cfg.n_boot, seed=cfg.seed) + "."]
    if report.machine:
        flags = " ".join(report.machine["cpu_flags"]) or "none of AVX2, AVX-512, AMX"
        parts.append(f"Machine: CPU flags {flags}; {report.machine['threads']} threads.")
    left_out = format_left_out(report.left_out)
    if left_out:
        parts.append(left_out)
    for label in (*report.datasets, ALL):
        body = [_baseline_cells(b) for b in report.baselines if b.dataset == label]
        body += [_spec_cells(r) for r in report.rows_of(label)]
        if not body:
            continue
        title = "summary: all datasets pooled" if label == ALL else f"dataset: {label}"
        parts.append(f"## {title}\n\n{markdown_table(HEADER, body)}")
    if report.batch:
        parts.append(format_batch_table(report))
    tree_choice = format_tree_choice(report)
    if tree_choice:
        parts.append(tree_choice)
    return "\n\n".join(parts)
