"""The benchmark runner: the same prompts and seeds through every configuration, interleaved, resumable.

For each dataset and temperature, prompt by prompt (or batch by batch), every configuration runs in turn
(A B C A B C ...), so machine drift affects them alike; each variant is warmed up once before its first run.
Records go to ``<out>/records.jsonl`` as they are made; a rerun skips what is there, and ``time_budget`` stops
scheduling new runs once spent. docs/guide/bench.md describes the configurations, batches, resuming and failures.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .. import defaults, machine
from ..files import write_atomic
from . import provenance
from . import records as rec
from .executor import AUTO_DRAFT, NO_DRAFT, Executor, draft_quant_of, tree_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchConfig:
    target: str = defaults.TARGET
    draft: str = defaults.DRAFT
    dtype: str = "auto"  # or a dtype name; auto: what auto.choose_arithmetic measured fastest here
    target_quant: str | None = None  # "int8": every configuration decodes the quantized target (models.quant)
    device: str = "cpu"
    datasets: tuple[str, ...] = ("gsm8k", "humaneval", "sharegpt")
    prompts_per_dataset: int = 2
    max_drafts: tuple[int, ...] = (4, 8)  # K: the most tokens a step drafts, one run per value where fixed
    temperatures: tuple[float, ...] = (1.0,)
    # any of rec.KNOWN_CONFIGS, trees ("tree-2,1,1": rec.TREE) and paths ("paths-3", "paths-iid-3": rec.PATHS)
    configs: tuple[str, ...] = rec.CONFIGS
    max_new_tokens: int = 64
    seed: int = 0
    chat: bool = True
    time_budget: float | None = None  # seconds; None = run the whole plan
    # stop the batch-1 runs once every paired analytic gain is known to +- this (checked per round); batched
    # runs go on
    precision: float | None = None
    out: Path = Path("results/bench")
    batch_sizes: tuple[int, ...] = (1,)  # prompts decoded together per run
    companion: str = defaults.COMPANION  # SV companion: prefix:K or a model sharing the target's tokenizer
    sv_profile: Path | None = None  # SV calibration profile; None = `blockspec sv calibrate`'s, per temperature
    latency: Path | None = None  # SV latency profile; None = `blockspec sv profile`'s for these models and device
    retry_failed: bool = False  # rerun the runs recorded as failed (a resume skips them otherwise)
    allow_download: bool = False  # let load_model fetch hub ids missing from the local cache
    # T_d: the draft's own temperatures, each run by the fixed-K configurations; empty: the target's temperature
    draft_temperatures: tuple[float, ...] = ()
    # who runs the models: "hf" (transformers), "llamacpp" (llama.cpp, presets and GGUF files, CPU), or "auto"
    # (models.load.resolve_backend: llama.cpp for the bundled GGUF pair on a CPU, as `blockspec generate` runs it,
    # leaving out the configurations only transformers runs, rec.TRANSFORMERS_ONLY; transformers otherwise)
    backend: str = "auto"

    def __post_init__(self):
        unknown = sorted(name for name in self.configs if not rec.is_known(name))
        if unknown:
            raise ValueError(
                f"unknown bench configurations {unknown}: choose from {list(rec.KNOWN_CONFIGS)}, a tree "
                f"({rec.TREE}SHAPE, e.g. {rec.TREE}2,1,1) or paths ({rec.PATHS}K or {rec.PATHS}iid-K)"
            )
        for name in filter(rec.is_tree, self.configs):
            written = rec.tree_config(tree_of(name))  # ValueError for a shape the library refuses
            if written != name:  # one name per shape, so that its records share one key
                raise ValueError(f"write the bench configuration {name!r} as {written!r}")
        from ..checks import path_layout

        for name in filter(rec.is_paths, self.configs):
            paths, drawn = rec.paths_of(name)
            if rec.paths_config(paths, drawn) != name:  # one name per configuration (paths-03 is paths-3)
                raise ValueError(f"write the bench configuration {name!r} as {rec.paths_config(paths, drawn)!r}")
            for length in self.max_drafts:  # ValueError for more nodes than a step may draft
                path_layout(paths, length, drawn)
        if not self.batch_sizes or not all(isinstance(b, int) and b >= 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be ints >= 1, got {self.batch_sizes}")
        if max(self.batch_sizes) > self.prompts_per_dataset:
            raise ValueError(
                f"batch size {max(self.batch_sizes)} needs at least {max(self.batch_sizes)} prompts per dataset, "
                f"not {self.prompts_per_dataset}: raise --prompts or lower --batch-sizes"
            )
        if self.draft_temperatures:
            if not all(t > 0 for t in self.temperatures):
                raise ValueError(
                    f"the target temperature must be > 0 for a draft temperature to mean anything "
                    f"(at 0 the draft proposes its argmax), got {self.temperatures}"
                )
            if not all(t >= 0 for t in self.draft_temperatures):
                raise ValueError(f"draft temperatures must be >= 0 (0 = argmax draft), got {self.draft_temperatures}")
            if len(set(self.draft_temperatures)) != len(self.draft_temperatures):
                raise ValueError(f"draft temperatures repeat: {self.draft_temperatures}")
            if self.batch_sizes != (1,):
                raise ValueError(f"draft temperatures are run at batch size 1 only, not {self.batch_sizes}")
            if not set(self.configs) & set(rec.FIXED_CONFIGS):
                raise ValueError(
                    f"draft temperatures apply to the fixed-length configs ({', '.join(rec.FIXED_CONFIGS)})"
                    f" only, and none is run: {', '.join(self.configs)}"
                )


PRESETS = {
    # The bundled pair, 3 datasets, a few prompts each, K in {4, 8}, temperature 1, on the backend generate runs.
    "quick": BenchConfig(),
    # The paper's grid: every dataset, K in {2, 4, 6, 8}, greedy and sampled; resumable, in several parts.
    "paper": BenchConfig(
        datasets=("gsm8k", "translation", "humaneval", "sharegpt", "summarize", "lm1b"),
        prompts_per_dataset=20,
        max_drafts=(2, 4, 6, 8),
        temperatures=(1.0, 0.0),
        max_new_tokens=128,
        time_budget=3 * 3600.0,
        precision=0.01,
        backend="hf",
    ),
    # Speculative Verification: target-only, token and block at K in {2, 4, 8}, and SV with the
    # draft-only and the companion predictor (at most 8 drafted tokens), at batch sizes 1 to 64, on prompt
    # sets disjoint from `blockspec sv calibrate`'s default (sharegpt). Long: resumable, at most 3 h per call.
    "sv": BenchConfig(
        datasets=("gsm8k", "humaneval"),
        prompts_per_dataset=64,
        max_drafts=(2, 4, 8),
        batch_sizes=(1, 4, 16, 32, 64),
        configs=("target-only", "token", "block", "sv-draft", "sv-token", "sv-block"),
        time_budget=3 * 3600.0,
        backend="hf",
    ),
    # The alignment sweep (`blockspec align`): block at K = 4 with the draft at five temperatures of its own, the
    # target at 1; what it measures needs no wall clock (expected accepted lengths, overlap).
    "align": BenchConfig(**{**defaults.ALIGN, "out": Path(defaults.ALIGN["out"]), "backend": "hf"}),
}


@dataclass(frozen=True)
class Run:
    """One planned generation: a batch of consecutive prompts (one at batch size 1) through one configuration."""

    dataset: str
    prompt_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...] = field(repr=False)  # token ids, one tuple per row
    config: str
    max_draft: int  # K; 0 for target-only, lookup, hf-assisted and hf-lookup
    temperature: float
    seed: int  # row b uses seed + b
    round: int = 0  # batch index within its dataset and batch size; runs are interleaved round by round
    draft_temperature: float | None = None  # T_d; None: the draft samples at ``temperature``

    @property
    def prompt_id(self) -> str:
        return self.prompt_ids[0]

    @property
    def batch_size(self) -> int:
        return len(self.prompt_ids)

    @property
    def key(self) -> tuple:
        return (
            self.dataset,
            self.prompt_id,
            self.config,
            self.max_draft,
            self.temperature,
            self.batch_size,
            self.draft_temperature,
        )


def max_drafts_of(config: BenchConfig, name: str) -> tuple[int, ...]:
    """The K values a configuration runs at: every K for fixed-K SD, the largest for SV and the model-drafting
    defaults (their most), none (0) otherwise."""
    if name in rec.FIXED_CONFIGS or rec.is_paths(name):  # paths: their length
        return config.max_drafts
    if rec.is_tree(name):  # its nodes: what it drafts each step
        from ..checks import tree_nodes

        return (tree_nodes(tree_of(name)),)
    if name in rec.SV_CONFIGS or name in AUTO_DRAFT:
        return (max(config.max_drafts),)
    return (0,)


def plan(config: BenchConfig, prompts: dict[str, list[tuple[str, list[int]]]]) -> list[Run]:
    """Every run, interleaved: round n takes batch n (prompt n at batch size 1) of every dataset, at every batch
    size, at every temperature, through all configurations in turn (the fixed-K ones at every draft temperature);
    so a run cut short by its budget still covers every dataset, batch size, configuration and draft
    temperature."""
    batch_sizes = sorted(set(config.batch_sizes))
    short = {dataset: len(items) for dataset, items in prompts.items() if len(items) < batch_sizes[-1]}
    if short:
        raise ValueError(
            f"batch size {batch_sizes[-1]} needs at least {batch_sizes[-1]} prompts per dataset; "
            f"these have fewer: {short}"
        )
    for batch_size in batch_sizes:
        for dataset, items in prompts.items():
            if len(items) % batch_size:
                log.warning(
                    "%s: the last %d of %d prompts do not fill a batch of %d and are left out at that size",
                    dataset,
                    len(items) % batch_size,
                    len(items),
                    batch_size,
                )
    runs = []
    rounds = max((len(items) for items in prompts.values()), default=0)  # batch size 1 has the most
    for n in range(rounds):
        for batch_size in batch_sizes:
            first = n * batch_size  # index of the batch's first prompt
            for dataset, items in prompts.items():
                if first + batch_size > len(items):
                    continue
                batch = items[first : first + batch_size]
                ids, rows = tuple(i for i, _ in batch), tuple(tuple(p) for _, p in batch)
                seed = config.seed + first  # prompt i uses seed + i in every configuration and at every B
                for temperature in config.temperatures:
                    for name in config.configs:
                        if name in rec.HF_CONFIGS and batch_size > 1:
                            continue  # transformers' assisted generation decodes one row
                        draft_temperatures = (
                            (config.draft_temperatures or (None,)) if name in rec.FIXED_CONFIGS else (None,)
                        )
                        runs.extend(
                            Run(dataset, ids, rows, name, k, temperature, seed, n, draft_temperature)
                            for k in max_drafts_of(config, name)
                            for draft_temperature in draft_temperatures
                        )
    return runs


RECORDS, CONFIG = "records.jsonl", "config.json"
# BenchConfig fields a resume may change: they steer how much runs (budget, precision, retries, downloads, where),
# or only select which runs are planned, each recorded under its own key (nested prompt samples: more prompts
# add prompts, the first ones keep their seeds). Every other field, and the machine's facts, must match.
RESUMABLE = (
    "time_budget",
    "precision",
    "retry_failed",
    "allow_download",
    "out",
    "datasets",
    "prompts_per_dataset",
    "max_drafts",
    "temperatures",
    "configs",
    "batch_sizes",
    "draft_temperatures",
)


def settings(config: BenchConfig) -> dict:
    """What ``<out>/config.json`` holds: every field of ``config`` and the machine's facts, as JSON values."""
    return json.loads(json.dumps({**asdict(config), **machine.facts()}, default=str))


