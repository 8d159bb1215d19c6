"""Alignment sweep: how the block-vs-token gain depends on draft quality.

The draft samples at its own temperature T_d (``generate(draft_sampling=...)``) while the target keeps T.
Verification sees the distribution the draft actually sampled from, so every T_d is lossless: T_d only
moves the draft away from (or towards) the target, i.e. it changes draft quality and nothing else. For
every (prompt, T_d) one block-verification run records, per step, the exact expected accepted length of
the SAME draft under both rules and the draft-target overlap; the report then gives the paired analytic
gain of block over token verification against the measured overlap.

Glossary (docs/algorithms.md conventions; B, K, V as in ``blockspec.verify``):
    T, T_d      the target's and the draft's sampling temperature (T > 0; T_d = 0 is an argmax draft).
    overlap     sum_v min(q_i(v), p_i(v)) at a verified position i: the acceptance probability of a single
                drafted token under token verification, 1 iff the draft's law q_i equals the target's p_i.
                A record holds one value per step (the mean over that step's verified positions); the report
                averages over all verified positions (steps weighted by their verified length).
    E_token, E_block   E[accepted | this step's draft] under each rule (exact closed forms, no noise).
    analytic BE 1 + mean E over all steps of all prompts (pooled), per rule; both rules score the same drafts.
    gain        paired analytic gain = (1 + mean E_block) / (1 + mean E_token) - 1 = BE block / BE token - 1.
    unit        a prompt, (dataset, prompt_id). Intervals resample prompts, never steps (the steps of one prompt
                share its context), stratified by dataset, with the seeded bootstrap of ``report``.

Only analytic values are used (no wall clock), so one block run per cell serves both rules, and the draws of
a prompt use the same seed at every T_d (common random numbers across the sweep).

Records go to ``<out>/records.jsonl``, one JSON line per (dataset, prompt_id, T_d, K, T); a rerun skips what
is there (a truncated last line is ignored) and ``time_budget`` stops scheduling new runs once spent. Round n
runs prompt n of every dataset through every T_d, so a time-boxed run covers every temperature early.

    run(AlignConfig(...)) -> records file          # or run(config, prompts=[(dataset, id, ids)], models=(t, d))
    build_report(read(file)) -> AlignReport; format_table(report); summary(report); render(report, out_dir)
    python -m blockspec.bench.alignment --records FILE --out DIR   # re-report; the last stdout line is JSON
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

from .. import defaults
from .records import RENAMED, append, refuse_other_settings

if TYPE_CHECKING:  # numpy and the report load only when a report is made: `blockspec --help` stays instant
    from .report import Estimate, ReportConfig

log = logging.getLogger(__name__)

SCHEMA = 2  # schema 1 named max_draft draft_len, and verified draft_lens
KIND = "align"  # tells these records from `blockspec bench` records
RECORDS = "records.jsonl"
ALL = "all"  # dataset label of the rows pooled over every dataset (the same as ``report.ALL``)
# Fields that must agree between the records already in a file and a resumed run: mixing models, precision or
# generation length under one key would silently pool different experiments.
COMPATIBLE = ("target", "draft", "dtype", "chat", "base_seed")


@dataclass(frozen=True)
class AlignConfig:
    """Defaults of the sweep (the CLI reads them from here)."""

    target: str = defaults.TARGET
    draft: str = defaults.DRAFT
    dtype: str = "bfloat16"
    device: str = "cpu"
    datasets: tuple[str, ...] = ("gsm8k", "humaneval", "sharegpt")
    prompts_per_dataset: int = 4
    draft_temperatures: tuple[float, ...] = (0.4, 0.7, 1.0, 1.5, 2.0)
    temperature: float = 1.0  # the target's; > 0 (at 0 the draft proposes its argmax whatever T_d)
    max_draft: int = 4  # K
    max_new_tokens: int = 64
    seed: int = 0  # prompt n of a dataset uses seed + n, at every T_d
    chat: bool = True
    time_budget: float | None = None  # seconds; None = run the whole plan
    out: Path = Path("results/align")
    allow_download: bool = False  # let load_model fetch hub ids missing from the local cache

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"the target temperature must be > 0 for a draft temperature to mean anything, "
                             f"got {self.temperature}")
        if not self.draft_temperatures or not all(t >= 0 for t in self.draft_temperatures):
            raise ValueError(f"draft temperatures must be >= 0 (0 = argmax draft), got {self.draft_temperatures}")
        if len(set(self.draft_temperatures)) != len(self.draft_temperatures):
            raise ValueError(f"draft temperatures repeat: {self.draft_temperatures}")
        if not (isinstance(self.max_draft, int) and self.max_draft >= 1):
            raise ValueError(f"max_draft must be an int >= 1, got {self.max_draft!r}")
        if not (isinstance(self.prompts_per_dataset, int) and self.prompts_per_dataset >= 1):
            raise ValueError(f"prompts per dataset must be an int >= 1, got {self.prompts_per_dataset!r}")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not self.datasets:
            raise ValueError("give at least one dataset")


# ------------------------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class AlignRecord:
    """One block-verification run of one prompt at one draft temperature. Per-step lists are aligned."""

    dataset: str
    prompt_id: str
    draft_temperature: float  # T_d
    max_draft: int  # K
    temperature: float  # T, the target's
    seed: int
    max_new_tokens: int
    new_tokens: int
    finish_reason: str  # "eos" or "length"
    verified: list[int] = field(default_factory=list)  # drafted tokens verified per step (< K near the cap)
    accepted: list[int] = field(default_factory=list)  # tau per step, under the block rule that ran
    expected_token: list[float] = field(default_factory=list)  # E[tau | this step's draft], token rule
    expected_block: list[float] = field(default_factory=list)  # the same draft, block rule
    overlap: list[float | None] = field(default_factory=list)  # per step; None when it verified nothing
    wall_time: float = 0.0  # seconds, for information only (the expected values are computed off the clock)
    meta: dict = field(default_factory=dict)  # models, dtype, device, threads, versions, date
    schema: int = SCHEMA
    kind: str = KIND

    @property
    def key(self) -> tuple:
        return (self.dataset, self.prompt_id, self.draft_temperature, self.max_draft, self.temperature)


def read(path: Path) -> Iterator[AlignRecord]:
    """Records of a JSONL file; unreadable lines (a truncated last line) are skipped."""
    with Path(path).open() as lines:
        for line in lines:
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            if data.get("kind") != KIND or data.get("schema") not in (1, SCHEMA):
                raise ValueError(f"{path}: not an alignment record of schema 1 or {SCHEMA} (kind {data.get('kind')!r}, "
                                 f"schema {data.get('schema')!r}); `blockspec bench` records go to "
                                 "python -m blockspec.bench.report")
            yield AlignRecord(**{RENAMED.get(name, name): value for name, value in data.items()})


# ------------------------------------------------------------------------------------------------ the sweep


@dataclass(frozen=True)
class Cell:
    """One planned run: a prompt (text, or token ids) at one draft temperature."""

    dataset: str
    prompt_id: str
    prompt: str | tuple[int, ...] = field(repr=False)
    draft_temperature: float
    seed: int
    round: int  # the prompt's index within its dataset


def plan(config: AlignConfig, prompts: Iterable[tuple[str, str, str | Sequence[int]]]) -> list[Cell]:
    """Every run, interleaved: round n takes prompt n of every dataset (in order of first appearance) through
    every draft temperature, so a time-boxed run covers all of them. ``prompts``: (dataset, prompt_id, text or
    token ids) items; prompt n of a dataset uses seed + n."""
    by_dataset: dict[str, list[tuple[str, str | tuple[int, ...]]]] = {}
    for dataset, prompt_id, prompt in prompts:
        by_dataset.setdefault(dataset, []).append((prompt_id, prompt if isinstance(prompt, str) else tuple(prompt)))
    rounds = max((len(items) for items in by_dataset.values()), default=0)
    return [
        Cell(dataset, items[n][0], items[n][1], draft_temperature, config.seed + n, n)
        for n in range(rounds)
        for dataset, items in by_dataset.items() if n < len(items)
        for draft_temperature in config.draft_temperatures
    ]


def key_of(config: AlignConfig, cell: Cell) -> tuple:
    return (cell.dataset, cell.prompt_id, cell.draft_temperature, config.max_draft, config.temperature)


def run(config: AlignConfig, *, prompts: Iterable[tuple[str, str, str | Sequence[int]]] | None = None,
        models: tuple | None = None, progress: bool = True) -> Path:
    """Run (or resume) the sweep; returns the records file.

    ``prompts``: (dataset, prompt_id, text or token ids) items instead of ``config.datasets`` (texts go through
    the chat template when ``config.chat``); ``models``: (target, draft) already loaded (LanguageModel adapters
    or transformers models) instead of ``config.target`` / ``config.draft``.
    """
    records_file = config.out / RECORDS
    existing = list(read(records_file)) if records_file.exists() else []
    _check_compatible(existing, config)
    done = {r.key for r in existing}
    if prompts is None:
        from . import datasets

        prompts = [(name, p.id, p.text) for name in config.datasets
                   for p in datasets.load(name, n=config.prompts_per_dataset, seed=config.seed)]
    todo = [c for c in plan(config, prompts) if key_of(config, c) not in done]
    log.info("%d runs planned, %d already recorded", len(todo) + len(done), len(done))
    if not todo:
        return records_file

    executor = _Executor(config, models)
    start, executed = time.perf_counter(), 0
    bar = _progress(len(todo), progress)
    for n, cell in enumerate(todo):
        # Budget checked before each run; the first always goes, so every resumed call makes progress.
        if config.time_budget is not None and executed and time.perf_counter() - start > config.time_budget:
            log.warning("time budget of %.0f s spent: %d runs left for a resumed run", config.time_budget,
                        len(todo) - n)
            break
        bar.set_postfix_str(f"{cell.prompt_id} T_d={cell.draft_temperature:g}", refresh=False)
        append(records_file, executor(cell))
        executed += 1
        bar.update(1)
    bar.close()
    return records_file


def _check_compatible(existing: list[AlignRecord], config: AlignConfig) -> None:
    """Refuse to add runs of other models, dtype, chat setting, seed or length to a file (same keys, other runs)."""
    wanted = {"target": config.target, "draft": config.draft, "dtype": config.dtype, "chat": config.chat,
              "base_seed": config.seed, "max_new_tokens": config.max_new_tokens}
    for record in existing:
        found = {**{name: record.meta.get(name) for name in COMPATIBLE}, "max_new_tokens": record.max_new_tokens}
        refuse_other_settings(config.out / RECORDS, found, wanted)


class _Executor:
    """Loads the models once and turns a cell into an AlignRecord."""

    def __init__(self, config: AlignConfig, models: tuple | None):
        import platform

        import torch

        from .. import __version__
        from ..engine import SpeculativeDecoder

        if models is None:
            from ..models.hf import load_model

            models = tuple(load_model(name, dtype=config.dtype, device=config.device,
                                      allow_download=config.allow_download) for name in (config.target, config.draft))
        self.config = config
        self.decoder = SpeculativeDecoder(*models, verifier="block", max_draft=config.max_draft)
        self.meta = {
            "target": config.target, "draft": config.draft, "dtype": config.dtype, "device": config.device,
            "chat": config.chat, "base_seed": config.seed, "threads": torch.get_num_threads(),
            "machine": platform.platform(),
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "blockspec": __version__,
                         "transformers": _version("transformers")},
        }

    def __call__(self, cell: Cell) -> AlignRecord:
        from datetime import datetime, timezone

        from ..models.chat import encode_prompt
        from ..sampling import SamplingParams

        config = self.config
        ids = list(cell.prompt)
        if isinstance(cell.prompt, str):
            if self.decoder.tokenizer is None:
                raise ValueError("text prompts need a tokenizer: pass token ids, or models with tokenizers")
            ids = encode_prompt(self.decoder.tokenizer, cell.prompt, chat=config.chat)
        result = self.decoder.generate(
            [ids], max_new_tokens=config.max_new_tokens, sampling=SamplingParams(config.temperature),
            draft_sampling=SamplingParams(cell.draft_temperature), seed=cell.seed, expected=True,
        )
        steps = result.stats  # batch 1: one entry per list per step
        return AlignRecord(
            dataset=cell.dataset, prompt_id=cell.prompt_id, draft_temperature=cell.draft_temperature,
            max_draft=config.max_draft, temperature=config.temperature, seed=cell.seed,
            max_new_tokens=config.max_new_tokens, new_tokens=result.new_tokens, finish_reason=result.finish_reasons[0],
            verified=[s.verified[0] for s in steps], accepted=[s.accepted[0] for s in steps],
            expected_token=[s.expected_token[0] for s in steps], expected_block=[s.expected_block[0] for s in steps],
            # NaN (a step that verified nothing) is not JSON: stored as null
            overlap=[None if math.isnan(s.overlap[0]) else s.overlap[0] for s in steps],
            wall_time=result.wall_time,
            meta={**self.meta, "date": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        )


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="align runs", unit="run", disable=not enabled, file=sys.stderr)


# ------------------------------------------------------------------------------------------------ the report

CONVENTION = (
    "Per draft temperature T_d (target at T, K drafted tokens per step, block verification): overlap = mean over "
    "verified positions of sum_v min(draft, target) ({conf:.0f}% CI); analytic BE = 1 + mean per-step exact "
    "E[accepted | draft] under each rule, pooled over all steps, the same drafts for both rules; gain = analytic "
    "BE block / analytic BE token - 1, with a {conf:.0f}% percentile bootstrap CI resampling prompts (stratified "
    "by dataset; none until every dataset has 2 prompts), {n_boot} resamples, seed {seed}; measured BE block = 1 + "
    "mean accepted of the block runs"
)


@dataclass(frozen=True)
class AlignRow:
    """One (dataset or ALL, T, K, T_d) cell of the report."""

    dataset: str
    temperature: float
    max_draft: int
    draft_temperature: float
    prompts: int
    steps: int
    overlap: Estimate | None  # None when no position was verified
    analytic_be_token: float | None
    analytic_be_block: float | None
    gain: Estimate | None  # the paired analytic gain
    be_block: float | None  # measured: 1 + mean accepted of the block runs


@dataclass(frozen=True)
class AlignReport:
    datasets: tuple[str, ...]
    rows: tuple[AlignRow, ...]  # per (T, K): every dataset, then ALL; T_d ascending within each
    n_records: int
    config: ReportConfig

    def rows_of(self, dataset: str) -> list[AlignRow]:
        return [row for row in self.rows if row.dataset == dataset]


def _unit_columns(records: list[AlignRecord]) -> dict:
    """Per-prompt sums [P]: the bootstrap's columns."""
    import numpy as np

    def column(values) -> np.ndarray:
        return np.array(list(values), float)

    return {
        "exp_t": column(sum(r.expected_token) for r in records),
        "exp_b": column(sum(r.expected_block) for r in records),
        "steps": column(len(r.expected_token) for r in records),
        "accepted": column(sum(r.accepted) for r in records),
        # overlap weighted by the verified length of its step: a mean over verified positions
        "overlap": column(sum(o * k for o, k in zip(r.overlap, r.verified) if o is not None) for r in records),
        "verified": column(sum(k for o, k in zip(r.overlap, r.verified) if o is not None) for r in records),
    }


