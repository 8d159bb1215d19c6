"""Benchmark report: paper-style tables and plots from saved JSONL records (re-runnable at any time).

Glossary (docs/algorithms.md conventions):
    BE          block efficiency = tokens emitted per target forward = 1 + mean accepted draft tokens per
                step, POOLED over all steps of all prompts of a configuration (sum accepted / sum steps).
    gain        BE_block / BE_token - 1, measured from the accepted lengths actually observed.
    analytic    1 + mean of the per-step exact E[accepted | this step's draft] under each rule, over the
                steps of BOTH the token and the block runs: every step's draft is scored under both rules,
                so the two BEs share their drafts and the paired gain is far less noisy than the measured one.
    tok/s       sum new_tokens / sum wall_time of a configuration (prefill included).
    unit        a prompt, (dataset, prompt_id). Confidence intervals resample prompts, never steps: the steps
                of one prompt share its context and difficulty, so they are not independent draws.

The token-vs-block tables are built from batch-1 records (one prompt per run). Batched runs (a batch of B
consecutive prompts per record, see ``records``) and the Speculative Verification configurations go to a
second table, pooled over datasets, one row per (temperature, batch size, configuration, K), whose unit is a
batch (at B = 1, a prompt):
    tok/s       decode throughput: sum new_tokens / sum (wall_time - prefill_time) over the batches of a
                configuration. The prompts' forwards are left out: at batch 64 with short generations they
                would dominate, and serving overlaps them with other batches' decoding. transformers'
                assisted generation and prompt lookup (hf-assisted, hf-lookup) do not report their prefill: their
                tok/s and x target-only (against target-only's) use whole wall times, so that the comparison
                counts prefill on both sides.
    x best K    tok/s over that of the best fixed-K configuration (token or block, any K: the highest tok/s
                on the batches all of them ran), re-selected inside every bootstrap resample.
    rejected    1 - accepted / verified: the fraction of verified drafted tokens the target rejected.
    verified / emitted, drafted / emitted   drafted tokens the target verified (drafted) per new token.

Runs left out (listed in a section of the report and under "left_out" in the JSON summary):
    failed      runs that raised (``Record.ok`` is false): left out of every figure, so a prompt whose
                target-only (or hf-assisted) run failed has no speedup over it; the report names such prompts.
    contended   runs timed while other processes used more than MAX_OTHERS_CORES CPU-seconds per wall second
                (``others_cores`` in the record's meta): left out of tok/s and of every speedup, kept in the
                block efficiencies (accepted lengths do not depend on timing).
Records from different machine kinds (CPU flags) or thread counts are never pooled: ``build_report`` refuses them.

Confidence intervals are percentile bootstrap intervals over prompts, paired (one resample picks the same
prompts for every configuration compared), stratified by dataset (each dataset keeps its prompt count), with
an explicit seeded ``numpy.random.Generator``. Speedups compare tok/s on the prompts both configurations ran.

Runs at a draft temperature of their own (the alignment sweep, ``blockspec align``) make a report of their own,
``alignment``: the paired analytic block-vs-token gain against the draft-target overlap per draft temperature.

Modules: ``stats`` (the bootstrap), ``tables`` (the tables as data, from records, and their JSON summary),
``markdown`` (the tables as text, and the cell formatters), ``plots``, ``alignment`` (the alignment report) and
``output`` (the files and the command line).

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
