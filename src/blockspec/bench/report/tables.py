"""The benchmark report's tables as data, built from records: token vs block per dataset and pooled (``Row``),
the baselines, the accepted-length histograms, the batch table (``BatchRow``), the runs left out; and the JSON
summary of them. The conventions (how each figure is computed) are in the package's docstring and in
``CONVENTION`` / ``BATCH_CONVENTION``, printed above the tables."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np

from .. import records as records_io
from ..records import Record
from .stats import Estimate, ReportConfig, bootstrap

log = logging.getLogger(__name__)

ALL = "all"  # dataset label of the summary rows, pooled over every dataset
# Other processes using more CPU than this (CPU-seconds per wall second of a run, 1.0 = a whole core) make a run's
# speed untrustworthy: on 2 shared cores, a quarter of a core taken away already shows in its tok/s.
MAX_OTHERS_CORES = 0.25
BASELINES = ("target-only", "hf-assisted")  # the configurations speedups are taken over
# configurations only the batch table shows (it lists every configuration; the paper table compares token and block)
BATCH_TABLE_ONLY = records_io.SV_CONFIGS + records_io.ADAPTIVE_CONFIGS + ("block-int8",)
CONVENTION = (
    "BE = block efficiency = 1 + mean accepted draft tokens per target forward, pooled over all steps of all "
    "prompts of a configuration; gain = BE block / BE token - 1 with a {conf:.0f}% percentile bootstrap CI that "
    "resamples prompts (paired by prompt, stratified by dataset, {n_boot} resamples, seed {seed}); analytic = "
    "1 + mean per-step exact E[accepted | draft] under each rule over the steps of both runs (same drafts); "
    "tok/s = sum new tokens / sum wall time; speedups are tok/s ratios on the prompts both configurations ran"
)
BATCH_CONVENTION = (
    "Batch table, all datasets pooled: a unit is a batch of B consecutive prompts decoded in one generate call "
    "(a prompt at B = 1); tok/s = sum new tokens / sum decode time (wall time less prefill) over batches, except "
    "for hf-assisted and hf-lookup, whose prefill is not reported: their tok/s and x target-only use whole wall "
    "times on both sides; x transformers = whole wall tok/s over transformers' counterpart (hf-lookup for lookup "
    "and lookup+model, hf-assisted for the others), prefill included on both sides; x target-only, x best fixed "
    "K and x transformers are tok/s ratios on the batches both (all) configurations ran, the best fixed K (*) "
    "being the token or block K with the highest tok/s, re-selected in every resample; rejected = 1 - accepted / "
    "verified drafted tokens; verified (drafted) / emitted = verified (drafted) draft tokens per new token; BE = "
    "1 + accepted per row-step; {conf:.0f}% percentile bootstrap CIs over batches, stratified by dataset (given "
    "once every dataset has 2 batches), {n_boot} resamples, seed {seed}"
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
    speedup_vs_best_fixed: Estimate | None  # for the SV configurations
    # over transformers' counterpart (hf-lookup for lookup and lookup+model, else hf-assisted), whole wall times
    speedup_vs_hf: Estimate | None
    rejected: Estimate | None  # 1 - accepted / verified (None when nothing was verified)
    verified_per_emitted: Estimate | None
    drafted_per_emitted: float | None  # None for transformers' configurations (no per-step counts)
    block_efficiency: float | None  # 1 + accepted per row-step


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


# ------------------------------------------------------------------------------------ record helpers


def _unit(record: Record) -> tuple[str, str]:
    return (record.dataset, record.prompt_id)


def _by_unit(records: Iterable[Record]) -> dict[tuple[str, str], Record]:
    units: dict[tuple[str, str], Record] = {}
    for record in records:
        if _unit(record) in units:
            log.warning("duplicate record %s: keeping the first", record.key)
            continue
        units[_unit(record)] = record
    return units


def _timed(record: Record) -> bool:
    """Whether the record's wall clock can be trusted: no more than MAX_OTHERS_CORES used by other processes
    while it ran (records without the measurement are taken as they are)."""
    others = record.meta.get("others_cores")
    return others is None or others <= MAX_OTHERS_CORES


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def _rate(records: Iterable[Record]) -> float | None:
    """tokens/s = sum new_tokens / sum wall_time (a pooled rate, not a mean of per-prompt rates) of the timed
    records."""
    records = [r for r in records if _timed(r)]
    return _ratio(sum(r.new_tokens for r in records), sum(r.wall_time for r in records))


def _speedup(fast: dict, slow: dict) -> float | None:
    """tok/s of ``fast`` over tok/s of ``slow`` on the prompts both ran, timed (prompt mix changes tok/s)."""
    common = {u for u in fast.keys() & slow.keys() if _timed(fast[u]) and _timed(slow[u])}
    if not common:
        return None
    fast_rate, slow_rate = _rate(fast[u] for u in common), _rate(slow[u] for u in common)
    return fast_rate / slow_rate if fast_rate and slow_rate else None


# --------------------------------------------------------------------------------- table column groups


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
    units = [u for u in token if _timed(token[u]) and _timed(block[u])]
    columns = {
        "new_t": np.array([token[u].new_tokens for u in units], float),
        "wall_t": np.array([token[u].wall_time for u in units], float),
        "new_b": np.array([block[u].new_tokens for u in units], float),
        "wall_b": np.array([block[u].wall_time for u in units], float),
    }
    block_vs_token = None
    if columns["wall_t"].sum() > 0 and columns["wall_b"].sum() > 0 and columns["new_t"].sum() > 0:
        block_vs_token = bootstrap(
            lambda s: (s["new_b"] / s["wall_b"]) / (s["new_t"] / s["wall_t"]), columns, _strata(units), config
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


# ------------------------------------------------------------------------------------------- building


def _cells(records: list[Record]) -> dict[tuple, list[Record]]:
    """Records grouped by (config, temperature, max_draft, batch_size)."""
    cells: dict[tuple, list[Record]] = defaultdict(list)
    for record in records:
        cells[(record.config, record.temperature, record.max_draft, record.batch_size)].append(record)
    return cells


def _target_cell(cells: dict, temperature: float, batch_size: int) -> dict:
    """target-only records at this temperature and batch size (their max_draft is 0 by convention)."""
    return _by_unit(
        r
        for (c, t, _, b), found in cells.items()
        for r in found
        if c == "target-only" and (t, b) == (temperature, batch_size)
    )


def _hf_cell(cells: dict, temperature: float, max_draft: int, batch_size: int) -> dict:
    """hf-assisted at the same K if it ran there, else with its own schedule (max_draft 0)."""
    for k in (max_draft, 0):
        if ("hf-assisted", temperature, k, batch_size) in cells:
            return _by_unit(cells[("hf-assisted", temperature, k, batch_size)])
    return {}


def _spec_row(
    label: str, cells: dict, temperature: float, max_draft: int, batch_size: int, config: ReportConfig
) -> Row:
    token_all = _by_unit(cells.get(("token", temperature, max_draft, batch_size), []))
    block_all = _by_unit(cells.get(("block", temperature, max_draft, batch_size), []))
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


def _unpaired(cells: dict) -> set[tuple]:
    """The (config, T, K, B) cells of token or block whose other rule did not run there (e.g. block at T=0)."""
    other = {"token": "block", "block": "token"}
    return {key for key in cells if key[0] in other and (other[key[0]], *key[1:]) not in cells}


def _baseline_rows(label: str, cells: dict, alone: set[tuple]) -> list[BaselineRow]:
    """target-only, hf-assisted, hf-lookup, and the token or block cells ``alone`` (``_unpaired``): tok/s (prefill
    included) and the speedup over target-only."""
    rows = []
    order = {"target-only": 0, "hf-assisted": 1, "hf-lookup": 1, "token": 2, "block": 2}  # the reference first
    baseline_cells = sorted(
        (key for key in cells if key[0] in ("target-only", *records_io.HF_CONFIGS) or key in alone),
        key=lambda key: (order[key[0]], key[1:]),
    )
    for config_name, temperature, max_draft, batch_size in baseline_cells:
        found = cells[(config_name, temperature, max_draft, batch_size)]
        units = _by_unit(found)
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


def _histograms(records: list[Record]) -> list[AcceptedHistogram]:
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


def build_report(records: list[Record], config: ReportConfig = ReportConfig()) -> Report:
    """Tables for every dataset and one pooled over all datasets (label ``ALL``), plus histograms, from the
    batch-1 records; and the batch table when there are batched or SV records, or token or block records
    without the other rule at the same (temperature, K, batch size), which the paired tables leave out.

    Unknown configurations are ignored with a warning; missing ones leave their columns empty (None). Failed
    runs are left out of every figure, contended ones out of tok/s and speedups (``LeftOut``). Runs at a draft
    temperature of their own are left to the alignment report (``alignment``), but for the failed ones, listed here.
    Raises ValueError for records of more than one machine kind or thread count.
    """
    known = [r for r in records if r.config in records_io.KNOWN_CONFIGS]
    if len(known) < len(records):
        log.warning("%d records with an unknown config are ignored", len(records) - len(known))
    machine = _one_machine(known)
    left_out = _left_out(known)
    n_records, known = len(known), [r for r in known if r.ok and r.draft_temperature is None]
    batch = (
        tuple(_batch_rows(known, config))
        if _unpaired(_cells(known)) or any(r.batch_size > 1 or r.config in BATCH_TABLE_ONLY for r in known)
        else ()
    )
    paper = [r for r in known if r.batch_size == 1 and r.config not in records_io.SV_CONFIGS]
    datasets = tuple(sorted({r.dataset for r in paper}))
    groups = [(dataset, [r for r in paper if r.dataset == dataset]) for dataset in datasets]
    if datasets:
        groups.append((ALL, paper))
    rows, baselines = [], []
    for label, group in groups:
        cells = _cells(group)
        alone = _unpaired(cells)  # one rule without the other (e.g. block at T=0): listed with the baselines
        spec_keys = sorted(key[1:] for key in cells if key[0] == "token" and key not in alone)
        rows += [_spec_row(label, cells, t, k, b, config) for t, k, b in spec_keys]
        baselines += _baseline_rows(label, cells, alone)
        log.info("%s: %d records, %d token/block rows", label, len(group), len(spec_keys))
    return Report(
        datasets, tuple(rows), tuple(baselines), tuple(_histograms(paper)), n_records, config, batch, left_out, machine
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
            if r.ok and r.draft_temperature is None and not _timed(r)
        ),
    )


# ---------------------------------------------------------------------------------------------- batch table


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
    return _ratio(sum(s["new"] for s in sums), sum(s["wall"] for s in sums))


def _columns(cell: dict, units: list, decode: bool = True) -> dict[str, np.ndarray]:
    sums = [_step_sums(cell[u], decode) for u in units]
    return {name: np.array([s[name] for s in sums], float) for name in (sums[0] if sums else ())}


def _strata(units: list) -> np.ndarray:
    return np.array([dataset for dataset, _ in units])


def _batch_rows(records: list[Record], config: ReportConfig) -> list[BatchRow]:
    """The batch table: every configuration at every (temperature, batch size), pooled over datasets."""
    cells = {key: _by_unit(found) for key, found in _cells(records).items()}  # (config, T, K, B) -> unit -> record
    order = {name: i for i, name in enumerate(records_io.KNOWN_CONFIGS)}
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
                if all(_timed(c[u]) for c in fixed.values())
            )
            if fixed
            else []
        )
        best = None
        if fixed_units:
            rates = {key: _decode_rate(cell[u] for u in fixed_units) for key, cell in fixed.items()}
            known = {key: rate for key, rate in rates.items() if rate is not None}
            best = max(known, key=lambda key: known[key], default=None)
        for (name, k), cell in sorted(here.items(), key=lambda item: (order[item[0][0]], item[0][1])):
            units = sorted(cell)
            columns = _columns(cell, units)
            timed = [u for u in units if _timed(cell[u])]
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
                        _paired_speedup(cell, list(fixed.values()), config) if name in records_io.SV_CONFIGS else None
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
                    drafted_per_emitted=_ratio(columns["drafted"].sum(), columns["new"].sum()) if steps else None,
                    block_efficiency=(
                        1 + columns["accepted"].sum() / columns["row_steps"].sum()
                        if steps and columns["row_steps"].sum() > 0
                        else None
                    ),
                )
            )
    return rows


def _estimate(statistic: Callable, columns: dict, units: list, config: ReportConfig, when: bool = True):
    """``bootstrap`` over the units (batches), or None when there is nothing to estimate."""
    if not when or not units or columns["new"].sum() <= 0 or columns["wall"].sum() <= 0:
        return None
    return bootstrap(statistic, columns, _strata(units), config)


def _paired_speedup(cell: dict, others: list[dict], config: ReportConfig, decode: bool = True) -> Estimate | None:
    """tok/s of ``cell`` over the best tok/s among ``others`` (each unit -> record), on the units all of them
    ran, timed, with the best re-chosen in every resample (so the selection is part of the interval); decode
    time, or with ``decode=False`` whole wall times."""
    if not others or not all(others):
        return None
    units = sorted(u for u in set(cell).intersection(*others) if all(_timed(c[u]) for c in (cell, *others)))
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

    return bootstrap(statistic, columns, _strata(units), config)


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
