"""Benchmark report: paper-style tables and plots from saved JSONL records (re-runnable at any time).

Modules: ``units`` (records by prompt and by cell), ``paired`` (the token-vs-block tables and the baselines),
``batch`` (the batch table), ``tables`` (the report from records, and its JSON summary), ``stats`` (the
bootstrap), ``markdown`` (the tables as text, and the cell formatters), ``plots``, ``alignment`` (the alignment
report) and ``output`` (the files and the command line). What each figure means: docs/guide/bench.md.

Library entry points: ``build_report(records) -> Report``, ``format_table(report) -> str``,
``summary(report) -> dict``, ``render(report, out_dir) -> list[Path]``. The CLI
``python -m blockspec.bench.report --records FILE --out DIR`` prints the tables, then one JSON line.
"""

from .markdown import HEADER, format_table
from .output import main, render
from .plots import new_figure
from .stats import ReportConfig
from .tables import build_report, summary
from .units import ALL, MAX_OTHERS_CORES

__all__ = [
    "ALL",
    "HEADER",
    "MAX_OTHERS_CORES",
    "ReportConfig",
    "build_report",
    "format_table",
    "main",
    "new_figure",
    "render",
    "summary",
]