def _row(label: str, records: list[AlignRecord], temperature: float, max_draft: int, draft_temperature: float,
         config) -> AlignRow:
    import numpy as np

    from .report import bootstrap

    records = sorted(records, key=lambda r: (r.dataset, r.prompt_id))
    if any(len(r.expected_token) != len(r.expected_block) for r in records):
        raise ValueError(f"{label} T_d={draft_temperature:g}: expected_token and expected_block differ in length")
    columns = _unit_columns(records)
    strata = np.array([r.dataset for r in records])
    steps, verified = columns["steps"].sum(), columns["verified"].sum()
    return AlignRow(
        dataset=label, temperature=temperature, max_draft=max_draft, draft_temperature=draft_temperature,
        prompts=len(records), steps=int(steps),
        overlap=bootstrap(lambda s: s["overlap"] / s["verified"], columns, strata, config) if verified else None,
        analytic_be_token=1 + columns["exp_t"].sum() / steps if steps else None,
        analytic_be_block=1 + columns["exp_b"].sum() / steps if steps else None,
        gain=bootstrap(lambda s: (s["steps"] + s["exp_b"]) / (s["steps"] + s["exp_t"]) - 1, columns, strata, config)
        if steps else None,
        be_block=1 + columns["accepted"].sum() / steps if steps else None,
    )


