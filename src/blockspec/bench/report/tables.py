"""The benchmark report as data, built from records: the token-vs-block tables (``paired``), the batch table
(``batch``), the runs left out and the machine; and the JSON summary of them. How each figure is computed:
docs/guide/bench.md, and ``CONVENTION`` / ``BATCH_CONVENTION``, printed above the tables."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import asdict, dataclass

from .. import records as records_io
from ..records import Record
from .batch import BatchRow, batch_rows, batch_table_only
from .paired import CONVENTION, AcceptedHistogram, BaselineRow, Row, baseline_rows, histograms, spec_row, unpaired
from .stats import ReportConfig
from .units import ALL, MAX_OTHERS_CORES, by_cell, is_timed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeftOut:
    """Runs the figures leave out, and why; each a dict of its key fields and the reason's detail."""

    failed: tuple[dict, ...] = ()  # raised ("error"), and not rerun successfully: in no figure
    contended: tuple[dict, ...] = ()  # others used > MAX_OTHERS_CORES ("others_cores"): in no tok/s or speedup


@dataclass(frozen=True)
class Report:
    datasets: tuple[str, ...]
    rows: tuple[Row, ...]  # per dataset, then the ALL rows
    baselines: tuple[BaselineRow, ...]
    histograms: tuple[AcceptedHistogram, ...]
    n_records: int
    config: ReportConfig
    batch: tuple[BatchRow, ...] = ()  # only when there are batched or SV records
    left_out: LeftOut = LeftOut()
    machine: dict | None = None  # {"cpu_flags", "threads"} of every record (None where the records name no CPU flags)

    def rows_of(self, dataset: str) -> list[Row]:
        return [row for row in self.rows if row.dataset == dataset]


def build_report(records: list[Record], config: ReportConfig = ReportConfig()) -> Report:
    """Tables for every dataset and one pooled over all datasets (label ``ALL``), plus histograms, from the
    batch-1 records; and the batch table when there are batched or SV records, or token or block records
    without the other rule at the same (temperature, K, batch size), which the paired tables leave out.

    Unknown configurations are ignored with a warning; missing ones leave their columns empty (None). Failed
    runs are left out of every figure, contended ones out of tok/s and speedups (``LeftOut``). Runs at a draft
    temperature of their own are left to the alignment report (``alignment``), but for the failed ones, listed here.
    Raises ValueError for records of more than one machine kind or thread count, or of more than one build
    (``_one_build``).
    """
    known = [r for r in records if records_io.is_known(r.config)]
    if len(known) < len(records):
        log.warning("%d records with an unknown config are ignored", len(records) - len(known))
    machine = _one_machine(known)
    _one_build(known)
    left_out = _left_out(known)
    n_records, known = len(known), [r for r in known if r.ok and r.draft_temperature is None]
    batch = (
        tuple(batch_rows(known, config))
        if unpaired(by_cell(known)) or any(r.batch_size > 1 or batch_table_only(r.config) for r in known)
        else ()
    )
    paper = [r for r in known if r.batch_size == 1 and r.config not in records_io.SV_CONFIGS]
    datasets = tuple(sorted({r.dataset for r in paper}))
    groups = [(dataset, [r for r in paper if r.dataset == dataset]) for dataset in datasets]
    if datasets:
        groups.append((ALL, paper))
    rows, baselines = [], []
    for label, group in groups:
        cells = by_cell(group)
        alone = unpaired(cells)  # one rule without the other (e.g. block at T=0): listed with the baselines
        spec_keys = sorted(key[1:] for key in cells if key[0] == "token" and key not in alone)
        rows += [spec_row(label, cells, t, k, b, config) for t, k, b in spec_keys]
        baselines += baseline_rows(label, cells, alone)
        log.info("%s: %d records, %d token/block rows", label, len(group), len(spec_keys))
    return Report(
        datasets, tuple(rows), tuple(baselines), tuple(histograms(paper)), n_records, config, batch, left_out, machine
    )


def _one_machine(records: list[Record]) -> dict | None:
    """The machine kind and thread count all ``records`` ran with; ValueError if they differ (tok/s from two
    kinds of CPU or two thread counts are not comparable, and pooling them would blur both)."""
    kinds = {(tuple(r.meta["cpu_flags"]) if "cpu_flags" in r.meta else None, r.meta.get("threads")) for r in records}
    if len(kinds) > 1:
        found = "; ".join(
            f"CPU flags {' '.join(flags) if flags else '(none)'} with {threads} threads"
            if flags is not None
            else f"CPU flags unrecorded with {threads} threads"
            for flags, threads in sorted(kinds, key=str)
        )
        raise ValueError(
            f"records from {len(kinds)} machine kinds or thread counts ({found}): their speeds are "
            "not comparable; report each machine's records separately"
        )
    flags, threads = kinds.pop() if kinds else (None, None)
    return None if flags is None else {"cpu_flags": list(flags), "threads": threads}


