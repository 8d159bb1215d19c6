"""Raw benchmark records: one JSON line per (prompt or batch, configuration) run, Spec-Bench style.

The runner appends records to ``<out>/records.jsonl``; the report reads them back, plain or gzip-compressed
(``.jsonl.gz``: how kept runs are stored in the repository). A run is identified by ``key``; a resume skips keys
already recorded. A batched run (batch size B > 1) makes one record for B prompts decoded together: ``prompt_ids``
lists them, ``new_tokens`` and ``wall_time`` are the batch's, ``accepted`` and ``verified`` hold one entry per
row-step (flattened over the ``rows[s]`` rows active in step s), ``drafted`` and ``rows`` one per step. A run that
raised is recorded too, ``status`` FAILED with its ``error`` and no measurement; readers leave it out
(``Record.ok``). Only records of schema ``SCHEMA`` are read. The settings of a run directory are stored beside its
records (the runner's ``config.json``); ``refuse_other_settings`` keeps a resume from pooling other settings' runs,
and ``one_writer`` a second process from writing into the same directory.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SCHEMA = 4
OK, FAILED = "ok", "failed"  # Record.status
HF_CONFIGS = ("hf-assisted", "hf-lookup")  # transformers' generate: batch 1, no per-step lists, no prefill time
SV_CONFIGS = ("sv-draft", "sv-token", "sv-block")  # Speculative Verification: draft-only / companion predictor
FIXED_CONFIGS = ("token", "block", "block-int8")  # fixed-K speculative decoding: one run per K
# what only transformers runs: its own baselines, the int8 draft, SV with the companion built from the target's layers
TRANSFORMERS_ONLY = (*HF_CONFIGS, "block-int8", "sv-token", "sv-block")
# blockspec's own defaults, each deciding its lengths: the draft length `generate --drafter model` picks
# (AdaptiveLength over the draft the machine's probe chose), prompt lookup alone, and lookup beside that model draft
# where a proposal is expected to beat it (what `generate` runs by default)
ADAPTIVE_CONFIGS = ("auto", "lookup", "lookup+model")
# the default comparison (no profiles needed)
CONFIGS = ("target-only", "token", "block", "hf-assisted", "auto", "lookup+model")
# Each step the tree or chain of at most K nodes predicted fastest (policy.AdaptiveShape over the latency probe, as
# `generate --tree auto` runs it), with the draft the tree and fixed-K rows use; its records' max_draft is that K
AUTO_TREE = "auto-tree"
KNOWN_CONFIGS = (
    ("target-only", "token", "block", "block-int8", "hf-assisted", "hf-lookup", AUTO_TREE)
    + ADAPTIVE_CONFIGS
    + SV_CONFIGS
)
# A tree configuration is named after its shape, the children per node at each depth: "tree-2,1,1" drafts that
# tree every step with the draft model, verified by the block rule's tree form (on either backend). Its records'
# max_draft is the tree's node count, their verified count nodes, drafted the levels drafted (a draft forward each)
# and accepted the depth of the accepted path.
TREE = "tree-"


def is_tree(name: str) -> bool:
    """Whether ``name`` is a tree configuration (``TREE`` and a shape)."""
    return name.startswith(TREE)


def drafts_trees(name: str) -> bool:
    """Whether configuration ``name`` may draft trees: a tree, paths or ``AUTO_TREE``."""
    return is_tree(name) or is_paths(name) or name == AUTO_TREE


def tree_config(shape) -> str:
    """The configuration name of a tree ``shape``: (2, 1, 1) -> "tree-2,1,1"."""
    return TREE + ",".join(str(k) for k in shape)


# A paths configuration drafts k paths per step with the draft model, of each of the bench's K tokens: "paths-3"
# three paths whose first tokens are distinct, "paths-iid-3" three i.i.d. paths merged where they agree; verified by
# the block rule's tree form (on either backend). Its records' max_draft is the paths' length K, their verified
# count nodes (fewer than k * K where i.i.d. paths merge), drafted the levels drafted; meta["paths"] holds
# {"paths": k, "length": K, "drawn": "distinct" or "iid"}.
PATHS = "paths-"


def is_paths(name: str) -> bool:
    """Whether ``name`` is a paths configuration (``PATHS``, then ``iid-`` or nothing, then k)."""
    return name.startswith(PATHS)


def paths_of(name: str) -> tuple[int, str]:
    """The paths per step and how they are drawn of the paths configuration ``name``: "paths-3" -> (3, "distinct"),
    "paths-iid-3" -> (3, "iid"); ValueError for another name."""
    found = re.fullmatch(re.escape(PATHS) + r"(iid-)?([0-9]+)", name)
    if found is None or int(found[2]) < 1:
        raise ValueError(
            f"a paths configuration is {PATHS}K (K paths per step, first tokens distinct) or {PATHS}iid-K "
            f"(K i.i.d. paths), with K >= 1, e.g. {PATHS}3; got {name!r}"
        )
    return int(found[2]), "iid" if found[1] else "distinct"


def paths_config(paths: int, drawn: str) -> str:
    """The configuration name of ``paths`` paths drawn ``drawn``: (3, "distinct") -> "paths-3"."""
    return PATHS + ("iid-" if drawn == "iid" else "") + str(paths)


def is_known(name: str) -> bool:
    """Whether the report knows configuration ``name``: one of ``KNOWN_CONFIGS``, a tree's or a paths one."""
    return name in KNOWN_CONFIGS or is_tree(name) or is_paths(name)


