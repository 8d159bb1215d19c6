"""The batch table, as data (``BatchRow``): every configuration at every (temperature, batch size), pooled over
datasets, with batches as units."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from .. import records as records_io
from ..records import Record
from .stats import Estimate, ReportConfig, bootstrap
from .units import by_cell, by_unit, is_timed, ratio, strata_of

# configurations only the batch table shows (it lists every configuration; the paper table compares token and block),
# with the trees and paths (batch_table_only)
BATCH_TABLE_ONLY = records_io.SV_CONFIGS + records_io.ADAPTIVE_CONFIGS + ("block-int8",)
BATCH_CONVENTION = (
    "Batch table, all datasets pooled: a unit is a batch of B consecutive prompts decoded in one generate call "
    "(a prompt at B = 1); tok/s = sum new tokens / sum decode time (wall time less prefill) over batches, except "
    "for hf-assisted and hf-lookup, whose prefill is not reported: their tok/s and x target-only use whole wall "
    "times on both sides; x transformers = whole wall tok/s over transformers' counterpart (hf-lookup for lookup "
    "and lookup+model, hf-assisted for the others), prefill included on both sides; x target-only, x best fixed "
    "K and x transformers are tok/s ratios on the batches both (all) configurations ran, the best fixed K (*) "
    "being the token or block K with the highest tok/s, re-selected in every resample; rejected = 1 - accepted / "
    "verified drafted tokens; verified (drafted) / emitted = verified (drafted) draft tokens per new token; BE = "
    "1 + accepted per row-step, the tokens per target forward; a tree-SHAPE row drafts that tree each step "
    "(children per node at each depth): its K is the tree's nodes, verified counts nodes and drafted its levels "
    "(a draft forward each, as a chain's drafted tokens are); a paths-k (paths-iid-k) row drafts k paths of K "
    "tokens each step, first tokens distinct (i.i.d. paths, merged where they agree), verified counts nodes; "
    "{conf:.0f}% percentile bootstrap CIs over batches, stratified by dataset (given once every dataset has 2 "
    "batches), {n_boot} resamples, seed {seed}"
)
TREE_CHOICE_CONVENTION = (
    "auto-tree (each step the tree or chain predicted fastest) against auto (each step the chain length predicted "
    "fastest: what generate runs by default), the same draft and the same most drafted nodes K: x auto = tok/s ratio "
    "on the batches both ran, decode time; {conf:.0f}% percentile bootstrap CI over batches, stratified by dataset "
    "(given once every dataset has 2 batches), {n_boot} resamples, seed {seed}"
)


def batch_table_only(name: str) -> bool:
    """Whether only the batch table shows configuration ``name``: ``BATCH_TABLE_ONLY``, every tree and paths."""
    return name in BATCH_TABLE_ONLY or records_io.drafts_trees(name)


@dataclass(frozen=True)
class BatchRow:
    """One configuration at one (temperature, batch size), pooled over datasets; units are batches."""

    temperature: float
    batch_size: int
    config: str
    max_draft: int
    batches: int
    tokens_per_s: Estimate | None
    speedup_vs_target: Estimate | None  # None for target-only itself or when target-only is missing
    best_fixed: bool  # the token / block K with the highest tok/s at this (temperature, batch size)
    speedup_vs_best_fixed: Estimate | None  # for the SV, tree and paths configurations
    # over transformers' counterpart (hf-lookup for lookup and lookup+model, else hf-assisted), whole wall times
    speedup_vs_hf: Estimate | None
    rejected: Estimate | None  # 1 - accepted / verified (None when nothing was verified)
    verified_per_emitted: Estimate | None
    drafted_per_emitted: float | None  # None for transformers' configurations (no per-step counts)
    block_efficiency: float | None  # 1 + accepted per row-step
    # auto-tree's tok/s over auto's (the chain generate --drafter model runs, its length chosen each step) at the same K
    speedup_vs_auto: Estimate | None = None


def _step_sums(record: Record, decode: bool = True) -> dict[str, float]:
    """Per-unit sums of a record for the batch table; "wall" is decode time, or with ``decode=False`` the whole
    wall time (prefill included)."""
    return {
        "new": float(record.new_tokens),
        "wall": float(record.wall_time - (record.prefill_time or 0.0) if decode else record.wall_time),
        "accepted": float(sum(record.accepted)),
        "verified": float(sum(record.verified)),
        "row_steps": float(len(record.accepted)),
        "drafted": float(sum(d * r for d, r in zip(record.drafted, record.rows))),
    }


def _decode_rate(records: Iterable[Record]) -> float | None:
    """The batch table's tok/s: sum new_tokens / sum (wall_time - prefill_time)."""
    sums = [_step_sums(record) for record in records]
    return ratio(sum(s["new"] for s in sums), sum(s["wall"] for s in sums))


def _columns(cell: dict, units: list, decode: bool = True) -> dict[str, np.ndarray]:
    sums = [_step_sums(cell[u], decode) for u in units]
    return {name: np.array([s[name] for s in sums], float) for name in (sums[0] if sums else ())}


