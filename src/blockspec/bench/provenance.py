"""What a bench's figures depend on beyond its settings: the arithmetic its settings resolved to on this machine
(``--dtype auto`` picks by a probe; the auto configurations' draft quantization with it), the library versions,
and the bytes of the models.

``resolve`` gathers them as one JSON dict, stored beside the settings (``<out>/config.json``, under
``"resolved"``) and in every record's meta. A resume that resolves any of them otherwise is refused (``check``),
since its runs would be pooled with the earlier ones under the same keys; the report refuses records that differ
in them (``report.tables``).

    {"dtype": "bfloat16", "draft_quant": {"block": null, "auto": "int8"},
     "versions": {"python": ..., "blockspec": ..., "torch": ..., "transformers": ..., ["llama-cpp-python": ...]},
     "models": {"target": "<sha256>", "draft": "<sha256>"}}

The SV companion and profiles are not fingerprinted: their names are settings, checked as such.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
from pathlib import Path

from .. import __version__
from ..models import integrity
from . import records as rec
from .executor import NO_DRAFT, draft_quant_of

# The files of a model folder its fingerprint covers: config, weights, tokenizer (not a README or a licence)
MODEL_FILES = (".json", ".safetensors", ".bin", ".gguf", ".model", ".txt", ".tiktoken")
COMPARED_ON_SHARED_KEYS = ("draft_quant",)  # a resume may add configurations


def resolve(config, backend: str, dtype: str, arithmetic) -> dict:
    """The resolved arithmetic, versions and model fingerprints of a bench of ``config`` (a BenchConfig) on
    ``backend``; a fingerprint is None for a hub id the load has yet to download."""
    return {
        "dtype": dtype,
        "draft_quant": {name: draft_quant_of(name, arithmetic) for name in config.configs if name not in NO_DRAFT},
        "versions": versions(backend),
        "models": {"target": fingerprint(config.target), "draft": fingerprint(config.draft)},
    }


def versions(backend: str) -> dict:
    """The versions of Python and of the libraries that compute a bench's figures."""
    found = {"python": platform.python_version(), "blockspec": __version__}
    for package in ("torch", "transformers", *(("llama-cpp-python",) if backend == "llamacpp" else ())):
        found[package] = importlib.metadata.version(package)
    return found


def fingerprint(name: str) -> str | None:
    """A digest of the bytes model ``name`` loads from, cheap enough for every bench: a preset's pinned sha256 (its
    load checks its bytes against it); for a GGUF file, a model folder or a hub id in the local Hugging Face cache,
    sha256 over the name and ``integrity.fingerprint`` (size, safetensors header, 64 sampled MiB) of each file (the
    folder's ``MODEL_FILES``). None where no file is found: a hub id not downloaded yet, or a missing path (whose
    load fails)."""
    from ..models.presets import PRESETS

    if name in PRESETS:
        return PRESETS[name].sha256
    path = Path(name)
    if name.endswith(".gguf"):
        files = [path] if path.is_file() else []
    else:
        folder = path if path.is_dir() else _hub_snapshot(name)
        files = [] if folder is None else [f for f in folder.iterdir() if f.is_file() and f.suffix in MODEL_FILES]
    if not files:
        return None
    digest = hashlib.sha256()
    for file in sorted(files):
        digest.update(f"{file.name} {integrity.fingerprint(file)}\n".encode())
    return digest.hexdigest()


def _hub_snapshot(name: str) -> Path | None:
    """The folder of hub id ``name`` in the local Hugging Face cache (what ``load_model`` reads), or None."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        config = try_to_load_from_cache(name, "config.json")
    except HFValidationError:  # not shaped like a hub id
        return None
    return Path(config).parent if isinstance(config, str) else None


def flatten(resolved: dict, shared_with: dict | None = None) -> dict:
    """``resolved`` as ``{"resolved.versions.torch": value, ...}``; with ``shared_with`` (another resolved dict)
    the configurations of ``COMPARED_ON_SHARED_KEYS`` only where both name them."""
    flat = {}
    for section, value in resolved.items():
        if not isinstance(value, dict):
            flat[f"resolved.{section}"] = value
            continue
        for key, item in value.items():
            if shared_with is None or section not in COMPARED_ON_SHARED_KEYS or key in shared_with.get(section, {}):
                flat[f"resolved.{section}.{key}"] = item
    return flat


def check(out: Path, stored: dict, resolved: dict) -> None:
    """Refuse (ValueError naming each difference) to add runs of ``resolved`` to the records of ``out``, made with
    ``stored``: other arithmetic, library versions or model bytes would be pooled with them under the same keys."""
    rec.refuse_other_settings(out, flatten(stored), flatten(resolved, shared_with=stored))
