"""What the report writes and prints: ``render`` (its files) and ``main``, the command line
``python -m blockspec.bench.report --records FILE --out DIR``: the tables, then one JSON line. Runs at a draft
temperature of their own (the alignment sweep) add the alignment report: its table after the others, its plot, and
its summary under "alignment" in the JSON."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .. import records as records_io
from . import alignment
from .markdown import format_table
from .plots import plot_accepted, plot_batch, plot_efficiency, plot_speedup
from .stats import ReportConfig
from .tables import Report, build_report, summary

log = logging.getLogger(__name__)


def document(report: Report, aligned: alignment.AlignReport | None = None) -> dict:
    """The JSON summary of ``report``, with that of the alignment report under "alignment" when there is one."""
    return {**summary(report), **({"alignment": alignment.summary(aligned)} if aligned else {})}


def render(
    report: Report, out_dir: Path, plots: bool = True, aligned: alignment.AlignReport | None = None
) -> list[Path]:
    """Write report.md (the tables), summary.json (``document``) and, if ``plots``, three PNG plots (four with
    the batch table: tokens/s vs batch size); with ``aligned``, alignment.md and its plot, and only those plots
    when every run was at a draft temperature of its own. Return the paths.

    Plots need matplotlib (``pip install 'blockspec[bench]'``); without it this raises ImportError rather
    than silently skipping them.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "report.md", out_dir / "summary.json"]
    written[0].write_text(format_table(report) + "\n")
    written[1].write_text(json.dumps(document(report, aligned), indent=1) + "\n")
    if plots and (aligned is None or report.rows or report.baselines or report.batch):
        written += [
            plot_efficiency(report, out_dir / "block_efficiency_vs_k.png"),
            plot_speedup(report, out_dir / "speedup_vs_k.png"),
            plot_accepted(report, out_dir / "accepted_hist.png"),
        ]
        if report.batch:
            written.append(plot_batch(report, out_dir / "tokens_per_s_vs_batch.png"))
    if aligned:
        written.append(out_dir / "alignment.md")
        written[-1].write_text(alignment.format_table(aligned) + "\n")
        if plots:
            written.append(alignment.plot(aligned, out_dir / "alignment_gain_vs_overlap.png"))
    log.info("report written: %s", ", ".join(str(p) for p in written))
    return written


def build_parser() -> argparse.ArgumentParser:
    defaults = ReportConfig()
    parser = argparse.ArgumentParser(
        prog="python -m blockspec.bench.report",
        description="Tables and plots from saved benchmark records; the last stdout line is a JSON summary.",
    )
    parser.add_argument("--records", type=Path, nargs="+", required=True, help="JSONL record file(s)")
    parser.add_argument(
        "--out",
        type=Path,
        help="directory for report.md, summary.json and plots (and alignment.md "
        "for runs at draft temperatures of their own)",
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--n-boot", type=int, default=defaults.n_boot, help="bootstrap resamples (default: %(default)s)"
    )
    parser.add_argument("--confidence", type=float, default=defaults.confidence, help="(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed, help="bootstrap seed (default: %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Read the records, print the tables and then one JSON line; write files under --out. Exit status 2 for
    unreadable records, 1 when runs failed (the figures are incomplete), else 0."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        loaded = [record for path in args.records for record in records_io.read(path)]
        if not loaded:
            raise ValueError("no records")
        config = ReportConfig(n_boot=args.n_boot, confidence=args.confidence, seed=args.seed)
        report, aligned = build_report(loaded, config), alignment.build_report(loaded, config)
    except (FileNotFoundError, ValueError, TypeError) as error:  # e.g. records of two machine kinds
        print(f"report: error: {error}", file=sys.stderr)
        return 2
    if args.out:
        render(report, args.out, plots=not args.no_plots, aligned=aligned)
    print(format_table(report) + (f"\n\n{alignment.format_table(aligned)}" if aligned else ""))
    print(json.dumps(document(report, aligned)))
    failed = report.left_out.failed
    if failed:  # the figures are complete only without them: a script must see it
        print(f"report: {len(failed)} runs failed (listed in the report with their errors)", file=sys.stderr)
        return 1
    return 0
