"""The model cache: where what is made from a preset's packages lives, the markers that vouch for it, its checks.

    `$BLOCKSPEC_CACHE`, else `~/.cache/blockspec`; one folder per preset holding
      <name>.gguf                the concatenated file, written once and hash-checked
      <name>.gguf.verified.json  marker: size, sha256 and mtime of the verified file
      hf-<dtype>/                the dequantised model saved with `save_pretrained` (safetensors), tokenizer and
                                 generation config. Its marker records the sha256 of the GGUF bytes it was made
                                 from, measured just before dequantising them, and each file's size, sha256 and
                                 fingerprint (`integrity`): every load checks the fingerprints, `verify` the full
                                 hashes.
      tokenizer/                 the tokenizer alone (the llama.cpp backend's), saved from the GGUF header; its
                                 marker is as hf-<dtype>/'s.
    and beside each folder `<preset>.lock`, held by the one process writing into it (`convert`). The llama.cpp
    backend keeps the GGUF files it makes from another (requantized, vocabulary cut) in `llamacpp/` (`derived_gguf`).
    The tokenizer of a GGUF file that is no preset's is kept in `tokenizers/<stem>-<hash>-transformers-<version>/`,
    named after the sha256 of the file's metadata, where the tokenizer lives, and the transformers version that read
    it (`header_copy_dir`); its marker records both and its files as hf-<dtype>/'s does. `sv/` holds measured step
    latencies and SV profiles, `machine/` the arithmetic probe (`OTHER_FOLDERS`).

Standard library only: `blockspec models` reads the cache without torch or transformers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from ..files import write_atomic
from . import integrity
from .presets import PRESETS, Preset, PresetError, get_preset, missing_packages

CACHE_ENV = "BLOCKSPEC_CACHE"
DEFAULT_CACHE = "~/.cache/blockspec"
# the folders of the cache beside the presets' ones (OTHER_FOLDERS says what each holds)
DERIVED, TOKENIZERS, PROFILES, PROBES = "llamacpp", "tokenizers", "sv", "machine"
CONVERTED_MARKER = "blockspec-preset.json"  # written last in hf-<dtype>/: its presence means the copy is complete
_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
}


# ------------------------------------------------------------------------------------------------- layout


def cache_root() -> Path:
    """`$BLOCKSPEC_CACHE` if set and non-empty, else `~/.cache/blockspec`."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def preset_dir(preset: str | Preset, cache: str | os.PathLike | None = None) -> Path:
    """The preset's folder inside the cache root `cache` (default: `cache_root()`)."""
    root = Path(cache).expanduser() if cache is not None else cache_root()
    return root / get_preset(preset).name


def lock_path(folder: Path) -> Path:
    """The lock a writer into a preset's ``folder`` holds: beside the folder, so a listing of it shows no lock."""
    return folder.with_name(f"{folder.name}.lock")


def gguf_path(preset: Preset, cache: str | os.PathLike | None = None) -> Path:
    return preset_dir(preset, cache) / preset.gguf_name


def converted_dir(preset: str | Preset, dtype: Any, cache: str | os.PathLike | None = None) -> Path:
    return preset_dir(preset, cache) / f"hf-{dtype_name(dtype)}"


def tokenizer_dir(preset: str | Preset, cache: str | os.PathLike | None = None) -> Path:
    return preset_dir(preset, cache) / "tokenizer"


