"""Latency profiles: step latency of the target, draft and companion, measured on the machine that decodes.

Speculative Verification prices each verification width with a latency table over (batch size B, tokens
scored per row n); those figures depend on the models, dtype, device, thread count and machine, so a profile
records what it was measured on and ``check`` refuses to price steps for other models. On disk a profile is
human-readable JSON:

    {"schema": 1,
     "meta": {"date", "target", "draft", "companion", "dtype", "device", "torch_threads", "torch", "machine",
              "processor", "context", "repeats"},
     "target": {"batch_sizes": [...], "tokens": [...], "seconds": [[...], ...]},   # seconds[i][j]: B_i, n_j
     "draft": {...}, "companion": {...} or null}
"""

from __future__ import annotations

import json
import platform
import re
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..policy import LatencyTable
from ..sampling import SamplingParams, process, sample

SCHEMA = 1
DRAFT_TOKENS = (1, 2, 4)  # a step's first draft forward catches up (1 token, 2 after a fully accepted step, more
# after steps that did not draft); each later one scores a single token
META_FIELDS = ("date", "target", "draft", "companion", "dtype", "device", "torch_threads", "torch", "machine",
               "processor", "context", "repeats")
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

    def scoring(self, batch: int, positions: int, catch_up: int) -> float:
        """Seconds of the companion's forward that scores ``positions`` drafted tokens per row: it reads the
        ``catch_up`` tokens it has not seen and every drafted token but the last."""
        return self.companion(batch, catch_up + positions - 1) if positions else 0.0

    def check(self, target_name: str, draft_name: str, companion_name: str | None, dtype, device) -> None:
        """Raise ValueError naming the first field that differs from what the profile was measured for."""
        wanted = {"target": target_name, "draft": draft_name, "companion": companion_name,
                  "dtype": _dtype_name(dtype), "device": str(torch.device(device))}
        for field, value in wanted.items():
            if self.meta[field] != value:
                raise ValueError(f"latency profile was measured for {field} {self.meta[field]}, not {value}: {_RERUN}")

    def save(self, path) -> None:
        tables = {name: _table_dict(getattr(self, name)) for name in ("target", "draft", "companion")}
        text = json.dumps({"schema": SCHEMA, "meta": self.meta, **tables}, indent=1)
        # One line per list of numbers (an axis, a table row) rather than one per number. A JSON string never
        # holds a raw newline, so only lists spread over lines by indent= match.
        text = re.sub(r"\[[^\[\]\"]*\n[^\[\]\"]*\]", lambda m: json.dumps(json.loads(m.group())), text)
        Path(path).write_text(text + "\n")

    @classmethod
    def load(cls, path) -> LatencyProfile:
        data = json.loads(Path(path).read_text())
        schema = data.get("schema") if isinstance(data, dict) else None
        if schema != SCHEMA:
            raise ValueError(f"{path}: latency profile schema {schema}, this blockspec reads schema "
                             f"{SCHEMA}: {_RERUN}")
        _require(data, ("meta", "target", "draft", "companion"), path)
        _require(data["meta"], META_FIELDS, f"{path} meta")
        tables = {name: _table(data[name], f"{path} {name}") for name in ("target", "draft")}
        companion = None if data["companion"] is None else _table(data["companion"], f"{path} companion")
        return cls(**tables, companion=companion, meta=data["meta"])


def measure_profile(
    target,
    draft,
    companion=None,
    *,
    batch_sizes: tuple[int, ...] = (1, 4, 16, 32, 64),
    tokens: tuple[int, ...] = (1, 2, 3, 5, 9),
    context: int = 160,
    repeats: int = 3,
    progress: bool = True,
) -> LatencyProfile:
    """Time what a step does with each model: a ``forward`` of n tokens per row on B rows of ``context`` cached
    tokens, then the processing of its logits into probabilities at temperature 1 (the target's and the
    companion's at every position, the draft's at the last one, which it also samples from; the draft at n in
    DRAFT_TOKENS). Median of ``repeats`` after one warm-up round; within a batch size the cells take turns, so
    the machine's drift is shared by all of them. Token ids are random (seeded), which costs the same as text.
    Each model's batch is replaced by an empty one at the end, so its next prefill starts clean.
    """
    from tqdm.auto import tqdm

    models = {"target": (target, tokens), "draft": (draft, DRAFT_TOKENS)}
    if companion is not None:
        models["companion"] = (companion, tokens)
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
                cells |= {(name, n): torch.randint(vocab, (batch, n), generator=generator) for n in grid}
            times = {cell: [] for cell in cells}
            for _ in range(1 + repeats):  # the first round warms up (allocation, kernel selection) and is not kept
                for (name, n), step in cells.items():
                    times[name, n].append(step_seconds(models[name][0], step.to(models[name][0].device),
                                                       last_only=name == "draft"))
                    bar.update()
            for name, (_, grid) in models.items():
                # finer than microseconds is timer noise
                seconds[name].append(tuple(round(statistics.median(times[name, n][1:]), 6) for n in grid))
    for model, _ in models.values():
        model.prefill([])  # frees the last batch
    tables = {name: LatencyTable(tuple(batch_sizes), tuple(grid), tuple(seconds[name]))
              for name, (_, grid) in models.items()}
    meta = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "target": _name(target), "draft": _name(draft), "companion": None if companion is None else _name(companion),
        "dtype": _dtype_name(getattr(target, "dtype", None)), "device": str(target.device),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.platform(),
        "processor": platform.processor() or platform.machine(), "context": context, "repeats": repeats,
    }
    return LatencyProfile(tables["target"], tables["draft"], tables.get("companion"), meta)


def step_seconds(model, step: torch.Tensor, last_only: bool) -> float:
    """Wall time of ``model.forward(step)`` [B, n] and the processing of its logits (the last position's alone,
    and a token sampled from it, if ``last_only``), rolling back to the prefilled rows afterwards."""
    prefilled, valid = model.lengths.clone(), torch.ones_like(step, dtype=torch.bool)
    start = time.perf_counter()
    logits = model.forward(step, valid)
    if last_only:
        sample(process(logits[:, -1], SamplingParams()), torch.full((len(step),), 0.5, dtype=torch.float64))
    else:
        process(logits, SamplingParams())
    if step.device.type == "cuda":  # CUDA kernels run asynchronously: wait before stopping the clock
        torch.cuda.synchronize(step.device)
    seconds = time.perf_counter() - start
    model.rollback(prefilled)
    return seconds


def _name(model) -> str:
    return getattr(model, "name", None) or type(model).__name__


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")  # torch.bfloat16 and "bfloat16" alike -> "bfloat16"


def _table_dict(table: LatencyTable | None) -> dict | None:
    if table is None:
        return None
    return {"batch_sizes": list(table.batch_sizes), "tokens": list(table.tokens),
            "seconds": [list(row) for row in table.seconds]}


def _table(data: dict, where) -> LatencyTable:
    _require(data, ("batch_sizes", "tokens", "seconds"), where)
    return LatencyTable(tuple(data["batch_sizes"]), tuple(data["tokens"]), tuple(tuple(row) for row in data["seconds"]))


def _require(data, fields, where) -> None:
    missing = [field for field in fields if field not in data] if isinstance(data, dict) else list(fields)
    if missing:
        raise ValueError(f"{where}: not a complete latency profile, missing {', '.join(missing)}: {_RERUN}")
