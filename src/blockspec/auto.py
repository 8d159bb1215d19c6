"""Machine-aware defaults: the arithmetic the models run in, and how far to speculate, from measurements made
on the machine that decodes (once, then cached), never from a guess.

Machines of one kind differ in what is fast. On a CPU with AVX-512-BF16 or AMX a 9-token forward of the bundled
1.5B costs about 1.2x a 1-token one and bfloat16 is 2-3x faster than float32; on an AVX2-only CPU (no native
bfloat16) the same 9-token forward costs 6.6x, so speculation that pays on one machine is slower than the target
alone on the other (docs/benchmarks.md).

1. ``choose_arithmetic(device)``: the target's dtype and whether to quantize the draft. On the CPU, a probe times
   one token's pass through a stack of matrices larger than the CPU's caches (the 1.5B's MLP shapes, 330 MB in
   float32: memory-bound, as a decoding step is) in bfloat16, float32 and int8 (``models.quant``); the faster of
   bfloat16 and float32 is the dtype, and the draft is quantized where int8 is at least ``INT8_MARGIN`` faster
   still. The probe takes a few seconds and is cached per machine kind, thread count and torch version, unless
   other processes kept the CPU busy meanwhile (then it is measured again next time). On CUDA:
   bfloat16 where supported, else float16; no quantization.
2. ``latency_probe(target, draft, batch)``: the models' own step latency at this batch size (a short
   ``sv.latency.measure_profile``, cached per models, dtype, device and thread count), which
   ``policy.AdaptiveLength`` turns into a draft length each step; ``adaptive_policy`` is that policy, or None
   where speculation cannot pay at all.
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
from pathlib import Path

import torch

from . import machine
from .models.presets import cache_root

log = logging.getLogger(__name__)

PROBE_SCHEMA = 1
INT8_MARGIN = 1.25  # int8 must be this much faster to be chosen: its acceptance cost is small but not zero
PROBE_SHAPE = (8960, 1536)  # the 1.5B's MLP up/gate projection, [out, in]
PROBE_MATRICES = 6
PROBE_TOKENS = (1, 4)  # a plain step and a short verification
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
    reason = (f"CPU ({flags}; native bfloat16: {native_bf16()}): a 1-token pass costs "
              + ", ".join(f"{d} {v['1']:.1f} ms" for d, v in ms.items())
              + f" -> {dtype}" + (", int8 draft" if quant else ", unquantized draft"))
    return Arithmetic(dtype, quant, reason, ms)


def cpu_probe(*, refresh: bool = False) -> dict:
    """Milliseconds per pass of PROBE_TOKENS tokens through the probe's matrices, by arithmetic; cached."""
    key = {"schema": PROBE_SCHEMA, "cpu_flags": machine.cpu_flags(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "processor": platform.processor() or platform.machine()}
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
    others = machine.others_load(start, machine.cpu_clock())["others_cores"]
    if others is not None and others > BUSY_CORES:  # a busy machine times every arithmetic wrong: do not keep it
        log.warning("other processes kept %.1f cores busy during the arithmetic probe: using it for this run only",
                    others)
        return ms
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{id(ms)}")
    tmp.write_text(json.dumps({"key": key, "ms": ms}, indent=1) + "\n")
    tmp.replace(path)  # atomic: a concurrent run reads the old file or the new one, never half of one
    return ms


def _probe_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "machine" / f"probe-{digest}.json"


@torch.inference_mode()
def _measure(repeats: int = 5) -> dict:
    from .models.quant import quantize

    generator = torch.Generator().manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(PROBE_SHAPE[1], PROBE_SHAPE[0], bias=False)
                                   for _ in range(PROBE_MATRICES)])
    for layer in layers:
        layer.weight.normal_(generator=generator)
    variants = {"bfloat16": list(copy.deepcopy(layers).bfloat16()), "float32": list(layers)}
    try:
        variants["int8"] = list(quantize(copy.deepcopy(layers), "int8"))
    except RuntimeError as error:  # a torch without the int8 kernels: the float dtypes still decide
        log.info("int8 probe skipped: %s", error)
    inputs = {(name, n): torch.randn(n, PROBE_SHAPE[1], generator=generator,
                                     dtype=torch.bfloat16 if name == "bfloat16" else torch.float32)
              for name in variants for n in PROBE_TOKENS}
    times: dict = {cell: [] for cell in inputs}
    for _ in range(1 + repeats):  # round 0 warms up; cells take turns so drift is shared
        for (name, n), x in inputs.items():
            start = time.perf_counter()
            for layer in variants[name]:  # each matrix reads the same input: a pass streams every weight once
                layer(x)
            times[name, n].append(time.perf_counter() - start)
    return {name: {str(n): round(1e3 * statistics.median(times[name, n][1:]), 3) for n in PROBE_TOKENS}
            for name in variants}


def adaptive_policy(latency, batch: int, max_draft: int):
    """The default length policy: ``policy.AdaptiveLength`` over ``latency`` (``latency_probe``'s), or None where
    even its prior acceptance cannot pay for one drafted token on this machine (then decode with the target
    alone)."""
    from .policy import AdaptiveLength

    policy = AdaptiveLength(latency, max_draft=max_draft)
    return policy if policy.best_length(batch) > 0 else None


def latency_probe(target, draft, batch: int, *, refresh: bool = False):
    """The step latency of ``target`` and ``draft`` (loaded adapters) at batch sizes 1 and ``batch``: a
    ``LatencyProfile`` measured once (about 3 rounds of 1-9 token forwards, seconds on a CPU) and cached per
    models, dtype, device, thread count and batch size."""
    from .sv import cli as sv_cli
    from .sv.latency import LatencyProfile, measure_profile

    name = sv_cli.latency_path(target.name, draft.name, None, str(target.dtype).removeprefix("torch."),
                               str(target.device)).name
    path = sv_cli.sv_dir() / f"probe-b{batch}-t{torch.get_num_threads()}-{name}"
    if path.is_file() and not refresh:
        try:
            profile = LatencyProfile.load(path)
            profile.check(target.name, draft.name, None, target.dtype, target.device)
            return profile
        except ValueError as error:
            log.warning("measuring again: %s", error)
    log.info("measuring step latency of %s and %s at batch %d (once per machine)", target.name, draft.name, batch)
    profile = measure_profile(target, draft, batch_sizes=tuple(sorted({1, batch})), tokens=(1, 2, 3, 5, 9),
                              context=128, repeats=2, progress=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    return profile
