"""Machine-aware defaults: the arithmetic the models run in, and how far to speculate, from measurements made
on the machine that decodes (once, then cached), never from a guess: speculation that pays on one machine can be
slower than the target alone on another (docs/results.md).

- ``choose_arithmetic(device)``: the target's dtype and whether to quantize the draft (a timed probe on the CPU).
- ``latency_probe(target, draft, batch)``: the models' own step latency at this batch size, which
  ``policy.AdaptiveLength`` turns into a draft length each step; ``adaptive_policy`` is that policy, or None.
- ``lookup_latency(target, batch)``: the target's step latency, which ``PromptLookup`` prices its proposals by.
- ``default_decoder(target, draft)``: what ``blockspec generate`` decodes with by default, built from those probes.
- ``measure_profile(target, draft, companion)``: the latency profile itself (what ``blockspec sv profile`` saves).

What each probe measures and how it is cached: docs/guide/cli.md ("Defaults follow the machine").
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from . import machine
from .defaults import ADAPTIVE_MAX_DRAFT, CATCH_UP_HORIZON, LOOKUP_MAX_DRAFT, RULE, SV_BATCH_SIZES
from .files import write_atomic
from .models.base import model_name
from .models.cache import PROBES, cache_root
from .policy import AdaptiveLength, LatencyTable
from .policy.latency import DRAFT_TOKENS, LatencyProfile, dtype_name, kernels, table_dict, table_from_dict
from .policy.profiles import latency_path, sv_dir
from .sampling import SamplingParams, process, sample

log = logging.getLogger(__name__)

PROBE_SCHEMA = 1
INT8_MARGIN = 1.25  # int8 must be this much faster to be chosen: its acceptance cost is small but not zero
PROBE_SHAPE = (8960, 1536)  # the 1.5B's MLP up/gate projection, [out, in]
PROBE_MATRICES = 6
PROBE_TOKENS = (1, 4)  # a plain step and a short verification
# Timed rounds of each width in the step-latency probes. A slow phase of a shared machine can lengthen a few
# forwards in a row by a third; with 2 rounds (whose median is their mean) one such forward moved the bundled
# target's 2-token/1-token cost ratio on llama.cpp from 1.8 to 1.45-1.6, and prompt lookup then proposed where it
# loses. The median of 5 resists two slow rounds.
LATENCY_REPEATS = 5
# The probes' method, in their cache files' names: a probe cached by an earlier method is measured again.
# 1: 2 rounds, widths ascending. 2: LATENCY_REPEATS rounds, widths descending (``time_forwards``). 3: the draft's
# forward computes its last position's logits alone, as the draft catching up does (``step_seconds``). 4: the draft
# over 8 and 32 tokens too (``DRAFT_TOKENS``), the catch-ups ``AdaptiveLength`` prices.
LATENCY_METHOD = 4
PROBE_CONTEXT = 128  # cached tokens per row while the step-latency probes time
BUSY_CORES = 0.25  # other processes' CPU use (in cores) above which a probe is not cached


@dataclass(frozen=True)
class Arithmetic:
    """What the models run in on this machine, and why."""

    dtype: str  # the target's (and an unquantized draft's) dtype
    draft_quant: str | None  # "int8" or None
    reason: str  # one line for logs and `blockspec env`
    probe: dict | None  # the CPU probe's milliseconds per pass, {"bfloat16": {"1": ms, "4": ms}, ...}; None on CUDA


def native_bf16() -> bool:
    """Whether the CPU computes in bfloat16 natively (AVX-512-BF16 or AMX), as oneDNN sees it."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def choose_arithmetic(device: torch.device | str = "cpu", *, refresh: bool = False) -> Arithmetic:
    """The target's dtype and whether to quantize the draft on ``device``. On the CPU, the faster of bfloat16 and
    float32 in ``cpu_probe`` (measured again with ``refresh``), with an int8 draft where int8 is at least
    ``INT8_MARGIN`` faster still; on CUDA bfloat16 where supported, else float16, never quantized; elsewhere
    float32."""
    device = torch.device(device)
    if device.type == "cuda":
        dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return Arithmetic(dtype, None, f"CUDA: {dtype}, no draft quantization", None)
    if device.type != "cpu":
        return Arithmetic("float32", None, f"{device.type}: float32", None)
    ms = cpu_probe(refresh=refresh)
    dtype = min(("bfloat16", "float32"), key=lambda d: ms[d]["1"])
    quant = "int8" if "int8" in ms and ms["int8"]["1"] * INT8_MARGIN <= ms[dtype]["1"] else None
    flags = ",".join(machine.cpu_flags()) or "no AVX2/AVX-512 flags"
    reason = (
        f"CPU ({flags}; native bfloat16: {native_bf16()}): a 1-token pass costs "
        + ", ".join(f"{d} {v['1']:.1f} ms" for d, v in ms.items())
        + f" -> {dtype}"
        + (", int8 draft" if quant else ", unquantized draft")
    )
    return Arithmetic(dtype, quant, reason, ms)