def make_out(out: Path) -> None:
    """Make the run directory ``out``; ValueError when it cannot be one."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file: --out must be a directory (a new one, or a bench's to resume)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # e.g. a parent is a file
        raise ValueError(f"cannot make the output directory {out}: {error}") from None


def prepare_out(config: BenchConfig) -> tuple[list[rec.Record], dict | None]:
    """Check ``config.out`` before any model loads: return the records already in it and the settings stored with
    them (None when it holds none). Raises ValueError when it holds records of other settings, with no stored
    settings, or with settings stored by a blockspec that did not store what they resolved to (``rec.read``
    refuses records of another schema)."""
    out = config.out
    existing = list(rec.read(out / RECORDS)) if (out / RECORDS).exists() else []
    if not existing:
        return existing, None
    if not (out / CONFIG).exists():
        raise ValueError(
            f"{out} holds records but no {CONFIG}: their settings are unknown, so they cannot be resumed: use "
            "a new --out (they can still be reported: python -m blockspec.bench.report)"
        )
    try:
        found = json.loads((out / CONFIG).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{out / CONFIG} is unreadable ({error}): use a new --out") from None
    wanted = settings(config)
    rec.refuse_other_settings(out, found, {k: v for k, v in wanted.items() if k not in RESUMABLE})
    if "resolved" not in found:
        raise ValueError(
            f"{out} was made by an older blockspec, which did not store the dtype, library versions and model "
            "fingerprints its runs resolved to, so a resume cannot check them: finish it with that version, or use "
            "a new --out (its records can still be reported: python -m blockspec.bench.report)"
        )
    return existing, found


def store_settings(config: BenchConfig, found: dict | None, resolved: dict) -> dict:
    """Refuse to add runs that resolved otherwise than the ones stored (``found``, ``provenance.check``), then
    store this call's settings and what they resolved to in ``<out>/config.json``, whole or not at all, and return
    that: with the draft quantization of configurations and the draft's fingerprint stored before and not resolved
    in this call, for the next resume to check."""
    if found is not None:
        stored = found["resolved"]
        provenance.check(config.out, stored, resolved)
        resolved = {**resolved, **{key: {**stored[key], **resolved[key]} for key in provenance.COMPARED_ON_SHARED_KEYS}}
    write_atomic(config.out / CONFIG, json.dumps({**settings(config), "resolved": resolved}, indent=1) + "\n")
    return resolved


def stored_arithmetic(config: BenchConfig, stored: dict):
    """The ``auto.Arithmetic`` of a resume under ``--dtype auto``: the dtype and auto draft quantization the
    directory's runs resolved to (``stored``), not what a probe picks now (a busy machine may pick otherwise), so
    its runs are not pooled with others of other arithmetic. The probe decides only the draft quantization of the
    auto configurations where the directory has run none. Refused (ValueError) where they ran with different ones,
    as a bench whose auto-tree drafted with the unquantized draft did: no one choice extends them all."""
    from ..auto import Arithmetic, choose_arithmetic
    from ..models.load import resolve_device

    drafted = {name: quant for name, quant in stored["draft_quant"].items() if name in AUTO_DRAFT}
    quants = set(drafted.values())
    if len(quants) > 1:
        each = ", ".join(f"{name} {quant or 'unquantized'}" for name, quant in sorted(drafted.items()))
        raise ValueError(
            f"the runs in {config.out} drafted the auto configurations with different draft quantizations ({each}): "
            "they cannot be extended as one run; report them as they are, or run into a new --out"
        )
    if not quants and set(config.configs) & set(AUTO_DRAFT):
        quants = {choose_arithmetic(resolve_device(config.device)).draft_quant}
    quant = quants.pop() if quants else None
    reason = f"{stored['dtype']}, {quant or 'unquantized'} auto draft, as resolved by the runs in {config.out}"
    log.info("arithmetic: %s", reason)
    return Arithmetic(stored["dtype"], quant, reason, None)


MIN_PROMPTS = 5  # per dataset, before a bootstrap interval is trusted to stop a run


def gain_is_known(records_file: Path, precision: float) -> bool:
    """Whether every pooled paired analytic block-vs-token gain has a confidence half-width <= precision, with
    at least MIN_PROMPTS prompts of every dataset at every temperature behind it (so a run resumed at a new
    temperature is not stopped by the records of another)."""
    from .report import build_report, summary

    records = [r for r in rec.read(records_file) if r.batch_size == 1 and r.ok and r.draft_temperature is None]
    prompts = Counter(
        (t, dataset)
        for t, dataset, _ in {(r.temperature, r.dataset, r.prompt_id) for r in records if r.config == "block"}
    )
    if not prompts or min(prompts.values()) < MIN_PROMPTS:
        return False
    rows = summary(build_report(records))["summary"]
    widths = [
        (r["analytic_gain"]["hi"] - r["analytic_gain"]["lo"]) / 2
        for r in rows
        if r["analytic_gain"] and r["analytic_gain"]["lo"] is not None
    ]
    return bool(widths) and len(widths) == len(rows) and max(widths) <= precision


def run(config: BenchConfig, *, progress: bool = True) -> Path:
    """Run (or resume) the plan of ``config``, one process at a time per run directory (``rec.one_writer``);
    returns the records file."""
    make_out(config.out)
    with rec.one_writer(config.out):
        return _run(config, progress)


def _run(config: BenchConfig, progress: bool) -> Path:
    from ..auto import choose_arithmetic
    from ..models.base import check_shared_vocabulary, target_vocabulary
    from ..models.chat import encode_prompt
    from ..models.load import load_model, resolve_backend, resolve_device
    from . import datasets

    config = on_backend(config, resolve_backend(config.backend, config.device, config.target, config.draft))
    backend = config.backend
    existing, found = prepare_out(config)
    records_file = config.out / RECORDS
    done = {r.key for r in existing if r.ok or not config.retry_failed}
    failed = rec.still_failed(existing)
    if failed and not config.retry_failed:
        log.warning("%d runs failed before and are not retried (retry_failed reruns them)", len(failed))
    arithmetic = None
    if backend == "llamacpp":
        arithmetic = llamacpp_arithmetic(config)
    elif config.dtype == "auto" and found is not None:
        arithmetic = stored_arithmetic(config, found["resolved"])
    elif config.dtype == "auto" or set(config.configs) & set(AUTO_DRAFT):
        arithmetic = choose_arithmetic(resolve_device(config.device))
        log.info("arithmetic: %s", arithmetic.reason)
    dtype = arithmetic.dtype if arithmetic is not None and config.dtype == "auto" else config.dtype
    resolved = provenance.resolve(config, backend, dtype, arithmetic)
    downloads = None in resolved["models"].values()  # a hub id whose weights the load downloads: fingerprinted after
    if not downloads:
        resolved = store_settings(config, found, resolved)
    target = load_model(
        config.target,
        dtype=dtype,
        device=config.device,
        quant=config.target_quant,
        allow_download=config.allow_download,
        backend=backend,
    )
    drafts = {
        quant: load_model(
            config.draft,
            dtype=dtype,
            device=config.device,
            quant=quant,
            allow_download=config.allow_download,
            backend=backend,
        )
        for quant in {draft_quant_of(name, arithmetic) for name in config.configs if name not in NO_DRAFT}
    }
    for draft in drafts.values():  # before any run: with a draft of another vocabulary, every run would fail
        check_shared_vocabulary(target, draft, target_vocabulary(target), "draft")
    if downloads:
        resolved = store_settings(config, found, provenance.resolve(config, backend, dtype, arithmetic))
    prompts = {
        name: [
            (p.id, encode_prompt(target.tokenizer, p.text, chat=config.chat))
            for p in datasets.load(name, n=config.prompts_per_dataset, seed=config.seed)
        ]
        for name in config.datasets
    }
    todo = [r for r in plan(config, prompts) if r.key not in done]
    log.info("%d runs planned, %d already recorded", len(todo) + len(done), len(done))
    if not todo:
        return records_file

    executor = Executor(target, drafts, config, resolved, arithmetic)
    start, executed, skipped, precise = time.perf_counter(), 0, 0, False
    bar = Progress(len(todo), progress)
    for n, item in enumerate(todo):
        # Budget checked before each run; the first always goes, so every resumed call makes progress.
        if config.time_budget is not None and executed and time.perf_counter() - start > config.time_budget:
            log.warning(
                "time budget of %.0f s spent: %d runs left for a resumed run",
                config.time_budget,
                len(todo) - n - skipped,
            )
            break
        new_round = n and item.round != todo[n - 1].round
        if config.precision is not None and new_round and not precise and gain_is_known(records_file, config.precision):
            precise = True
            log.warning(
                "block-vs-token gain known to +-%.3f: no more batch-1 runs (%d left out)",
                config.precision,
                sum(r.batch_size == 1 for r in todo[n:]),
            )
        if precise and item.batch_size == 1:
            skipped += 1
            bar.update(1)
            continue
        try:
            record = executor(item)
        except Exception as error:  # one failing run must not end the bench (Ctrl-C is no Exception: it stops it)
            log.error("run %s failed: %s: %s", item.key, type(error).__name__, error)
            log.debug("the failed run's traceback", exc_info=True)
            record = executor.failed(item, error)
        rec.append(records_file, record)
        executed += 1
        bar.update(1, record)
    bar.close()
    return records_file


def on_backend(config: BenchConfig, backend: str) -> BenchConfig:
    """``config`` as it runs on ``backend``, the one ``config.backend`` resolved to: where "auto" resolved to
    llama.cpp, without the configurations only transformers runs (``rec.TRANSFORMERS_ONLY``), said in a warning;
    ValueError where none is left. A backend given by name keeps every configuration (llama.cpp refuses those it
    cannot run: ``llamacpp_arithmetic``)."""
    left_out = [name for name in config.configs if name in rec.TRANSFORMERS_ONLY]
    if config.backend != "auto" or backend != "llamacpp" or not left_out:
        return replace(config, backend=backend)
    configs = tuple(name for name in config.configs if name not in left_out)
    if not configs:
        raise ValueError(f"{', '.join(left_out)} run on transformers only: add --backend hf")
    log.warning(
        "on llama.cpp (the backend for these models on this device): leaving out %s, which only transformers runs; "
        "--backend hf runs every configuration on transformers",
        ", ".join(left_out),
    )
    return replace(config, backend=backend, configs=configs)


def llamacpp_arithmetic(config: BenchConfig):
    """The ``auto.Arithmetic`` of a bench on llama.cpp: the GGUF's own types, the auto and SV configurations' draft in
    q4_0 (what ``blockspec generate`` runs there); refuses what only transformers runs, before any model loads: its
    baselines, the int8 draft, and SV's companion, built from the target's transformers layers."""
    from ..auto import Arithmetic
    from ..defaults import LLAMACPP_DTYPE, LLAMACPP_QUANTS

    only_hf = sorted(set(config.configs) & set(rec.TRANSFORMERS_ONLY))
    if only_hf or config.target_quant is not None:
        raise ValueError(
            f"{', '.join(only_hf) or '--target-quant'} run on transformers only: leave them out with --backend llamacpp"
        )
    return Arithmetic(
        LLAMACPP_DTYPE, LLAMACPP_QUANTS[0], "llama.cpp: the GGUF's own types, the auto draft in q4_0", None
    )


class Progress:
    """Progress on stderr: a bar in a terminal; elsewhere (a log file) one line per finished run."""

    def __init__(self, total: int, enabled: bool):
        from tqdm.auto import tqdm

        self.total, self.done = total, 0
        self.lines = enabled and not sys.stderr.isatty()
        self.bar = tqdm(total=total, desc="bench runs", unit="run", disable=not enabled or self.lines, file=sys.stderr)

    def update(self, n: int, record: rec.Record | None = None) -> None:
        self.done += n
        self.bar.update(n)
        if self.lines and record is not None:
            outcome = (
                f"{record.new_tokens} tokens in {record.wall_time:.1f} s" if record.ok else f"failed: {record.error}"
            )
            draft = "" if record.draft_temperature is None else f" T_d={record.draft_temperature:g}"
            print(
                f"bench run {self.done}/{self.total}: {record.prompt_id} {record.config} K={record.max_draft} "
                f"T={record.temperature:g}{draft} B={record.batch_size}: {outcome}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        self.bar.close()
