"""Which weights a model name stands for, told by their content: the one identity that SV's profiles
(``policy.profiles``) and a bench's provenance (``bench.provenance``) are keyed by.

    fingerprint("qwen2.5-coder-0.5b")   # a preset: its pinned sha256, nothing read
    fingerprint("path/to/model")        # a folder, a file, or a hub id in the local Hugging Face cache: a digest
                                        # of ``integrity.fingerprint`` of each of its config, weight and tokenizer
                                        # files; None where it holds no weights (yet)

Content, not path or modification time: a copy of the same weights (moved, touched, downloaded again) is the same
model, and other weights written in place with the same size and time (``rsync -a``, ``cp -p``) are another.
Each file's fingerprint reads at most about 65 MiB, once per process while the file's stat is unchanged.

Standard library only (huggingface_hub, from the `hf` extra, finds hub snapshots where it is installed).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from . import integrity
from .presets import PRESETS

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
# A folder's files that may decide what it computes: weights, config, tokenizer (by suffix, so a README.txt or a
# trainer_state.json counts too; a README.md or a licence without a suffix does not)
MODEL_FILES = (*WEIGHT_SUFFIXES, ".json", ".model", ".txt", ".tiktoken")

_fingerprints: dict[tuple, str] = {}  # integrity.fingerprint by file stat, for this process


def fingerprint(name: str) -> str | None:
    """A digest of the bytes model ``name`` loads from: a preset's pinned sha256 (its load checks its bytes against
    it); else sha256 over the file name and ``integrity.fingerprint`` of each of ``model_files(name)``; None where there
    are none (a hub id not downloaded yet, a missing path, anything that is no model)."""
    if name in PRESETS:
        return PRESETS[name].sha256
    files = model_files(name)
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name} {_file_fingerprint(file)}\n".encode())
    return digest.hexdigest()


def model_files(name: str) -> list[Path]:
    """The files model ``name`` loads from, sorted: the file itself, or the ``MODEL_FILES`` of the folder or of the
    hub id's snapshot in the local Hugging Face cache; none where the folder holds no weight file (a snapshot
    whose weights are not downloaded yet: their fingerprint would change once they are)."""
    path = Path(name)
    if path.is_file():
        return [path]
    folder = path if path.is_dir() else hub_snapshot(name)
    if folder is None:
        return []
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.name.endswith(MODEL_FILES))
    return files if any(f.name.endswith(WEIGHT_SUFFIXES) for f in files) else []


def hub_snapshot(name: str) -> Path | None:
    """The folder of hub id ``name`` in the local Hugging Face cache (what ``load_model`` reads) where it holds the
    id's config.json: a file-system look-up, no network. None without huggingface_hub."""
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        return None
    try:
        config = try_to_load_from_cache(name, "config.json")
    except HFValidationError:  # not shaped like a hub id (a mistyped path, ...)
        return None
    return Path(config).parent if isinstance(config, str) else None  # else None, or a "known absent" marker


def _file_fingerprint(file: Path) -> str:
    """``integrity.fingerprint(file)``, read again only when the file's stat changes: its change time is part of
    the key, so a rewrite that restores size and modification time is read again too."""
    st = file.stat()  # follows the hub cache's symlinks to their blobs
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _fingerprints:
        _fingerprints[key] = integrity.fingerprint(file)
    return _fingerprints[key]