def build_report(records: Iterable[AlignRecord], config=None) -> AlignReport:
    """Rows per (T, K): every dataset, then all datasets pooled (``ALL``), each at every draft temperature."""
    from .report import ReportConfig

    config = config or ReportConfig()
    unique: dict[tuple, AlignRecord] = {}
    for record in records:
        if record.key in unique:
            log.warning("duplicate record %s: keeping the first", record.key)
            continue
        unique[record.key] = record
    found = list(unique.values())
    datasets = tuple(sorted({r.dataset for r in found}))
    rows = []
    for temperature, max_draft in sorted({(r.temperature, r.max_draft) for r in found}):
        here = [r for r in found if (r.temperature, r.max_draft) == (temperature, max_draft)]
        for label in (*datasets, ALL):
            group = [r for r in here if label in (ALL, r.dataset)]
            for draft_temperature in sorted({r.draft_temperature for r in group}):
                cell = [r for r in group if r.draft_temperature == draft_temperature]
                rows.append(_row(label, cell, temperature, max_draft, draft_temperature, config))
    return AlignReport(datasets, tuple(rows), len(found), config)


HEADER = ("T", "K", "T_d", "prompts", "steps", "overlap (CI)", "analytic BE token", "analytic BE block",
          "gain block vs token (CI)", "measured BE block")


