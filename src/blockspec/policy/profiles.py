"""Where SV's profiles live: ``sv/`` in the model cache, one file per models (and sampling, for calibration).

Stdlib only, so the command line can name these paths in its help without importing torch.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..models.cache import cache_root


def sv_dir() -> Path:
    """Where profiles go by default: ``sv/`` in the model cache (``$BLOCKSPEC_CACHE`` or ~/.cache/blockspec)."""
    return cache_root() / "sv"


def sampling_key(sampling) -> dict:
    """What a calibration profile is specific to: the target's sampling settings."""
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def profile_path(target: str, draft: str, companion: str | None, sampling: dict) -> Path:
    """The calibration profile ``blockspec sv calibrate`` saves for these model names and ``sampling_key``."""
    temperature = "T{temperature:g}-k{top_k}-p{top_p:g}".format(**sampling)
    return sv_dir() / f"calibration-{_slug(target, draft, companion)}-{temperature}.json"


def latency_path(target: str, draft: str, companion: str | None, dtype: str, device: str) -> Path:
    """The latency profile ``blockspec sv profile`` saves for these model names, dtype and device."""
    return sv_dir() / f"latency-{_slug(target, draft, companion)}-{dtype}-{device}.json"


def _slug(*names) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9.:-]+", "_", Path(str(n)).name).replace(":", "") for n in names)


def require_file(path: Path, command: str) -> Path:
    """``path``, or FileNotFoundError naming the command that makes it."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist: run `blockspec {command}` with the same models first")
    return Path(path)
