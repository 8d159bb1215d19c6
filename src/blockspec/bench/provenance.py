"""What a bench's figures depend on beyond its settings: the arithmetic its settings resolved to on this machine
(``--dtype auto`` picks by a probe; the auto configurations' draft quantization with it), the library versions
(and llama.cpp's build, where it runs the models), and the bytes of the models.

``resolve`` gathers them as one JSON dict, stored beside the settings (``<out>/config.json``, under
``"resolved"``) and in every record's meta. A resume that resolves any of them otherwise is refused (``check``),
since its runs would be pooled with the earlier ones under the same keys; the report refuses records that differ
in them (``report.tables``).

    {"dtype": "bfloat16", "draft_quant": {"block": null, "auto": "int8"},
     "versions": {"python": ..., "blockspec": ..., "torch": ..., "transformers": ...,
                  ["llama-cpp-python": ..., "llamacpp_build": "CPU : SSE3 = 1 | ..."]},
     "models": {"target": "<sha256>", ["draft": "<sha256>"]}}

The draft is fingerprinted where a configuration drafts with it. The SV companion and profiles are not
fingerprinted: their names are settings, checked as such.
"""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path

from .. import __version__
from ..models.identity import fingerprint
from . import records as rec
from .executor import NO_DRAFT, draft_quant_of

# Sections whose keys a resume may add: configurations, and the draft of the first configuration that drafts
COMPARED_ON_SHARED_KEYS = ("draft_quant", "models")


def resolve(config, backend: str, dtype: str, arithmetic) -> dict:
    """The resolved arithmetic, versions and model fingerprints (``identity.fingerprint``) of a bench of ``config``
    (a BenchConfig) on ``backend``; a fingerprint is None for a hub id whose weights the load has yet to
    download."""
    drafting = [name for name in config.configs if name not in NO_DRAFT]
    return {
        "dtype": dtype,
        "draft_quant": {name: draft_quant_of(name, arithmetic) for name in drafting},
        "versions": versions(backend),
        "models": {"target": fingerprint(config.target), **({"draft": fingerprint(config.draft)} if drafting else {})},
    }


def versions(backend: str) -> dict:
    """The versions of Python and of the libraries that compute a bench's figures; on llama.cpp also the instruction
    sets its build uses (ImportError naming the set-up step where llama-cpp-python is missing)."""
    found = {"python": platform.python_version(), "blockspec": __version__}
    found |= {package: package_version(package) for package in ("torch", "transformers")}
    if backend == "llamacpp":
        from ..models.llamacpp import build_info

        found |= {"llamacpp_build": build_info(), "llama-cpp-python": package_version("llama-cpp-python")}
    return found


def package_version(package: str) -> str:
    """The installed version of distribution ``package``, read from its metadata without importing it, or
    "not installed"."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def flatten(resolved: dict, shared_with: dict | None = None) -> dict:
    """``resolved`` as ``{"resolved.versions.torch": value, ...}``; with ``shared_with`` (another resolved dict)
    the keys of the ``COMPARED_ON_SHARED_KEYS`` sections only where both hold them."""
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