def dtype_name(dtype: Any) -> str:
    """The name of a converted copy's dtype: ``torch.float32``, ``"fp32"`` and ``"float32"`` are ``"float32"``."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise PresetError(f"unsupported dtype {dtype!r}; use one of bfloat16, float32, float16")
    return _DTYPES[name]


# ------------------------------------------------------------------------------------------- the GGUF file


def derived_gguf(source: Path, kind: str) -> Path:
    """Where a GGUF made from ``source`` by llama.cpp's tools or blockspec goes (``kind``: "q4_0", "vocab32768"):
    ``llamacpp/`` in the model cache, named after the source's path, size and mtime, so a changed source makes
    another copy."""
    stat = source.stat()
    identity = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / DERIVED / f"{source.stem}-{identity}.{kind}.gguf"


def header_copy_dir(gguf: Path, metadata_sha256: str, reader: str) -> Path:
    """Where the tokenizer that transformers ``reader`` (its version) read from the header of the GGUF file ``gguf``
    (not a preset's) is kept: named after the sha256 of the file's metadata (``integrity.metadata_sha256``) and the
    version, so a file whose tokenizer changes gets another copy, one moved to another folder keeps its copy, and
    two environments sharing the cache do not rewrite each other's."""
    return cache_root() / TOKENIZERS / f"{gguf.stem}-{metadata_sha256[:16]}-transformers-{reader}"


def _gguf_marker(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".verified.json")


def gguf_verified(preset: Preset, gguf: Path) -> bool:
    """The cached file is the verified one: same size, mtime and sampled fingerprint (``integrity.fingerprint``, 64
    MiB read, where the full hash reads the whole file) as when its hash was checked. A disk that rots keeps size
    and mtime; the fingerprint sees a file zeroed, truncated or rewritten in place, not a single flipped byte."""
    try:
        marker = json.loads(_gguf_marker(gguf).read_text())
        st = gguf.stat()
        return (
            marker.get("sha256") == preset.sha256
            and marker.get("size") == st.st_size == preset.size
            and marker.get("mtime_ns") == st.st_mtime_ns
            and marker.get("fingerprint") == integrity.fingerprint(gguf)
        )
    except (OSError, ValueError):
        return False


def mark_gguf_verified(preset: Preset, gguf: Path) -> None:
    st = gguf.stat()
    marker = {"preset": preset.name, "size": st.st_size, "sha256": preset.sha256, "mtime_ns": st.st_mtime_ns}
    marker["fingerprint"] = integrity.fingerprint(gguf)
    write_atomic(_gguf_marker(gguf), json.dumps(marker, indent=1))


# ---------------------------------------------------------------------------------------- converted copies


def _copy_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file() and f.name != CONVERTED_MARKER)


def mark_copy(folder: Path, **source: str | None) -> None:
    """Mark ``folder`` complete, recording what it was made from (``source``: for a preset's copy, the sha256
    measured on the GGUF bytes it was made from) and each of its files' size, fingerprint and sha256 (the full hash
    reads the whole copy once, when it is made, where dequantising took a minute anyway)."""
    files = {f.name: integrity.record(f) for f in _copy_files(folder)}
    write_atomic(folder / CONVERTED_MARKER, json.dumps({**source, "files": files}, indent=1))


def _converted_marker(out: Path) -> dict | None:
    try:
        return json.loads((out / CONVERTED_MARKER).read_text())
    except (OSError, ValueError):
        return None


def converted_record(preset: Preset, out: Path) -> dict | None:
    """The copy's marker if the copy is complete and current: made from bytes measured to hash to this preset's
    pinned sha256 (a copy of another GGUF is stale, and so is one whose marker records no measured hash: it was
    made from a GGUF nobody hashed just before, maybe one rotten since it was cached) and recording its files'
    hashes (a copy whose marker has none is rebuilt: nothing known-good remains to check it against)."""
    return copy_record(out, gguf_sha256=preset.sha256)


def copy_record(out: Path, **source: str) -> dict | None:
    """The marker of the copy ``out`` if the copy is complete, made from ``source`` (each key's recorded value is
    the one given) and records its files."""
    marker = _converted_marker(out)
    if marker is None or not isinstance(marker.get("files"), dict):
        return None
    return marker if all(marker.get(key) == value for key, value in source.items()) else None


def changed_files(out: Path, recorded: dict, *, full: bool, progress: bool = False) -> list[str]:
    """One line per file of the copy ``out`` that differs from its record: extra, missing, or different content
    (by size and fingerprint, or with ``full`` by sha256)."""
    problems = [f"{f}: not written by blockspec" for f in _copy_files(out) if f.name not in recorded]
    for name, record in recorded.items():
        problem = integrity.differs(out / name, record, full=full, progress=progress)
        if problem is not None:
            problems.append(problem)
    return problems


# ------------------------------------------------------------------------------------------ state and checks


@dataclasses.dataclass(frozen=True)
class PresetStatus:
    name: str
    role: str
    installed: bool
    missing: tuple[str, ...]  # requirements not satisfied ("name==version")
    gguf_verified: bool  # the concatenated GGUF is in the cache and its hash marker matches
    converted: tuple[str, ...]  # dtypes with a complete fast-loading copy
    cache_dir: Path

    @property
    def cache_state(self) -> str:
        """ "converted" (fast load), "gguf" (concatenated, slow first load left), or "empty"."""
        return "converted" if self.converted else "gguf" if self.gguf_verified else "empty"