@dataclass(frozen=True)
class Record:
    dataset: str  # prompt set name, e.g. "gsm8k"
    prompt_id: str  # stable id of the prompt within its set, e.g. "gsm8k/0042" (a batch: its first prompt)
    config: str  # one of KNOWN_CONFIGS, a tree's (TREE and its shape: "tree-2,1,1") or paths' ("paths-3")
    # K (0 for target-only, lookup and hf-lookup; hf-assisted: the assistant's own schedule; SV, auto and
    # lookup+model: the most the model drafts; a tree: its nodes; paths: their length)
    max_draft: int
    temperature: float
    batch_size: int
    seed: int  # row b of the batch uses seed + b
    new_tokens: int  # summed over the batch's rows
    wall_time: float  # seconds for the whole generate call, prefill included
    prefill_time: float | None  # seconds of prompt forwards (None when the config cannot tell)
    accepted: list[int] = field(default_factory=list)  # tau per row-step (empty for hf-assisted)
    verified: list[int] = field(default_factory=list)  # drafted tokens verified per row-step
    expected_token: list[float] = field(default_factory=list)  # E[tau | this step's draft], token rule
    expected_block: list[float] = field(default_factory=list)  # the same draft under the block rule
    finish_reason: str = "length"  # of the first row ("eos", "stop" or "length")
    # models, dtype, versions, date, and the machine (blockspec.machine): CPU flags, threads, other processes' CPU
    # time while the run was timed (others_cpu_s, others_cores)
    meta: dict = field(default_factory=dict)
    schema: int = SCHEMA
    drafted: list[int] = field(default_factory=list)  # tokens drafted per row, per step (SV may verify fewer)
    rows: list[int] = field(default_factory=list)  # rows active per step
    prompt_ids: list[str] = field(default_factory=list)  # every prompt of the batch, in row order
    finish_reasons: list[str] = field(default_factory=list)  # per row
    status: str = OK  # OK or FAILED (the run raised: no measurement)
    error: str | None = None  # of a failed run: "<exception type>: <message>"
    draft_temperature: float | None = None  # T_d; None: the draft samples at the target's temperature
    # per row-step of the fixed-K configurations: the mean over its verified positions of sum_v min(draft, target)
    # (None where nothing was verified)
    overlap: list[float | None] = field(default_factory=list)

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

    @property
    def ok(self) -> bool:
        """Whether the run completed: only such records carry figures."""
        return self.status == OK


def still_failed(records) -> dict[tuple, Record]:
    """The runs whose records are all failures, by key, each with its last failure (a retry's error replaces the
    first); a run with a successful record is done, whatever failed before it."""
    done = {r.key for r in records if r.ok}
    return {r.key: r for r in records if not r.ok and r.key not in done}


