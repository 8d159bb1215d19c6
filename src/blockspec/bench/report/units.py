"""Records by prompt unit and by cell, and whether a run's clock counts: what every table of the report shares."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from ..records import Record

log = logging.getLogger(__name__)

ALL = "all"  # dataset label of the summary rows, pooled over every dataset
# Other processes using more CPU than this (CPU-seconds per wall second of a run, 1.0 = a whole core) make a run's
# speed untrustworthy: on 2 shared cores, a quarter of a core taken away already shows in its tok/s.
MAX_OTHERS_CORES = 0.25


def _unit(record: Record) -> tuple[str, str]:
    return (record.dataset, record.prompt_id)


def by_unit(records: Iterable[Record]) -> dict[tuple[str, str], Record]:
    units: dict[tuple[str, str], Record] = {}
    for record in records:
        if _unit(record) in units:
            log.warning("duplicate record %s: keeping the first", record.key)
            continue
        units[_unit(record)] = record
    return units


def by_cell(records: list[Record]) -> dict[tuple, list[Record]]:
    """Records grouped by (config, temperature, max_draft, batch_size)."""
    cells: dict[tuple, list[Record]] = defaultdict(list)
    for record in records:
        cells[(record.config, record.temperature, record.max_draft, record.batch_size)].append(record)
    return cells


def is_timed(record: Record) -> bool:
    """Whether the record's wall clock can be trusted: no more than MAX_OTHERS_CORES used by other processes
    while it ran (records without the measurement are taken as they are)."""
    others = record.meta.get("others_cores")
    return others is None or others <= MAX_OTHERS_CORES


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def strata_of(units: list) -> np.ndarray:
    return np.array([dataset for dataset, _ in units])