def batch_rows(records: list[Record], config: ReportConfig) -> list[BatchRow]:
    """The batch table: every configuration at every (temperature, batch size), pooled over datasets."""
    cells = {key: by_unit(found) for key, found in by_cell(records).items()}  # (config, T, K, B) -> unit -> record
    order = {name: i for i, name in enumerate(records_io.KNOWN_CONFIGS)}  # then the trees, by name
    rows = []
    for temperature, batch_size in sorted({(t, b) for (_, t, _, b) in cells}):
        here = {(c, k): cell for (c, t, k, b), cell in cells.items() if (t, b) == (temperature, batch_size)}
        target = here.get(("target-only", 0), {})
        fixed = {key: cell for key, cell in here.items() if key[0] in records_io.FIXED_CONFIGS}
        # units every fixed-K configuration ran: where their tok/s are compared and the best one is chosen
        fixed_units = (
            sorted(
                u
                for u in set.intersection(*(set(c) for c in fixed.values()))
                if all(is_timed(c[u]) for c in fixed.values())
            )
            if fixed
            else []
        )
        best = None
        if fixed_units:
            rates = {key: _decode_rate(cell[u] for u in fixed_units) for key, cell in fixed.items()}
            known = {key: rate for key, rate in rates.items() if rate is not None}
            best = max(known, key=lambda key: known[key], default=None)
        for (name, k), cell in sorted(
            here.items(), key=lambda item: (order.get(item[0][0], len(order)), item[0][0], item[0][1])
        ):
            units = sorted(cell)
            columns = _columns(cell, units)
            timed = [u for u in units if is_timed(cell[u])]
            steps = name not in records_io.HF_CONFIGS  # their records carry neither per-step lists nor a prefill time
            rows.append(
                BatchRow(
                    temperature=temperature,
                    batch_size=batch_size,
                    config=name,
                    max_draft=k,
                    batches=len(units),
                    tokens_per_s=_estimate(lambda s: s["new"] / s["wall"], _columns(cell, timed), timed, config),
                    speedup_vs_target=None
                    if name == "target-only"
                    else _paired_speedup(cell, [target], config, decode=steps),
                    best_fixed=(name, k) == best,
                    speedup_vs_best_fixed=(
                        _paired_speedup(cell, list(fixed.values()), config)
                        if name in records_io.SV_CONFIGS or records_io.drafts_trees(name)
                        else None
                    ),
                    speedup_vs_hf=(
                        None
                        if name in ("target-only", *records_io.HF_CONFIGS)
                        else _paired_speedup(
                            cell,
                            [here.get(("hf-lookup" if name.startswith("lookup") else "hf-assisted", 0), {})],
                            config,
                            decode=False,
                        )
                    ),
                    rejected=_estimate(
                        lambda s: 1 - s["accepted"] / s["verified"],
                        columns,
                        units,
                        config,
                        when=steps and columns["verified"].sum() > 0,
                    ),
                    verified_per_emitted=_estimate(
                        lambda s: s["verified"] / s["new"], columns, units, config, when=steps
                    ),
                    drafted_per_emitted=ratio(columns["drafted"].sum(), columns["new"].sum()) if steps else None,
                    block_efficiency=(
                        1 + columns["accepted"].sum() / columns["row_steps"].sum()
                        if steps and columns["row_steps"].sum() > 0
                        else None
                    ),
                    speedup_vs_auto=(
                        _paired_speedup(cell, [here[("auto", k)]], config)
                        if name == records_io.AUTO_TREE and ("auto", k) in here
                        else None
                    ),
                )
            )
    return rows


def _estimate(statistic: Callable, columns: dict, units: list, config: ReportConfig, when: bool = True):
    """``bootstrap`` over the units (batches), or None when there is nothing to estimate."""
    if not when or not units or columns["new"].sum() <= 0 or columns["wall"].sum() <= 0:
        return None
    return bootstrap(statistic, columns, strata_of(units), config)


def _paired_speedup(cell: dict, others: list[dict], config: ReportConfig, decode: bool = True) -> Estimate | None:
    """tok/s of ``cell`` over the best tok/s among ``others`` (each unit -> record), on the units all of them
    ran, timed, with the best re-chosen in every resample (so the selection is part of the interval); decode
    time, or with ``decode=False`` whole wall times."""
    if not others or not all(others):
        return None
    units = sorted(u for u in set(cell).intersection(*others) if all(is_timed(c[u]) for c in (cell, *others)))
    if not units:
        return None
    columns = {
        f"{name}{i}": column
        for i, other in enumerate([cell, *others])
        for name, column in _columns(other, units, decode).items()
        if name in ("new", "wall")
    }
    if any(column.sum() <= 0 for column in columns.values()):
        return None

    def statistic(s):
        best = np.max([s[f"new{i}"] / s[f"wall{i}"] for i in range(1, len(others) + 1)], axis=0)
        return (s["new0"] / s["wall0"]) / best

    return bootstrap(statistic, columns, strata_of(units), config)