def _cells(row: AlignRow) -> list[str]:
    from .report import _interval, _num, _percent

    return [f"{row.temperature:g}", str(row.max_draft), f"{row.draft_temperature:g}", str(row.prompts),
            str(row.steps), _interval(row.overlap), _num(row.analytic_be_token), _num(row.analytic_be_block),
            _percent(row.gain), _num(row.be_block)]


def format_table(report: AlignReport) -> str:
    """Markdown: the convention, the table pooled over datasets, then one table per dataset."""
    from .report import _markdown

    cfg = report.config
    parts = ["# alignment sweep: block-vs-token gain vs draft-target overlap",
             CONVENTION.format(conf=100 * cfg.confidence, n_boot=cfg.n_boot, seed=cfg.seed) + "."]
    for label in (ALL, *report.datasets):
        body = [_cells(row) for row in report.rows_of(label)]
        if body:
            title = "all datasets pooled" if label == ALL else f"dataset: {label}"
            parts.append(f"## {title}\n\n{_markdown(HEADER, body)}")
    return "\n\n".join(parts)


def summary(report: AlignReport) -> dict:
    """The JSON summary (the last stdout line of the CLI): the rows pooled over datasets."""
    cfg = report.config
    return {
        "convention": CONVENTION.format(conf=100 * cfg.confidence, n_boot=cfg.n_boot, seed=cfg.seed),
        "confidence": cfg.confidence, "n_boot": cfg.n_boot, "seed": cfg.seed,
        "records": report.n_records, "datasets": list(report.datasets),
        "pooled": [asdict(row) for row in report.rows_of(ALL)],
    }