def append(path: Path, record) -> None:
    """Append one record (any dataclass) as a JSON line. A last line without its newline is an interrupted write
    when it does not parse: it is cut off (its run has no record, so a resume redoes it), and so never becomes an
    unreadable line in the middle of the file; one that parses is closed with a newline."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(asdict(record)) + "\n"
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb+") as existing:
            existing.seek(-1, 2)
            if existing.read(1) != b"\n":
                existing.seek(0)
                text = existing.read()
                start = text.rfind(b"\n") + 1  # the last line's first byte
                try:
                    json.loads(text[start:])
                    line = "\n" + line
                except ValueError:  # JSONDecodeError, or bytes cut inside a UTF-8 character
                    log.warning("%s: dropping its truncated last line (an interrupted write)", path)
                    existing.truncate(start)
    with path.open("a") as out:
        out.write(line)


def _text(path: Path) -> str:
    """The text of a record file: plain (``.jsonl``) or gzip-compressed (``.jsonl.gz``, how the records the
    documentation cites are kept). A damaged or cut-off gzip file raises ValueError naming it: unlike a plain
    file's interrupted last line, its loss cannot be bounded to one record."""
    path = Path(path)
    if path.suffix != ".gz":
        return path.read_text(errors="replace")
    try:
        with gzip.open(path, "rb") as compressed:
            return compressed.read().decode(errors="replace")
    except FileNotFoundError:
        raise
    except (OSError, EOFError, zlib.error) as error:  # gzip.BadGzipFile is an OSError; a cut-off file an EOFError
        raise ValueError(f"{path}: not a readable gzip file ({error})") from None


def read(path: Path) -> Iterator[Record]:
    """Records of a JSONL file, plain (``.jsonl``) or gzip-compressed (``.jsonl.gz``). A truncated last line (an
    interrupted run) is skipped; any other line that is not a JSON object is skipped with a warning naming the
    file and line (its run has no record: a resume redoes it); a JSON object that is not a record, or a record of
    another schema than ``SCHEMA``, raises ValueError, as does a damaged gzip file."""
    lines = _text(path).splitlines()
    last = max((n for n, line in enumerate(lines) if line.strip()), default=-1)
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{path}:{n + 1}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as error:
            if n == last:
                log.info("%s: truncated last line (an interrupted run) skipped", where)
            else:
                log.warning("%s: not a JSON line (%s): skipped", where, error)
            continue
        if not isinstance(data, dict):
            log.warning("%s: not a record but a JSON %s: skipped", where, type(data).__name__)
            continue
        if data.get("schema") != SCHEMA:
            raise ValueError(
                f"{where}: record schema {data.get('schema')!r}, but this blockspec reads schema {SCHEMA} only "
                "(records of another blockspec version: run the bench again with this one)"
            )
        try:
            yield Record(**data)
        except TypeError as error:  # missing or unknown fields
            raise ValueError(f"{where}: not a benchmark record ({error})") from None


def refuse_other_settings(where: Path, found: dict, wanted: dict) -> None:
    """Raise ValueError naming every setting in ``wanted`` (this call's) whose value differs from ``found`` (the
    one stored with the runs in ``where``): records of other models, seeds or lengths would otherwise be
    skipped as done, or pooled with these, under the same keys."""
    differ = {name: (found.get(name), value) for name, value in wanted.items() if found.get(name) != value}
    if differ:
        raise ValueError(
            f"{where} holds runs with other settings "
            f"({', '.join(f'{k}: {a!r} there, {b!r} here' for k, (a, b) in differ.items())}): "
            "use another --out"
        )


LOCK = "bench.lock"  # in a run directory while a process writes into it: that process's pid


@contextlib.contextmanager
def one_writer(folder: Path) -> Iterator[None]:
    """Hold the lock of the run directory ``folder`` (``folder/LOCK``, with this process's pid in it) for the
    block. Another process holding it is refused at once, ValueError naming the folder and its pid: two benches
    into one directory would each run the whole plan and interleave their records. The lock is the kernel's
    (``flock``): it ends with its process however that ends, so a lock file found unlocked with a pid in it was
    left by a process that was killed, and is taken over with a warning. POSIX only."""
    import fcntl

    path = folder / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(
                f"{folder} is in use by another bench (pid {holder}): let it finish, or use another --out"
            ) from None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed the file between our open and our lock: lock the one there now
    try:
        left = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if left:
            log.warning("%s: taking over the lock of pid %s, which ended without releasing it", folder, left)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)  # while still locked: a process that opens it after this makes a new one
        os.close(fd)
