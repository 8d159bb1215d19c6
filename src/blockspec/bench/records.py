"""Raw benchmark records: one JSON line per (prompt or batch, configuration) run, Spec-Bench style.

The runner appends records; the report reads them back (and can be re-run on saved files at any time).
A run is identified by ``key``; a resumed run skips records whose key is already in the file.

A batched run (batch_size B > 1) decodes B consecutive prompts of one dataset in one ``generate`` call and
makes one record: ``prompt_id`` is the batch's first prompt (``prompt_ids`` lists all B), ``new_tokens`` and
``wall_time`` are the whole batch's, and the per-step lists are flattened over the rows active in each step
(``rows[s]`` of them in step s), so ``accepted`` and ``draft_lens`` hold one entry per row-step while
``drafted`` and ``rows`` hold one entry per step. At B = 1 every list has one entry per step, as in schema 1.

Schema 2 added ``drafted``, ``rows``, ``prompt_ids`` and ``finish_reasons`` (and the SV configurations);
schema-1 records still load, with those fields empty.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

SCHEMA = 2
READABLE_SCHEMAS = (1, 2)  # schema 1 lacks the fields added in 2: they load with their (empty) defaults
CONFIGS = ("target-only", "token", "block", "hf-assisted")  # the default comparison (no profiles needed)
SV_CONFIGS = ("sv-draft", "sv-token", "sv-block")  # Speculative Verification: draft-only / companion predictor
KNOWN_CONFIGS = CONFIGS + SV_CONFIGS
FIXED_CONFIGS = ("token", "block")  # fixed-K speculative decoding: one run per K


@dataclass(frozen=True)
class Record:
    dataset: str  # prompt set name, e.g. "gsm8k"
    prompt_id: str  # stable id of the prompt within its set, e.g. "gsm8k/0042" (a batch: its first prompt)
    config: str  # one of KNOWN_CONFIGS
    draft_len: int  # K (0 for target-only; the assistant's own schedule for hf-assisted; the max for SV)
    temperature: float
    batch_size: int
    seed: int  # row b of the batch uses seed + b
    new_tokens: int  # summed over the batch's rows
    wall_time: float  # seconds for the whole generate call, prefill included
    prefill_time: float | None  # seconds of prompt forwards (None when the config cannot tell)
    accepted: list[int] = field(default_factory=list)  # tau per row-step (empty for hf-assisted)
    draft_lens: list[int] = field(default_factory=list)  # drafted tokens verified per row-step
    expected_token: list[float] = field(default_factory=list)  # E[tau | this step's draft], token rule
    expected_block: list[float] = field(default_factory=list)  # the same draft under the block rule
    finish_reason: str = "length"  # of the first row ("eos", "stop" or "length")
    meta: dict = field(default_factory=dict)  # models, dtype, threads, machine, versions, date
    schema: int = SCHEMA
    # schema 2
    drafted: list[int] = field(default_factory=list)  # tokens drafted per row, per step (SV may verify fewer)
    rows: list[int] = field(default_factory=list)  # rows active per step
    prompt_ids: list[str] = field(default_factory=list)  # every prompt of the batch, in row order
    finish_reasons: list[str] = field(default_factory=list)  # per row

    @property
    def key(self) -> tuple:
        return (self.dataset, self.prompt_id, self.config, self.draft_len, self.temperature, self.batch_size)


def append(path: Path, record) -> None:
    """Append one record (any dataclass) as a JSON line; a truncated last line (an interrupted write) is first
    closed with a newline, so it stays a single unreadable line instead of swallowing this record too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(asdict(record)) + "\n"
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb") as existing:
            existing.seek(-1, 2)
            if existing.read(1) != b"\n":
                line = "\n" + line
    with path.open("a") as out:
        out.write(line)


def read(path: Path) -> Iterator[Record]:
    """Records of a JSONL file; a truncated last line (an interrupted run) is skipped."""
    with path.open() as lines:
        for line in lines:
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            if data.get("schema") not in READABLE_SCHEMAS:
                raise ValueError(f"{path}: record schema {data.get('schema')} is not one of {READABLE_SCHEMAS}")
            yield Record(**data)