def cpu_probe(*, refresh: bool = False) -> dict:
    """Milliseconds per pass of PROBE_TOKENS tokens through the probe's matrices, by arithmetic; cached where the
    cache can be written, per processor (``machine.processor``: another CPU model or other flags measure again),
    thread count and torch version."""
    key = {
        "schema": PROBE_SCHEMA,
        **machine.processor(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
    }
    path = _probe_path(key)
    if path.is_file() and not refresh:
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return data["ms"]
        except (OSError, ValueError, KeyError):
            log.warning("ignoring an unreadable probe cache at %s", path)
    start = machine.cpu_clock()
    ms = _measure()
    if _busy(start, "arithmetic probe"):
        return ms
    # write_atomic: a concurrent run reads the old file or the new one, never half of one
    _cache(path, lambda: write_atomic(path, json.dumps({"key": key, "ms": ms}, indent=1) + "\n"), "arithmetic probe")
    return ms


def _busy(start: machine.CpuClock, what: str) -> bool:
    """Whether other processes kept more than BUSY_CORES cores busy since ``start`` (then say so): a busy machine
    times every forward wrong, so a probe measured then serves its own run and is not kept, which would misprice every
    later run on this machine."""
    others = machine.others_load(start, machine.cpu_clock())["others_cores"]
    if others is not None and others > BUSY_CORES:
        log.warning("other processes kept %.1f cores busy during the %s: using it for this run only", others, what)
        return True
    return False


def _cache(path: Path, write, what: str) -> None:
    """Keep a measurement with ``write()``; where the cache cannot be written (a read-only one), say so and go
    on: the measurement serves this run, and the next one measures again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write()
    except OSError as error:
        log.warning("cannot cache the %s at %s (%s): using it for this run only", what, path, error)


def _measured_once(path: Path, refresh: bool, load, measure, save, what: str):
    """``load(path)``, unless ``refresh`` or the cache holds nothing readable there (then say so); else ``measure()``,
    kept with ``save(path, value)`` where the cache can be written (``_cache``) and the machine was not busy
    (``_busy``)."""
    if path.is_file() and not refresh:
        try:
            return load(path)
        except (OSError, ValueError) as error:
            log.warning("measuring again: %s", error)
    start = machine.cpu_clock()
    value = measure()
    if not _busy(start, what):
        _cache(path, lambda: save(path, value), what)
    return value


def _probe_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / PROBES / f"probe-{digest}.json"


@torch.inference_mode()
def _measure(repeats: int = 5) -> dict:
    from .models.quant import quantize

    generator = torch.Generator().manual_seed(0)
    linears = [torch.nn.Linear(PROBE_SHAPE[1], PROBE_SHAPE[0], bias=False) for _ in range(PROBE_MATRICES)]
    for linear in linears:
        linear.weight.normal_(generator=generator)
    layers = torch.nn.Sequential(*linears)
    variants = {"bfloat16": list(copy.deepcopy(layers).bfloat16().children()), "float32": list(layers.children())}
    try:
        variants["int8"] = list(quantize(copy.deepcopy(layers), "int8").children())
    except RuntimeError as error:  # a torch without the int8 kernels: the float dtypes still decide
        log.info("int8 probe skipped: %s", error)
    inputs = {
        (name, n): torch.randn(
            n, PROBE_SHAPE[1], generator=generator, dtype=torch.bfloat16 if name == "bfloat16" else torch.float32
        )
        for name in variants
        for n in PROBE_TOKENS
    }
    times: dict = {cell: [] for cell in inputs}
    for _ in range(1 + repeats):  # round 0 warms up; cells take turns so drift is shared
        for (name, n), x in inputs.items():
            start = time.perf_counter()
            for layer in variants[name]:  # each matrix reads the same input: a pass streams every weight once
                layer(x)
            times[name, n].append(time.perf_counter() - start)
    return {
        name: {str(n): round(1e3 * statistics.median(times[name, n][1:]), 3) for n in PROBE_TOKENS} for name in variants
    }


def adaptive_policy(latency, batch: int, max_draft: int, *, horizon: float = CATCH_UP_HORIZON):
    """The default length policy: ``policy.AdaptiveLength`` over ``latency`` (``latency_probe``'s), or None where
    even its prior acceptance cannot pay for one drafted token on this machine (then decode with the target
    alone)."""
    policy = AdaptiveLength(latency, max_draft=max_draft, horizon=horizon)
    return policy if policy.best_length(batch) > 0 else None


def default_decoder(
    target,
    draft=None,
    *,
    batch_size: int = 1,
    lookup: bool = True,
    latency: LatencyProfile | None = None,
    rule: str = RULE,
    max_draft: int = ADAPTIVE_MAX_DRAFT,
    horizon: float = CATCH_UP_HORIZON,
):
    """What ``blockspec generate`` decodes with by default, on loaded models: prompt lookup priced by the target's
    measured step costs (``lookup_latency``) beside ``draft`` under ``adaptive_policy`` (its length chosen each step
    from ``latency``, ``latency_probe``'s measurement by default). Where no draft length is expected to beat the
    target alone, the draft is left out, as it is with no ``draft``: lookup alone, or the target alone without
    ``lookup``. On llama.cpp the command line's draft is the shipped one requantized to q4_0
    (``load_model(draft, backend="llamacpp", quant="q4_0")``). ``batch_size``: the rows each call decodes, which the
    costs are measured at."""
    from .drafting import PromptLookup
    from .engine import SpeculativeDecoder

    policy = None
    if draft is not None:
        latency = latency if latency is not None else latency_probe(target, draft, batch_size)
        policy = adaptive_policy(latency, batch_size, max_draft, horizon=horizon)
    proposals = PromptLookup(costs=lookup_latency(target, batch_size)) if lookup else None
    model = draft if policy is not None else None  # the policy, not the engine's fixed length, sets max_draft
    return SpeculativeDecoder(target, model, rule=rule, policy=policy, lookup=proposals)


def latency_probe(target, draft, batch: int, *, refresh: bool = False):
    """The step latency of ``target`` and ``draft`` (loaded adapters) at batch sizes 1 and ``batch``: a
    ``LatencyProfile`` measured once (6 rounds of 1-9 token forwards, seconds on a CPU) and cached per
    models (``profiles.model_identity``: other weights under the same name are measured again), dtype, device,
    thread count, batch size and ``kernels``; a cache that cannot be written serves this run's measurement only."""
    path, load = _latency_cache(target, draft.name, kernels(target, draft), batch)

    def measure() -> LatencyProfile:
        log.info("measuring step latency of %s and %s at batch %d (once per machine)", target.name, draft.name, batch)
        return measure_profile(
            target,
            draft,
            batch_sizes=tuple(sorted({1, batch})),
            # every width a step can verify: llama.cpp's quantized matmuls take rows in fours, so there 4 tokens can
            # cost less than 3, and interpolating between widths would misprice them
            tokens=tuple(range(1, ADAPTIVE_MAX_DRAFT + 2)),
            context=PROBE_CONTEXT,
            repeats=LATENCY_REPEATS,
            progress=False,
        )

    return _measured_once(path, refresh, load, measure, lambda p, profile: profile.save(p), "latency probe")


def cached_latency(target, draft: str, batch: int) -> LatencyProfile | None:
    """``latency_probe``'s profile of ``target`` and a draft on the same backend that is not loaded, named as its
    adapter would be (``draft``: e.g. ``models.llamacpp.adapter_name``), where the cache holds one; else None. What a
    run asks before it loads a draft that may not pay."""
    path, load = _latency_cache(target, draft, kernels(target), batch)
    if not path.is_file():
        return None
    try:
        return load(path)
    except (OSError, ValueError):
        return None  # latency_probe measures it again, and says why


def _latency_cache(target, draft: str, kernel: str, batch: int):
    """Where ``latency_probe`` caches the profile of ``target`` and the draft named ``draft`` at ``batch``, with these
    ``kernels``, and how it reads it back (checked against the models' names, dtype and device)."""
    name = latency_path(target.name, draft, None, dtype_name(target.dtype), str(target.device)).name

    def load(path: Path) -> LatencyProfile:
        profile = LatencyProfile.load(path)
        profile.check(target.name, draft, None, target.dtype, target.device)
        return profile

    return sv_dir() / f"probe-b{batch}-t{torch.get_num_threads()}-m{LATENCY_METHOD}-k{kernel}-{name}", load


def lookup_latency(target, batch: int, max_draft: int = LOOKUP_MAX_DRAFT, *, refresh: bool = False) -> LatencyTable:
    """The target's step latency over 1..``max_draft`` + 1 tokens at batch sizes 1 and ``batch``: what
    ``PromptLookup(costs=...)`` chooses its proposal lengths by. Measured once (``LATENCY_REPEATS`` rounds after a
    warm-up, under a minute on a CPU) and cached as ``latency_probe`` caches its profiles, per target, dtype, device,
    thread count, batch size and width."""
    name = latency_path(target.name, None, None, dtype_name(target.dtype), str(target.device)).name

    def measure() -> LatencyTable:
        log.info("measuring step latency of %s at batch %d for prompt lookup (once per machine)", target.name, batch)
        tokens = tuple(range(1, max_draft + 2))  # every width: llama.cpp's matmuls take rows in fours (latency_probe)
        models, batches = {"target": (target, tokens)}, tuple(sorted({1, batch}))
        return time_forwards(models, batches, PROBE_CONTEXT, LATENCY_REPEATS, progress=False)["target"]

    threads, width = torch.get_num_threads(), max_draft + 1
    path = sv_dir() / f"lookup-b{batch}-t{threads}-w{width}-m{LATENCY_METHOD}-k{kernels(target)}-{name}"
    return _measured_once(
        path,
        refresh,
        lambda p: table_from_dict(json.loads(p.read_text()), p),
        measure,
        lambda p, table: write_atomic(p, json.dumps(table_dict(table)) + "\n"),
        "prompt lookup latency probe",
    )


def measure_profile(
    target,
    draft,
    companion=None,
    *,
    batch_sizes: tuple[int, ...] = SV_BATCH_SIZES,
    tokens: tuple[int, ...] = (1, 2, 3, 5, 9),
    draft_tokens: tuple[int, ...] = DRAFT_TOKENS,
    context: int = 160,
    repeats: int = 3,
    progress: bool = True,
) -> LatencyProfile:
    """Time what a step does with each model: a ``forward`` of n tokens per row on B rows of ``context`` cached
    tokens, then the processing of its logits into probabilities at temperature 1 (the target's and the
    companion's at every position, the draft's at the last one, which it also samples from; the draft at n in
    ``draft_tokens``, DRAFT_TOKENS unless a caller prices longer catch-ups offline). Median of ``repeats`` after one
    warm-up round; within a batch size the cells take turns, each model's widest first, so the machine's drift is
    shared by all of them and no forward is timed right after a much wider one. Token ids are random (seeded), which
    costs the same as text.
    Each model's batch is replaced by an empty one at the end, so its next prefill starts clean.
    """
    models = {"target": (target, tokens), "draft": (draft, draft_tokens)}
    if companion is not None:
        models["companion"] = (companion, tokens)
    tables = time_forwards(models, batch_sizes, context, repeats, progress)
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "target": model_name(target),
        "draft": model_name(draft),
        "companion": None if companion is None else model_name(companion),
        "dtype": dtype_name(getattr(target, "dtype", None)),
        "device": str(target.device),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "kernels": kernels(target),
        "context": context,
        "repeats": repeats,
    }
    return LatencyProfile(tables["target"], tables["draft"], tables.get("companion"), meta)


def time_forwards(
    models: dict[str, tuple], batch_sizes: tuple[int, ...], context: int, repeats: int, progress: bool
) -> dict[str, LatencyTable]:
    """``models``: name -> (model, tokens per row): each model's ``step_seconds`` over every (batch size, tokens)
    as ``measure_profile`` says (the one named "draft" samples from its last position), one table per name."""
    from tqdm.auto import tqdm

    vocab = min(model.vocab_size for model, _ in models.values())
    generator = torch.Generator().manual_seed(0)
    seconds = {name: [] for name in models}  # name -> rows over batch_sizes
    calls = len(batch_sizes) * sum(len(grid) for _, grid in models.values()) * (1 + repeats)
    with torch.inference_mode(), tqdm(total=calls, disable=not progress, unit="call") as bar:
        for batch in batch_sizes:
            bar.set_description(f"B={batch}")
            prompts = torch.randint(vocab, (batch, context), generator=generator).tolist()
            cells = {}  # (name, n) -> the n tokens per row it scores
            for name, (model, grid) in models.items():
                model.prefill(prompts)  # replaces the previous batch size's cache
                # widest first: a forward timed right after a much wider one, whose processing (a softmax over every
                # position) leaves threads busy, ran up to twice as slow on a 2-core CPU, and decoding never pays that
                cells |= {(name, n): torch.randint(vocab, (batch, n), generator=generator) for n in sorted(grid)[::-1]}
            times = {cell: [] for cell in cells}
            for _ in range(1 + repeats):  # the first round warms up (allocation, kernel selection) and is not kept
                for (name, n), step in cells.items():
                    times[name, n].append(
                        step_seconds(models[name][0], step.to(models[name][0].device), last_only=name == "draft")
                    )
                    bar.update()
            for name, (_, grid) in models.items():
                # finer than microseconds is timer noise
                seconds[name].append(tuple(round(statistics.median(times[name, n][1:]), 6) for n in grid))
    for model, _ in models.values():
        model.prefill([])  # frees the last batch
    return {
        name: LatencyTable(tuple(batch_sizes), tuple(grid), tuple(seconds[name])) for name, (_, grid) in models.items()
    }


def step_seconds(model, step: torch.Tensor, last_only: bool) -> float:
    """Wall time of ``model.forward(step)`` [B, n] and the processing of its logits (with ``last_only``, the last
    position's alone, the only one computed, as for a draft catching up, and a token sampled from it), rolling back
    to the prefilled rows afterwards."""
    prefilled, valid = model.lengths.clone(), torch.ones_like(step, dtype=torch.bool)
    start = time.perf_counter()
    logits = model.forward(step, valid, last=last_only)
    if last_only:
        sample(process(logits[:, -1], SamplingParams()), torch.full((len(step),), 0.5, dtype=torch.float64))
    else:
        process(logits, SamplingParams())
    if step.device.type == "cuda":  # CUDA kernels run asynchronously: wait before stopping the clock
        torch.cuda.synchronize(step.device)
    seconds = time.perf_counter() - start
    model.rollback(prefilled)
    return seconds