def status(preset: str | Preset, *, cache: str | os.PathLike | None = None) -> PresetStatus:
    preset = get_preset(preset)
    folder = preset_dir(preset, cache)
    converted = (
        tuple(
            sorted(  # hf-<dtype> only: an interrupted save leaves hf-<dtype>.partial, never counted
                d.name[3:]
                for d in folder.glob("hf-*")
                if d.name[3:] in _DTYPES.values() and converted_record(preset, d)
            )
        )
        if folder.is_dir()
        else ()
    )
    missing = missing_packages(preset)
    return PresetStatus(
        name=preset.name,
        role=preset.role,
        installed=not missing,
        missing=missing,
        gguf_verified=gguf_verified(preset, gguf_path(preset, cache)),
        converted=converted,
        cache_dir=folder,
    )


def status_all() -> list[PresetStatus]:
    return [status(name) for name in PRESETS]


def size_text(size: int) -> str:
    """A byte count for people: 1.2 GiB, 340.0 MiB, 12.5 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size / 2**10:.1f} KiB"


OTHER_FOLDERS = {  # what each folder beside the presets' ones holds
    DERIVED: "GGUF files made from others (requantized, vocabulary cut); made again when needed",
    TOKENIZERS: "tokenizers read from the headers of GGUF files of your own; read again when needed",
    PROFILES: "measured step latencies (measured again when needed) and Speculative Verification profiles",
    PROBES: "the machine's arithmetic probe; measured again when needed",
}


def other_folders(cache: str | os.PathLike | None = None) -> list[tuple[Path, int, int, str]]:
    """Each folder of ``OTHER_FOLDERS`` that holds files: (folder, files, bytes, what it holds)."""
    root = Path(cache).expanduser() if cache is not None else cache_root()
    found = []
    for name, what in OTHER_FOLDERS.items():
        sizes = [size for f in (root / name).rglob("*") if (size := _file_size(f)) is not None]
        if sizes:
            found.append((root / name, len(sizes), sum(sizes), what))
    return found


def _file_size(path: Path) -> int | None:
    """The size of the file ``path``; None for a folder, or a file gone since it was listed (a temporary one renamed
    by a process writing into the cache)."""
    try:
        return path.stat().st_size if path.is_file() else None
    except FileNotFoundError:
        return None


def verify(preset: str | Preset, *, cache: str | os.PathLike | None = None, progress: bool = True) -> list[str]:
    """Full check of the preset's cache, reading every byte: the GGUF against the pinned sha256, each converted
    copy's source (the GGUF hash its marker records, measured when it was made, against the pinned one) and its
    files, and the saved tokenizer's, against the sha256 recorded when the copy was written. Returns one message
    per problem, naming the file and the fix; empty when everything cached is intact (or nothing is cached).
    Deletes nothing."""
    preset = get_preset(preset)
    problems = []
    gguf = gguf_path(preset, cache)
    if gguf.is_file() and integrity.sha256_file(gguf, f"verifying {gguf.name}", progress) != preset.sha256:
        problems.append(
            f"{gguf}: sha256 differs from the pinned {preset.sha256}; delete it and the next load "
            "rebuilds it from the installed packages"
        )
    folder = preset_dir(preset, cache)
    for out in sorted(folder.glob("hf-*")) if folder.is_dir() else ():
        marker = _converted_marker(out)
        if out.name[3:] in _DTYPES.values() and marker is not None and marker.get("gguf_sha256") != preset.sha256:
            problems.append(  # a copy made from bytes that were not, or not measured to be, the pinned GGUF
                f"{out}: made from a GGUF whose sha256 was {marker.get('gguf_sha256') or 'not measured'}, not the "
                f"pinned {preset.sha256}; the next load rebuilds it from the installed packages (or delete it)"
            )
    copies = [converted_dir(preset, dtype, cache) for dtype in status(preset, cache=cache).converted]
    for out in [*copies, tokenizer_dir(preset, cache)]:
        record = converted_record(preset, out)
        if record is None:  # absent, or deleted or rewritten since `status` saw it complete
            continue
        problems += [
            f"{line}; delete {out} and the next load rebuilds it"
            for line in changed_files(out, record["files"], full=True, progress=progress)
        ]
    return problems
