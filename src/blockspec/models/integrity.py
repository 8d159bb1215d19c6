"""Checks of a file's content: its sha256 (every byte read), and a fingerprint cheap enough for every load.

    fingerprint       sha256 over a file's size, its header and 64 sampled blocks of 1 MiB.
    metadata_sha256   sha256 of a GGUF file's header and metadata, where its tokenizer lives (no tensor read).

Standard library only (tqdm, from the `hf` extra, draws progress bars where it is installed).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
import struct
from pathlib import Path

READ_BLOCK = 8 << 20  # 8 MiB per read while copying and hashing
_FINGERPRINT_BLOCKS = 64
_FINGERPRINT_BLOCK = 1 << 20  # 64 blocks of 1 MiB: a load reads 64 MiB per file to check it, whatever its size
_FINGERPRINT_SEED = 0  # fixed: the same offsets at every load of a given file size
_MAX_HEADER = 100 << 20  # safetensors' own limit on its JSON header
_OTHER_HEADER = 1 << 20  # of any other file (GGUF, pickle): the first MiB, a GGUF's header and metadata's start
# GGUF metadata value types: the fixed sizes of the scalar ones; 8 is a string, 9 an array
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar when asked for and tqdm is there (it is in the `hf` extra); None otherwise. Cosmetic only."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    # disable=None: no bar when stderr is not a terminal (CI logs stay clean).
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None)


def sha256_file(path: Path, label: str, progress: bool) -> str:
    digest = hashlib.sha256()
    bar = progress_bar(path.stat().st_size, label, progress)
    with open(path, "rb") as src:
        while block := src.read(READ_BLOCK):
            digest.update(block)
            if bar is not None:
                bar.update(len(block))
    if bar is not None:
        bar.close()
    return digest.hexdigest()


def fingerprint(path: str | os.PathLike) -> str:
    """A cheap content check of a file: sha256 over the file's size, its header and 64 blocks of 1 MiB at offsets
    drawn with a fixed seed. The header of a safetensors file is its bytes up to the end of its JSON header (tensor
    names, dtypes, shapes, offsets); of any other file (a GGUF, a pickle) its first MiB. Reads at most about
    65 MiB whatever the size, so every load can afford it; a file no larger than that (config, tokenizer) is read
    whole. A planted, truncated or re-saved file fails it; a single corrupted byte outside the sampled blocks only
    fails the full sha256."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}\n".encode())
    with open(path, "rb") as f:
        start = f.read(9)  # safetensors: a u64 little-endian length of the JSON header that follows, then "{"
        length = 8 + int.from_bytes(start[:8], "little")
        safetensors = start[8:] == b"{" and length <= min(size, _MAX_HEADER)
        header_end = length if safetensors else min(size, _OTHER_HEADER)
        f.seek(0)
        digest.update(f.read(header_end))
        for offset in sampled_offsets(header_end, size):
            f.seek(offset)
            digest.update(f.read(_FINGERPRINT_BLOCK))
    return digest.hexdigest()


def sampled_offsets(start: int, size: int) -> list[int]:
    """Offsets of the fingerprint's blocks in the bytes [start, size) after the header: all of them when they fit
    in the sample, else 64 blocks drawn with the fixed seed (in file order, for sequential reads)."""
    if size - start <= _FINGERPRINT_BLOCKS * _FINGERPRINT_BLOCK:
        return list(range(start, size, _FINGERPRINT_BLOCK))
    rng = random.Random(_FINGERPRINT_SEED)
    return sorted(rng.randrange(start, size - _FINGERPRINT_BLOCK + 1) for _ in range(_FINGERPRINT_BLOCKS))


def record(path: Path) -> dict:
    """What a later check compares ``path`` with: its size, fingerprint and sha256 (the last reads every byte)."""
    return {"size": path.stat().st_size, "fingerprint": fingerprint(path), "sha256": sha256_file(path, "", False)}


def differs(path: Path, recorded: dict, *, full: bool, progress: bool = False) -> str | None:
    """Why ``path`` is not the file of ``record``: missing, or another content (by size and fingerprint, or with
    ``full`` by sha256); None when it is."""
    if not path.is_file():
        return f"{path}: missing"
    if full and sha256_file(path, f"verifying {path.name}", progress) != recorded["sha256"]:
        return f"{path}: sha256 differs from the one recorded when it was written"
    if not full and (path.stat().st_size != recorded["size"] or fingerprint(path) != recorded["fingerprint"]):
        return f"{path}: content differs from the one written (size or fingerprint)"
    return None


def metadata_sha256(path: str | os.PathLike) -> str | None:
    """The sha256 of a GGUF file's bytes from its start to the end of its metadata (magic, version, counts and every
    key and value: the vocabulary, merges and chat template included; tensor infos and data excluded), or None
    where the file is not a little-endian GGUF of version 2 or 3 whose metadata ends within it. Parses the
    metadata's layout only (a few hundred ms for a 151,936-token vocabulary), where gguf's reader takes seconds."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size < 24:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            magic, version, _, count = struct.unpack_from("<4sIQQ", view, 0)
            if magic != b"GGUF" or version not in (2, 3):
                return None
            try:
                end = 24
                for _ in range(count):
                    end = _gguf_value_end(view, end, _GGUF_STRING)  # the key
                    (kind,) = struct.unpack_from("<I", view, end)
                    end = _gguf_value_end(view, end + 4, kind)
            except (struct.error, ValueError, RecursionError):  # defects past the file's end, or nested without end
                return None
            return hashlib.sha256(view[:end]).hexdigest()


def _gguf_value_end(view: mmap.mmap, offset: int, kind: int) -> int:
    """Where the GGUF metadata value of type ``kind`` that starts at ``offset`` ends; ValueError where it would end
    past the file's end."""
    if kind in _GGUF_SCALAR:
        end = offset + _GGUF_SCALAR[kind]
    elif kind == _GGUF_STRING:
        end = offset + 8 + struct.unpack_from("<Q", view, offset)[0]
    elif kind == _GGUF_ARRAY:
        item, count = struct.unpack_from("<IQ", view, offset)
        end = offset + 12
        if item in _GGUF_SCALAR:
            end += count * _GGUF_SCALAR[item]
        elif count > (len(view) - end) // 8:  # every string or array takes 8 bytes at least
            raise ValueError("an array of more items than the file holds")
        else:
            for _ in range(count):
                end = _gguf_value_end(view, end, item)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")
    if end > len(view):
        raise ValueError("metadata runs past the end of the file")
    return end
