"""Where SV's profiles live: ``sv/`` in the model cache, one file per models (and sampling, for calibration).

A profile's file name holds the models' names for whoever lists the folder, and a digest of what the profile is
specific to, so two configurations never share a file:

- each model's identity (``model_identity``): a preset and its GGUF's sha256; a file, or a folder's config and
  weight files, by resolved path, size and modification time; a hub id and the snapshot the local Hugging Face
  cache holds. Other weights under the same name make another file, and the profile is measured again;
- the sampling settings exactly (``repr`` of each float), for the calibration profile;
- the dtype ("gguf" on the llama.cpp backend) and the device, for the latency profile.

``calibration_file`` and ``latency_file`` find a profile or say which command makes it, naming a file an earlier
blockspec saved for the same model names, whose name told neither models of the same file name nor sampling
values equal to 6 digits apart: pass that one explicitly if it was measured for these models.

Stdlib only, so the command line can name these paths in its help without importing torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ..models.cache import cache_root
from ..models.presets import PRESETS

# What decides a folder's weights: its config and weight files (a tokenizer or README edit does not change them).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_LABEL = re.compile(r"^(?P<base>.+) \((?P<label>[^()]+)\)$")  # an adapter's name: "<name> (int8)", "<name> (Q4_0)"
_SLUG_PART = 40  # characters of each model's name in a file name: three paths must fit in 255


def sv_dir() -> Path:
    """Where profiles go by default: ``sv/`` in the model cache (``$BLOCKSPEC_CACHE`` or ~/.cache/blockspec)."""
    return cache_root() / "sv"


def sampling_key(sampling) -> dict:
    """What a calibration profile is specific to: the target's sampling settings."""
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def profile_path(target: str, draft: str, companion: str | None, sampling: dict) -> Path:
    """The calibration profile ``blockspec sv calibrate`` saves for these models and ``sampling_key``."""
    exact = {
        "temperature": repr(float(sampling["temperature"])),
        "top_k": int(sampling["top_k"]),
        "top_p": repr(float(sampling["top_p"])),
    }
    readable = "T{temperature:g}-k{top_k}-p{top_p:g}".format(**sampling)
    digest = _digest(target, draft, companion, exact)
    return sv_dir() / f"calibration-{_slug(target, draft, companion)}-{readable}-{digest}.json"


def latency_path(target: str, draft: str, companion: str | None, dtype: str, device: str) -> Path:
    """The latency profile ``blockspec sv profile`` saves for these models, dtype and device."""
    digest = _digest(target, draft, companion, {"dtype": dtype, "device": device})
    return sv_dir() / f"latency-{_slug(target, draft, companion)}-{dtype}-{device.replace(':', '')}-{digest}.json"


def calibration_file(target: str, draft: str, companion: str | None, sampling: dict, path=None) -> Path:
    """``path``, else ``profile_path``'s; FileNotFoundError naming the command that makes it."""
    if path is not None:
        return _require_file(path, "sv calibrate")
    legacy = _legacy_slug(target, draft, companion) + "-T{temperature:g}-k{top_k}-p{top_p:g}".format(**sampling)
    return _default_file(profile_path(target, draft, companion, sampling), f"calibration-{legacy}.json", "calibrate")


def latency_file(target: str, draft: str, companion: str | None, dtype: str, device: str, path=None) -> Path:
    """``path``, else ``latency_path``'s; FileNotFoundError naming the command that makes it."""
    if path is not None:
        return _require_file(path, "sv profile")
    legacy = f"latency-{_legacy_slug(target, draft, companion)}-{dtype}-{device}.json"
    return _default_file(latency_path(target, draft, companion, dtype, device), legacy, "profile")


def _require_file(path, command: str) -> Path:
    """``path``, or FileNotFoundError naming the command that makes it."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist: run `blockspec {command}` with the same models first")
    return Path(path)


def model_identity(name: str | None) -> str:
    """What names ``name``'s weights, found without reading them: a preset and its GGUF's sha256; an existing file
    or folder by its resolved path, with the size and modification time of the file, or of the folder's
    config.json and weight files; a hub id with the snapshot folder the local Hugging Face cache holds for it
    (by the same stat); anything else (a companion ``prefix:K``, an adapter's own name) as it is. A loaded model's
    label (``"<name> (int8)"``) stays part of it."""
    if name is None:
        return "none"
    if name in PRESETS:
        return f"preset {name} sha256 {PRESETS[name].sha256}"
    path = Path(name).expanduser()
    if path.exists():
        return _stat_identity(path)
    labelled = _LABEL.match(name)
    if labelled:
        return f"{model_identity(labelled['base'])} ({labelled['label']})"
    snapshot = _hub_snapshot(name)
    return name if snapshot is None else f"hub {name} {_stat_identity(snapshot)}"


def _stat_identity(path: Path) -> str:
    path = path.resolve()
    files = (
        [path]
        if path.is_file()
        else sorted(
            f for f in path.iterdir() if f.is_file() and (f.name == "config.json" or f.name.endswith(WEIGHT_SUFFIXES))
        )
    )
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]  # stat follows the hub's symlinks
    return f"{path} {json.dumps(stats)}"


def _hub_snapshot(name: str) -> Path | None:
    """The local Hugging Face cache's snapshot folder for hub id ``name``, if it holds one: a file-system look-up
    (no network), which needs huggingface_hub (the `hf` extra that loads hub models)."""
    try:
        from huggingface_hub import try_to_load_from_cache
        from huggingface_hub.errors import HFValidationError
    except ImportError:
        return None
    try:
        config = try_to_load_from_cache(name, "config.json")
    except HFValidationError:  # not shaped like a hub id
        return None
    return Path(config).parent if isinstance(config, str) else None


def _digest(target: str, draft: str, companion: str | None, extra: dict) -> str:
    identity = [model_identity(target), model_identity(draft), model_identity(companion), extra]
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def _slug(*names) -> str:
    return "-".join(
        re.sub(r"[^A-Za-z0-9.-]+", "_", Path(str(n).rstrip("/")).name)[:_SLUG_PART].strip("_") or "_" for n in names
    )


def _legacy_slug(*names) -> str:
    """The names of an earlier blockspec's profiles: base names only."""
    return "-".join(re.sub(r"[^A-Za-z0-9.:-]+", "_", Path(str(n)).name).replace(":", "") for n in names)


def _default_file(path: Path, legacy_name: str, command: str) -> Path:
    legacy = path.with_name(legacy_name)
    if not path.exists() and legacy.exists():
        option = {"calibrate": "--sv-profile", "profile": "--latency"}[command]
        raise FileNotFoundError(
            f"{path} does not exist; {legacy} was saved by an earlier blockspec, whose file names told apart neither "
            f"models of the same file name nor sampling values equal to 6 digits: pass it with {option} if it was "
            f"measured for these models, or run `blockspec sv {command}` again"
        )
    return _require_file(path, f"sv {command}")
