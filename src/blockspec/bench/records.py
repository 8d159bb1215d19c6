"""Raw benchmark records: one JSON line per (prompt, configuration) run, Spec-Bench style.

The runner appends records; the report reads them back (and can be re-run on saved files at any time).
A run is identified by ``key``; a resumed run skips records whose key is already in the file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

SCHEMA = 1
CONFIGS = ("target-only", "token", "block", "hf-assisted")


@dataclass(frozen=True)
class Record:
    dataset: str  # prompt set name, e.g. "gsm8k"
    prompt_id: str  # stable id of the prompt within its set, e.g. "gsm8k/0042"
    config: str  # one of CONFIGS
    draft_len: int  # K (0 for target-only; the assistant's own schedule for hf-assisted)
    temperature: float
    batch_size: int
    seed: int
    new_tokens: int
    wall_time: float  # seconds for the whole generate call, prefill included
    prefill_time: float | None  # seconds of prompt forwards (None when the config cannot tell)
    accepted: list[int] = field(default_factory=list)  # tau per step (empty for hf-assisted)
    draft_lens: list[int] = field(default_factory=list)  # drafted tokens per step
    expected_token: list[float] = field(default_factory=list)  # E[tau | this step's draft], token rule
    expected_block: list[float] = field(default_factory=list)  # the same draft under the block rule
    finish_reason: str = "length"
    meta: dict = field(default_factory=dict)  # models, dtype, threads, machine, versions, date
    schema: int = SCHEMA

    @property
    def key(self) -> tuple:
        return (self.dataset, self.prompt_id, self.config, self.draft_len, self.temperature, self.batch_size)


def append(path: Path, record: Record) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(asdict(record)) + "\n")


def read(path: Path) -> Iterator[Record]:
    """Records of a JSONL file; a truncated last line (an interrupted run) is skipped."""
    with path.open() as lines:
        for line in lines:
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                continue
            if data.get("schema") != SCHEMA:
                raise ValueError(f"{path}: record schema {data.get('schema')} is not {SCHEMA}")
            yield Record(**data)
