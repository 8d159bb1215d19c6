"""Facts about the machine a measurement runs on: its kind (CPU flags), its thread count, and the CPU time other
processes use meanwhile.

A wall-clock figure is comparable only with figures from the same kind of machine (the vector instructions the
CPU offers decide which kernels torch runs) at the same thread count, and trustworthy only when no other process
competed for the cores while it was measured: on 2 cores shared with a test run, a forward reads 5-20x slow.
Everything is read from /proc (Linux); elsewhere the CPU flags are empty and the CPU time of others is unknown
(None).

    facts()                                   # {"cpu_flags": [...], "threads": n}
    start = cpu_clock(); ...; others_load(start, cpu_clock())   # {"others_cpu_s": ..., "others_cores": ...}
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

# The flags that tell machine kinds apart: the shell equivalent is
#     grep -o -w 'avx512[a-z_0-9]*\|avx2\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u
# (digits allowed after amx too: with `amx[a-z_]*` a whole-word match would miss amx_bf16 and amx_int8).
CPU_FLAG = re.compile(r"\b(?:avx512[a-z_0-9]*|avx2|amx[a-z_0-9]*)\b")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The AVX2, AVX-512 and AMX flags of the CPU, sorted; empty where /proc/cpuinfo is unavailable (or lists
    none of them, e.g. on ARM)."""
    return sorted(set(CPU_FLAG.findall(_read(cpuinfo))))


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (the first "model name" line of /proc/cpuinfo), or "" where there is none."""
    found = re.search(r"^model name\s*:\s*(.*)$", _read(cpuinfo), re.MULTILINE)
    return found[1].strip() if found else ""


def processor() -> dict:
    """What names this CPU's kind in a cache key: its model name and CPU flags (a cache shared by machines of other
    kinds, a home folder on a cluster, must not serve one machine's measurements to another)."""
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags()}


def _read(cpuinfo: Path) -> str:
    """The text of ``cpuinfo``, or "" where it cannot be read (not Linux)."""
    try:
        return cpuinfo.read_text()
    except OSError:
        return ""


def threads() -> int:
    """Threads torch computes with (its intra-op pool)."""
    import torch

    return torch.get_num_threads()


def facts() -> dict:
    """The machine kind and thread count, as stored with every benchmark run."""
    return {"cpu_flags": cpu_flags(), "threads": threads()}


def busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy (all cores, every process) since boot, from the first line of
    /proc/stat; None without it."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0]
    except OSError:
        return None
    fields = [int(v) for v in first.split()[1:]]  # user nice system idle iowait irq softirq steal [guest ...]
    idle = fields[3] + fields[4]  # idle + iowait
    # guest time is already counted in user: only the first 8 fields add up to the CPU time spent
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    """CPU seconds this process has used, all its threads, not its children (utime + stime of /proc/self/stat)."""
    t = os.times()
    return t.user + t.system


@dataclass(frozen=True)
class CpuClock:
    """A reading of the machine's and this process's CPU time, and of the wall clock."""

    busy: float | None  # busy_seconds()
    own: float  # own_seconds()
    wall: float  # time.monotonic()


def cpu_clock() -> CpuClock:
    return CpuClock(busy_seconds(), own_seconds(), time.monotonic())


def others_load(start: CpuClock, end: CpuClock) -> dict:
    """CPU time other processes used between two readings: ``others_cpu_s`` (CPU seconds, all cores) and
    ``others_cores`` (the same per wall second: 1.0 = one core kept busy); both None without /proc/stat.

    The counters tick every 1/CLK_TCK s (10 ms), so over a run of well under a second the figure is coarse; a
    difference of two counters read at slightly different times can dip below 0, hence the clamp."""
    if start.busy is None or end.busy is None:
        return {"others_cpu_s": None, "others_cores": None}
    others = max(0.0, (end.busy - start.busy) - (end.own - start.own))
    wall = end.wall - start.wall
    return {"others_cpu_s": others, "others_cores": others / wall if wall > 0 else None}
