"""The bootstrap of the reports: percentile intervals over prompts (or batches), paired and stratified by dataset,
drawn from an explicit seeded ``numpy.random.Generator``, so the same records give the same report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReportConfig:
    """Defaults of the report (the CLI reads them from here)."""

    n_boot: int = 2000  # bootstrap resamples of prompts
    confidence: float = 0.95
    seed: int = 0  # seed of the bootstrap's numpy Generator: the same records give the same report


@dataclass(frozen=True)
class Estimate:
    """A point value and its bootstrap interval (lo/hi are None with fewer than two prompts)."""

    value: float
    lo: float | None = None
    hi: float | None = None


def resample_counts(strata: np.ndarray, n_boot: int, generator: np.random.Generator) -> np.ndarray:
    """[n_boot, P] float: how often each of P prompts is drawn in each resample.

    Prompts are redrawn with replacement within their stratum (dataset), so every resample keeps each
    dataset's prompt count. A statistic of the resample is then a function of ``counts @ per_prompt_sums``.
    """
    counts = np.zeros((n_boot, len(strata)))
    for stratum in np.unique(strata):  # sorted: the draw order is deterministic
        members = np.flatnonzero(strata == stratum)
        m = len(members)
        draws = generator.integers(0, m, size=(n_boot, m))  # [n_boot, m] indices into members
        flat = draws + m * np.arange(n_boot)[:, None]  # one bincount for all resamples: offset row b by b*m
        counts[:, members] = np.bincount(flat.ravel(), minlength=n_boot * m).reshape(n_boot, m)
    return counts


def bootstrap(
    statistic: Callable[[dict], float | np.ndarray],
    columns: dict[str, np.ndarray],
    strata: np.ndarray,
    config: ReportConfig,
) -> Estimate:
    """Point value and percentile CI of ``statistic`` over prompts.

    ``columns`` maps a name to per-prompt sums [P] (all aligned on the same prompts, so the bootstrap is
    paired); ``statistic`` receives the same names mapped to totals: scalars for the point value, arrays
    [n_boot] for the resamples (numpy broadcasting serves both).
    """
    point = float(statistic({name: column.sum() for name, column in columns.items()}))
    # A stratum with a single prompt resamples to itself: its interval would be falsely narrow (zero-width
    # with one prompt per dataset), so no interval is given until every stratum has two prompts.
    if len(strata) < 2 or np.unique(strata, return_counts=True)[1].min() < 2:
        return Estimate(point)
    generator = np.random.default_rng(config.seed)  # fresh per call: a cell's CI does not depend on call order
    counts = resample_counts(strata, config.n_boot, generator)
    with np.errstate(divide="ignore", invalid="ignore"):  # a resample can draw only zero-step prompts
        replicas = np.asarray(statistic({name: counts @ column for name, column in columns.items()}), float)
    replicas = replicas[np.isfinite(replicas)]
    if len(replicas) == 0:
        return Estimate(point)
    tail = (1 - config.confidence) / 2
    lo, hi = np.quantile(replicas, [tail, 1 - tail])
    return Estimate(point, float(lo), float(hi))