def _one_build(records: list[Record]) -> None:
    """ValueError if ``records`` ran in more than one arithmetic (dtype, target quantization, a configuration's
    draft quantization), with other library versions or on other model bytes (the fingerprints of
    ``bench.provenance``: the target's, and the draft's among the records that draft): pooled, their figures would
    describe no one setup. Records that predate a field agree on its absence."""
    found: dict[str, set[str]] = defaultdict(set)
    for record in records:
        meta = record.meta
        found["dtype"].add(json.dumps(meta.get("dtype")))
        found["target quantization"].add(json.dumps(meta.get("target_quant")))
        found["versions"].add(json.dumps(meta.get("versions"), sort_keys=True))
        models = meta.get("models") or {}
        found["target fingerprint"].add(json.dumps(models.get("target")))
        if "draft_quant" in meta:  # the record drafts
            found[f"draft quantization of {record.config}"].add(json.dumps(meta["draft_quant"]))
            found["draft fingerprint"].add(json.dumps(models.get("draft")))
    differ = {what: values for what, values in found.items() if len(values) > 1}
    if differ:
        raise ValueError(
            "records of other builds ("
            + "; ".join(f"{what}: {' vs '.join(sorted(values))}" for what, values in differ.items())
            + "): their figures are not comparable; report each run directory separately"
        )


def _key_fields(record: Record) -> dict:
    draft = {} if record.draft_temperature is None else {"draft_temperature": record.draft_temperature}
    return dict(
        dataset=record.dataset,
        prompt_id=record.prompt_id,
        config=record.config,
        max_draft=record.max_draft,
        temperature=record.temperature,
        batch_size=record.batch_size,
        **draft,
    )


def _left_out(records: list[Record]) -> LeftOut:
    """Failed runs whose run has no successful record (the last error of each), and contended runs."""
    return LeftOut(
        failed=tuple(dict(_key_fields(r), error=r.error) for r in records_io.still_failed(records).values()),
        contended=tuple(
            dict(_key_fields(r), others_cores=r.meta["others_cores"])
            for r in records
            if r.ok and r.draft_temperature is None and not is_timed(r)
        ),
    )


def _fastest(report: Report) -> list[dict]:
    """Per (temperature, batch size), the configuration and K with the highest pooled tok/s."""
    candidates = [
        (b.temperature, b.batch_size, b.config, b.max_draft, b.tokens_per_s)
        for b in report.baselines
        if b.dataset == ALL
    ]
    for row in report.rows_of(ALL):
        candidates.append((row.temperature, row.batch_size, "token", row.max_draft, row.tokens_per_s_token))
        candidates.append((row.temperature, row.batch_size, "block", row.max_draft, row.tokens_per_s_block))
    best: dict[tuple, tuple] = {}
    for temperature, batch_size, name, k, rate in candidates:
        if rate is not None and ((temperature, batch_size) not in best or rate > best[(temperature, batch_size)][2]):
            best[(temperature, batch_size)] = (name, k, rate)
    return [
        dict(temperature=t, batch_size=b, config=name, max_draft=k, tokens_per_s=rate)
        for (t, b), (name, k, rate) in sorted(best.items())
    ]


def summary(report: Report) -> dict:
    """The JSON summary (the last stdout line of the CLI): pooled rows, baselines and the fastest setting."""
    cfg = report.config
    return {
        "convention": CONVENTION.format(conf=100 * cfg.confidence, n_boot=cfg.n_boot, seed=cfg.seed),
        "confidence": cfg.confidence,
        "n_boot": cfg.n_boot,
        "seed": cfg.seed,
        "records": report.n_records,
        "machine": report.machine,
        "left_out": {
            "failed": list(report.left_out.failed),
            "contended": list(report.left_out.contended),
            "max_others_cores": MAX_OTHERS_CORES,
        },
        "datasets": list(report.datasets),
        "summary": [asdict(row) for row in report.rows_of(ALL)],
        "baselines": [asdict(b) for b in report.baselines if b.dataset == ALL],
        "fastest": _fastest(report),
        **(
            {"batch": [asdict(row) for row in report.batch], "batch_best_fixed": _best_fixed(report)}
            if report.batch
            else {}
        ),
    }


def _best_fixed(report: Report) -> list[dict]:
    """Per (temperature, batch size) of the batch table, the best fixed-K configuration."""
    return [
        dict(
            temperature=r.temperature,
            batch_size=r.batch_size,
            config=r.config,
            max_draft=r.max_draft,
            tokens_per_s=r.tokens_per_s.value if r.tokens_per_s else None,
        )
        for r in report.batch
        if r.best_fixed
    ]
