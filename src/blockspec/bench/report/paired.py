"""The token-vs-block tables, as data: per (dataset, temperature, K, batch size) the paired token and block
runs (``Row``), the baselines and the unpaired rules (``BaselineRow``), and the accepted-length histograms."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .. import records as records_io
from ..records import Record
from .stats import Estimate, ReportConfig, bootstrap
from .units import by_unit, is_timed, ratio, strata_of

log = logging.getLogger(__name__)

BASELINES = ("target-only", "hf-assisted")  # the configurations speedups are taken over
CONVENTION = (
    "BE = block efficiency = 1 + mean accepted draft tokens per target forward, pooled over all steps of all "
    "prompts of a configuration; gain = BE block / BE token - 1 with a {conf:.0f}% percentile bootstrap CI that "
    "resamples prompts (paired by prompt, stratified by dataset, {n_boot} resamples, seed {seed}); analytic = "
    "1 + mean per-step exact E[accepted | draft] under each rule over the steps of both runs (same drafts); "
    "tok/s = sum new tokens / sum wall time; speedups are tok/s ratios on the prompts both configurations ran"
)


@dataclass(frozen=True)
class Row:
    """Token vs block at one (dataset, temperature, K, batch size), on the prompts both ran."""

    dataset: str
    temperature: float
    max_draft: int
    batch_size: int
    prompts: int  # prompts that ran both token and block
    steps_token: int
    steps_block: int
    # measured block efficiency
    be_token: float | None
    be_block: float | None
    gain: Estimate | None
    # analytic block efficiency from the per-step expected values
    analytic_be_token: float | None
    analytic_be_block: float | None
    analytic_gain: Estimate | None
    # wall clock
    tokens_per_s_token: float | None
    tokens_per_s_block: float | None
    speedup_token_vs_target: float | None
    speedup_block_vs_target: float | None
    speedup_token_vs_hf: float | None
    speedup_block_vs_hf: float | None
    speedup_block_vs_token: Estimate | None


@dataclass(frozen=True)
class BaselineRow:
    """target-only, hf-assisted or hf-lookup at one (dataset, temperature, K, batch size)."""

    dataset: str
    config: str
    temperature: float
    max_draft: int
    batch_size: int
    prompts: int
    tokens_per_s: float | None
    speedup_vs_target: float | None  # None for target-only itself or when target-only is missing


@dataclass(frozen=True)
class AcceptedHistogram:
    """How many steps accepted 0..K draft tokens, pooled over datasets."""

    config: str
    temperature: float
    max_draft: int
    counts: tuple[int, ...]  # counts[tau] for tau = 0..max


def _rate(records: Iterable[Record]) -> float | None:
    """tokens/s = sum new_tokens / sum wall_time (a pooled rate, not a mean of per-prompt rates) of the timed
    records."""
    records = [r for r in records if is_timed(r)]
    return ratio(sum(r.new_tokens for r in records), sum(r.wall_time for r in records))


def _speedup(fast: dict, slow: dict) -> float | None:
    """tok/s of ``fast`` over tok/s of ``slow`` on the prompts both ran, timed (prompt mix changes tok/s)."""
    common = {u for u in fast.keys() & slow.keys() if is_timed(fast[u]) and is_timed(slow[u])}
    if not common:
        return None
    fast_rate, slow_rate = _rate(fast[u] for u in common), _rate(slow[u] for u in common)
    return fast_rate / slow_rate if fast_rate and slow_rate else None


def efficiency_columns(token: list[Record], block: list[Record], strata: np.ndarray, config: ReportConfig) -> dict:
    """Measured BE of each rule (1 + pooled mean accepted) and the gain with a prompt-bootstrap CI.

    ``token[i]`` and ``block[i]`` are the runs of the same prompt.
    """
    columns = {
        "acc_t": np.array([sum(r.accepted) for r in token], float),
        "steps_t": np.array([len(r.accepted) for r in token], float),
        "acc_b": np.array([sum(r.accepted) for r in block], float),
        "steps_b": np.array([len(r.accepted) for r in block], float),
    }
    steps_t, steps_b = int(columns["steps_t"].sum()), int(columns["steps_b"].sum())
    be_token = 1 + columns["acc_t"].sum() / steps_t if steps_t else None
    be_block = 1 + columns["acc_b"].sum() / steps_b if steps_b else None
    gain = None
    if be_token and be_block:
        gain = bootstrap(
            lambda s: (1 + s["acc_b"] / s["steps_b"]) / (1 + s["acc_t"] / s["steps_t"]) - 1, columns, strata, config
        )
    return dict(steps_token=steps_t, steps_block=steps_b, be_token=be_token, be_block=be_block, gain=gain)


def analytic_columns(token: list[Record], block: list[Record], strata: np.ndarray, config: ReportConfig) -> dict:
    """BE from the exact per-step expected accepted lengths, pooled over the steps of BOTH runs.

    Every step of either run scored its own draft under both rules, so the token and block values share
    their drafts (a paired comparison); pooling the two runs doubles the steps. Both runs are lossless, so
    their contexts have the same law and pooling does not bias either value.
    """

    def per_prompt(name: str) -> np.ndarray:
        return np.array([sum(getattr(t, name)) + sum(getattr(b, name)) for t, b in zip(token, block)], float)

    columns = {
        "exp_t": per_prompt("expected_token"),
        "exp_b": per_prompt("expected_block"),
        "steps": np.array([len(t.expected_token) + len(b.expected_token) for t, b in zip(token, block)], float),
    }
    lengths_match = all(len(r.expected_token) == len(r.expected_block) for r in (*token, *block))
    if not lengths_match:
        log.warning("expected_token and expected_block differ in length in some records: analytic BE skipped")
    if not lengths_match or columns["steps"].sum() == 0:
        return dict(analytic_be_token=None, analytic_be_block=None, analytic_gain=None)
    steps = columns["steps"].sum()
    gain = bootstrap(lambda s: (s["steps"] + s["exp_b"]) / (s["steps"] + s["exp_t"]) - 1, columns, strata, config)
    return dict(
        analytic_be_token=1 + columns["exp_t"].sum() / steps,
        analytic_be_block=1 + columns["exp_b"].sum() / steps,
        analytic_gain=gain,
    )


def speed_columns(token: dict, block: dict, target: dict, hf: dict, config: ReportConfig) -> dict:
    """tok/s of each rule, speedups over target-only and hf-assisted, and block over token with a CI, from the
    timed records.

    Each argument maps a prompt unit to its record; ``token`` and ``block`` hold the same prompts (paired).
    """
    units = [u for u in token if is_timed(token[u]) and is_timed(block[u])]
    columns = {
        "new_t": np.array([token[u].new_tokens for u in units], float),
        "wall_t": np.array([token[u].wall_time for u in units], float),
        "new_b": np.array([block[u].new_tokens for u in units], float),
        "wall_b": np.array([block[u].wall_time for u in units], float),
    }
    block_vs_token = None
    if columns["wall_t"].sum() > 0 and columns["wall_b"].sum() > 0 and columns["new_t"].sum() > 0:
        block_vs_token = bootstrap(
            lambda s: (s["new_b"] / s["wall_b"]) / (s["new_t"] / s["wall_t"]), columns, strata_of(units), config
        )
    return dict(
        tokens_per_s_token=_rate(token[u] for u in units),
        tokens_per_s_block=_rate(block[u] for u in units),
        speedup_token_vs_target=_speedup(token, target),
        speedup_block_vs_target=_speedup(block, target),
        speedup_token_vs_hf=_speedup(token, hf),
        speedup_block_vs_hf=_speedup(block, hf),
        speedup_block_vs_token=block_vs_token,
    )


def _target_cell(cells: dict, temperature: float, batch_size: int) -> dict:
    """target-only records at this temperature and batch size (their max_draft is 0 by convention)."""
    return by_unit(
        r
        for (c, t, _, b), found in cells.items()
        for r in found
        if c == "target-only" and (t, b) == (temperature, batch_size)
    )


def _hf_cell(cells: dict, temperature: float, max_draft: int, batch_size: int) -> dict:
    """hf-assisted at the same K if it ran there, else with its own schedule (max_draft 0)."""
    for k in (max_draft, 0):
        if ("hf-assisted", temperature, k, batch_size) in cells:
            return by_unit(cells[("hf-assisted", temperature, k, batch_size)])
    return {}


def spec_row(label: str, cells: dict, temperature: float, max_draft: int, batch_size: int, config: ReportConfig) -> Row:
    token_all = by_unit(cells.get(("token", temperature, max_draft, batch_size), []))
    block_all = by_unit(cells.get(("block", temperature, max_draft, batch_size), []))
    units = sorted(token_all.keys() & block_all.keys())
    unpaired = len(token_all) + len(block_all) - 2 * len(units)
    if unpaired:
        log.warning(
            "%s T=%g K=%d B=%d: %d records without their token/block pair are left out",
            label,
            temperature,
            max_draft,
            batch_size,
            unpaired,
        )
    token = {u: token_all[u] for u in units}
    block = {u: block_all[u] for u in units}
    strata = np.array([dataset for dataset, _ in units])
    token_list, block_list = list(token.values()), list(block.values())
    return Row(
        dataset=label,
        temperature=temperature,
        max_draft=max_draft,
        batch_size=batch_size,
        prompts=len(units),
        **efficiency_columns(token_list, block_list, strata, config),
        **analytic_columns(token_list, block_list, strata, config),
        **speed_columns(
            token,
            block,
            _target_cell(cells, temperature, batch_size),
            _hf_cell(cells, temperature, max_draft, batch_size),
            config,
        ),
    )


def unpaired(cells: dict) -> set[tuple]:
    """The (config, T, K, B) cells of token or block whose other rule did not run there (e.g. block at T=0)."""
    other = {"token": "block", "block": "token"}
    return {key for key in cells if key[0] in other and (other[key[0]], *key[1:]) not in cells}


def baseline_rows(label: str, cells: dict, alone: set[tuple]) -> list[BaselineRow]:
    """target-only, hf-assisted, hf-lookup, and the token or block cells ``alone`` (``unpaired``): tok/s (prefill
    included) and the speedup over target-only."""
    rows = []
    order = {"target-only": 0, "hf-assisted": 1, "hf-lookup": 1, "token": 2, "block": 2}  # the reference first
    baseline_cells = sorted(
        (key for key in cells if key[0] in ("target-only", *records_io.HF_CONFIGS) or key in alone),
        key=lambda key: (order[key[0]], key[1:]),
    )
    for config_name, temperature, max_draft, batch_size in baseline_cells:
        found = cells[(config_name, temperature, max_draft, batch_size)]
        units = by_unit(found)
        target = _target_cell(cells, temperature, batch_size)
        rows.append(
            BaselineRow(
                dataset=label,
                config=config_name,
                temperature=temperature,
                max_draft=max_draft,
                batch_size=batch_size,
                prompts=len(units),
                tokens_per_s=_rate(units.values()),
                speedup_vs_target=None if config_name == "target-only" else _speedup(units, target),
            )
        )
    return rows


def histograms(records: list[Record]) -> list[AcceptedHistogram]:
    from ...verify import SAMPLED_RULES  # here, not at the top: a report reads records without torch

    pooled: dict[tuple, list[int]] = defaultdict(list)
    for record in records:
        if record.config in SAMPLED_RULES and record.accepted:
            pooled[(record.config, record.temperature, record.max_draft)].extend(record.accepted)
    return [
        AcceptedHistogram(
            config_name, temperature, max_draft, tuple(int(c) for c in np.bincount(accepted, minlength=max_draft + 1))
        )
        for (config_name, temperature, max_draft), accepted in sorted(pooled.items())
    ]
