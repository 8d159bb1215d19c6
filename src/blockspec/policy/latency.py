"""Latency profiles: step latency of the target, draft and companion, measured on the machine that decodes.

SV prices each verification width with a latency table over (batch size B, tokens scored per row n), figures that
depend on the models, dtype, device, thread count and machine: a profile records what it was measured on, and
``check`` refuses to price steps for other models or on other kernels (``kernels``). On disk it is human-readable JSON:

    {"schema": 1,
     "meta": {"date", "target", "draft", "companion", "dtype", "device", "torch_threads", "torch", "machine",
              "processor", "kernels" (profiles made before it was recorded lack it), "context", "repeats"},
     "target": {"batch_sizes": [...], "tokens": [...], "seconds": [[...], ...]},   # seconds[i][j]: B_i, n_j
     "draft": {...}, "companion": {...} or null}
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import machine
from ..defaults import LLAMACPP_DTYPE
from ..files import write_atomic
from .base import LatencyTable

SCHEMA = 1
# The draft tokens per row a profile measures: a step's first draft forward catches up (1 token, 2 after a fully
# accepted step, more after steps that did not draft or took prompt lookup's proposal: tens of tokens); each later
# one scores a single token.
DRAFT_TOKENS = (1, 2, 4, 8, 32)
META_FIELDS = (
    "date",
    "target",
    "draft",
    "companion",
    "dtype",
    "device",
    "torch_threads",
    "torch",
    "machine",
    "processor",
    "context",
    "repeats",
)
_RERUN = "run `blockspec sv profile` to measure a profile for these models on this machine"


@dataclass(frozen=True)
class LatencyProfile:
    """Forward latency (seconds) of each model over (batch size, tokens per row), with what it was measured on."""

    target: LatencyTable  # n = tokens scored per row (verified drafts + 1)
    draft: LatencyTable  # n in DRAFT_TOKENS: a draft forward over n tokens, and sampling from its last position
    companion: LatencyTable | None  # same grid as the target; None without a companion
    meta: dict  # META_FIELDS

    def drafting(self, batch: int, positions: int, catch_up: int, companion: bool) -> float:
        """Seconds spent on ``positions`` drafted tokens per row before the target's forward: drafting them (the
        first forward reads the ``catch_up`` tokens the draft has not seen yet, each later one the token drafted
        before it) and, with ``companion``, scoring them."""
        if positions == 0:
            return 0.0
        scoring = self.scoring(batch, positions, catch_up) if companion else 0.0
        return self.draft(batch, catch_up) + (positions - 1) * self.draft(batch, 1) + scoring

    def behind(self, batch: int, catch_up: int) -> float:
        """Seconds a draft forward over ``catch_up`` tokens costs beyond one over 2 (none for 2 or fewer): what a draft
        that fell behind (after steps without drafts, or prompt lookup's) pays once, when it drafts again."""
        return max(0.0, self.draft(batch, catch_up) - self.draft(batch, 2))

    def scoring(self, batch: int, positions: int, catch_up: int) -> float:
        """Seconds of the companion's forward that scores ``positions`` drafted tokens per row: it reads the
        ``catch_up`` tokens it has not seen and every drafted token but the last."""
        if self.companion is None:
            raise ValueError("the latency profile has no companion costs: measure it with the companion")
        return self.companion(batch, catch_up + positions - 1) if positions else 0.0

    def check(
        self, target_name: str, draft_name: str, companion_name: str | None, dtype, device, on: str | None = None
    ) -> None:
        """Raise ValueError naming the first field that differs from what the profile was measured for; with ``on``
        (``kernels`` of the target), also where it was measured on other kernels (a profile that records them)."""
        wanted = {
            "target": target_name,
            "draft": draft_name,
            "companion": companion_name,
            "dtype": dtype_name(dtype),
            "device": str(torch.device(device)),
        }
        for field, value in wanted.items():
            if self.meta[field] != value:
                raise ValueError(f"latency profile was measured for {field} {self.meta[field]}, not {value}: {_RERUN}")
        if on is not None and self.meta.get("kernels", on) != on:
            raise ValueError(
                f"latency profile was measured on {self.meta['machine']} with other kernels than this machine's "
                f"(another CPU model or CPU flags, torch version, GPU or llama.cpp build): {_RERUN}"
            )

    def save(self, path) -> None:
        tables = {name: table_dict(getattr(self, name)) for name in ("target", "draft", "companion")}
        text = json.dumps({"schema": SCHEMA, "meta": self.meta, **tables}, indent=1)
        # One line per list of numbers (an axis, a table row) rather than one per number. A JSON string never
        # holds a raw newline, so only lists spread over lines by indent= match.
        text = re.sub(r"\[[^\[\]\"]*\n[^\[\]\"]*\]", lambda m: json.dumps(json.loads(m.group())), text)
        write_atomic(path, text + "\n")

    @classmethod
    def load(cls, path) -> LatencyProfile:
        data = json.loads(Path(path).read_text())
        schema = data.get("schema") if isinstance(data, dict) else None
        if schema != SCHEMA:
            raise ValueError(f"{path}: latency profile schema {schema}, this blockspec reads schema {SCHEMA}: {_RERUN}")
        _require(data, ("meta", "target", "draft", "companion"), path)
        _require(data["meta"], META_FIELDS, f"{path} meta")
        tables = {name: table_from_dict(data[name], f"{path} {name}") for name in ("target", "draft")}
        companion = None if data["companion"] is None else table_from_dict(data["companion"], f"{path} companion")
        return cls(**tables, companion=companion, meta=data["meta"])


def kernels(*models) -> str:
    """A digest of what the ``models``' step latency depends on besides themselves, their dtype and the thread count:
    the processor (``machine.processor``; the GPU's name on CUDA), torch's version and, with a model on llama.cpp,
    the instruction sets its build uses. The latency probes' cache names and the profiles' meta hold it, so a cache
    shared by machines of other kinds (a home folder on a cluster) or kept across a rebuilt llama.cpp measures again
    instead of pricing steps with other kernels' costs."""
    key = {**machine.processor(), "torch": torch.__version__}
    device = torch.device(models[0].device)
    if device.type == "cuda":
        key["gpu"] = torch.cuda.get_device_name(device)
    if any(model.dtype == LLAMACPP_DTYPE for model in models):
        from ..models.llamacpp import build_info

        key["llama.cpp"] = build_info()
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")  # torch.bfloat16 and "bfloat16" alike -> "bfloat16"


def table_dict(table: LatencyTable | None) -> dict | None:
    if table is None:
        return None
    return {
        "batch_sizes": list(table.batch_sizes),
        "tokens": list(table.tokens),
        "seconds": [list(row) for row in table.seconds],
    }


def table_from_dict(data: dict, where) -> LatencyTable:
    _require(data, ("batch_sizes", "tokens", "seconds"), where)
    return LatencyTable(tuple(data["batch_sizes"]), tuple(data["tokens"]), tuple(tuple(row) for row in data["seconds"]))


def _require(data, fields, where) -> None:
    missing = [field for field in fields if field not in data] if isinstance(data, dict) else list(fields)
    if missing:
        raise ValueError(f"{where}: not a complete latency profile, missing {', '.join(missing)}: {_RERUN}")