def plot(report: AlignReport, path: Path) -> Path:
    """Gain (with its CI) vs mean overlap, one point per draft temperature (labelled T_d on the pooled
    series), one series per dataset and the pooled one in black; one panel per (T, K)."""
    from .report import new_figure

    panels = sorted({(row.temperature, row.max_draft) for row in report.rows})
    figure, axes = new_figure(len(panels), "paired analytic block-vs-token gain vs draft-target overlap")
    for ax, (temperature, max_draft) in zip(axes, panels):
        ax.axhline(0.0, color="grey", lw=0.8)
        for index, label in enumerate((*report.datasets, ALL)):
            rows = [r for r in report.rows_of(label) if (r.temperature, r.max_draft) == (temperature, max_draft)
                    and r.gain is not None and r.overlap is not None]
            if not rows:
                continue
            pooled = label == ALL
            xs, ys = [r.overlap.value for r in rows], [100 * r.gain.value for r in rows]
            ax.errorbar(xs, ys, xerr=_errors(r.overlap for r in rows), yerr=_errors((r.gain for r in rows), 100),
                        fmt="s-" if pooled else "o--", color="black" if pooled else f"C{index}", capsize=3,
                        lw=2 if pooled else 1, alpha=1 if pooled else 0.7, label="pooled" if pooled else label)
            if pooled:
                for n, (row, x, y) in enumerate(zip(rows, xs, ys)):  # labels alternate above / below
                    ax.annotate(f"T_d={row.draft_temperature:g}", (x, y), textcoords="offset points",
                                xytext=(5, 5 if n % 2 == 0 else -13), fontsize=8)
        ax.set(title=f"T={temperature:g}, K={max_draft} (bars: bootstrap CI over prompts)",
               xlabel="mean overlap sum_v min(draft, target) per verified position",
               ylabel="block vs token gain, analytic (%)")
        ax.legend(fontsize=7)
    figure.savefig(path, dpi=110)
    return path


def _errors(estimates, scale: float = 1.0) -> list[list[float]]:
    """Asymmetric error bars [[below...], [above...]] (0 where there is no interval)."""
    below, above = [], []
    for e in estimates:
        below.append(0.0 if e.lo is None else scale * (e.value - e.lo))
        above.append(0.0 if e.hi is None else scale * (e.hi - e.value))
    return [below, above]


def render(report: AlignReport, out_dir: Path, plots: bool = True) -> list[Path]:
    """Write alignment.md (the tables), alignment.json (the summary) and, if ``plots``,
    alignment_gain_vs_overlap.png; return the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "alignment.md", out_dir / "alignment.json"]
    written[0].write_text(format_table(report) + "\n")
    written[1].write_text(json.dumps(summary(report), indent=1) + "\n")
    if plots and report.rows:
        written.append(plot(report, out_dir / "alignment_gain_vs_overlap.png"))
    log.info("alignment report written: %s", ", ".join(str(p) for p in written))
    return written


def main(argv: list[str] | None = None) -> int:
    from .report import ReportTool, run_tool

    return run_tool(ReportTool(
        prog="python -m blockspec.bench.alignment",
        description="Table and plot of the alignment sweep (`blockspec align`) from its saved records: block-vs-token "
        "gain against draft-target overlap per draft temperature. The last stdout line is a JSON summary.",
        outputs="alignment.md, alignment.json and the plot", read=read, build_report=build_report,
        format_table=format_table, summary=summary, render=render,
    ), argv)


if __name__ == "__main__":
    sys.exit(main())
