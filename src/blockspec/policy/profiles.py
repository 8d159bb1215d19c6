"""Where SV's profiles live: ``sv/`` in the model cache, one file per models (and sampling, for calibration).

A profile's file name holds the models' names for whoever lists the folder, and a digest of what the profile is
specific to, so two configurations never share a file:

- each model's identity (``model_identity``): the content of its weights (``models.identity.fingerprint``), wherever
  they lie. Other weights under the same name make another file, and the profile is measured again; a copy of the
  same weights (moved, touched, downloaded again) finds its profile;
- the sampling settings exactly (``repr`` of each float), for the calibration profile;
- the dtype ("gguf" on the llama.cpp backend) and the device, for the latency profile;
- what runs the models (``run_name``): the draft's name carries the backend and the quantization it ran with, the
  target's the backend, so a profile measured on llama.cpp with a q4_0 draft is never found for transformers, nor
  for llama.cpp with the draft as shipped. On transformers, unquantized, a name stays as typed.

``calibration_file`` and ``latency_file`` find a profile or say which command makes it (the caller's exact
command line, where it gives one), naming the files saved for
the same model names under another digest (other weights, or a blockspec that told models apart otherwise) and
a file an earlier blockspec saved under the models' base names, whose name told neither models of the same file
name nor sampling values equal to 6 digits apart: pass one explicitly if it was measured for these models.

Stdlib only, so the command line can name these paths in its help without importing torch.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ..models.cache import PROFILES, cache_root
from ..models.identity import fingerprint
from ..models.presets import PRESETS

_LABEL = re.compile(r"^(?P<base>.+) \((?P<label>[^()]+)\)$")  # an adapter's name: "<name> (int8)", "<name> (Q4_0)"
_SLUG_PART = 40  # characters of each model's name in a file name: three paths must fit in 255
_DIGEST = 16  # hex digits of the digest that ends a profile's file name


def sv_dir() -> Path:
    """Where profiles go by default: ``sv/`` in the model cache (``$BLOCKSPEC_CACHE`` or ~/.cache/blockspec)."""
    return cache_root() / PROFILES


def sampling_key(sampling) -> dict:
    """What a calibration profile is specific to: the target's sampling settings."""
    return {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}


def run_name(name: str, backend: str, quant: str | None = None) -> str:
    """The name profiles know a model by: ``name`` as typed where transformers runs it as it is, else ``name`` with
    what runs it, as the adapters name their models ("<name> (int8)", "<name> (llama.cpp)", "<name> (llama.cpp,
    q4_0)"), so ``SVPolicy.from_cache`` on loaded models finds what the command line saved. The label enters the
    file name and the digest (``model_identity`` keeps it): one backend or quantization never finds another's."""
    if backend == "hf":
        return f"{name} ({quant})" if quant else name
    return f"{name} (llama.cpp, {quant})" if quant else f"{name} (llama.cpp)"


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


def latency_path(target: str, draft: str | None, companion: str | None, dtype: str, device: str) -> Path:
    """The latency profile ``blockspec sv profile`` saves for these models, dtype and device (the target's alone
    with no draft: ``auto.lookup_latency``'s name)."""
    digest = _digest(target, draft, companion, {"dtype": dtype, "device": device})
    return sv_dir() / f"latency-{_slug(target, draft, companion)}-{dtype}-{device.replace(':', '')}-{digest}.json"


def calibration_file(
    target: str, draft: str, companion: str | None, sampling: dict, path=None, command: str | None = None
) -> Path:
    """``path``, else ``profile_path``'s; FileNotFoundError naming the command that makes it: ``command`` (the
    exact command line), else `blockspec sv calibrate` with the same models."""
    if path is not None:
        return _require_file(path, "calibrate", command)
    legacy = _legacy_slug(target, draft, companion) + "-T{temperature:g}-k{top_k}-p{top_p:g}".format(**sampling)
    path = profile_path(target, draft, companion, sampling)
    return _default_file(path, f"calibration-{legacy}.json", "calibrate", command)


def latency_file(
    target: str, draft: str, companion: str | None, dtype: str, device: str, path=None, command: str | None = None
) -> Path:
    """``path``, else ``latency_path``'s; FileNotFoundError naming the command that makes it: ``command`` (the
    exact command line), else `blockspec sv profile` with the same models."""
    if path is not None:
        return _require_file(path, "profile", command)
    legacy = f"latency-{_legacy_slug(target, draft, companion)}-{dtype}-{device}.json"
    return _default_file(latency_path(target, draft, companion, dtype, device), legacy, "profile", command)


def _require_file(path, subcommand: str, command: str | None) -> Path:
    """``path``, or FileNotFoundError naming the command that makes it."""
    if not Path(path).exists():
        raise FileNotFoundError(f"{path} does not exist: run {_making(subcommand, command)} first")
    return Path(path)


def _making(subcommand: str, command: str | None) -> str:
    """The command that makes a profile, in backquotes: ``command`` as given, else the subcommand in words."""
    return f"`{command}`" if command else f"`blockspec sv {subcommand}` with the same models"


def model_identity(name: str | None) -> str:
    """What names ``name``'s weights: a preset by its name and pinned sha256; a file, a model folder, or a hub id in
    the local Hugging Face cache by their content (``identity.fingerprint``: a sample of its config, weight and
    tokenizer files); anything else (a companion ``prefix:K``, an adapter's own name) as it is. A loaded model's
    label (``"<name> (int8)"``) stays part of it."""
    if name is None:
        return "none"
    if name in PRESETS:  # as earlier blockspecs wrote it, so their profiles of the bundled models are found
        return f"preset {name} sha256 {PRESETS[name].sha256}"
    labelled = _LABEL.match(name)
    if labelled and not Path(name).exists():  # no hub id has a space: look none up (importing huggingface_hub)
        return f"{model_identity(labelled['base'])} ({labelled['label']})"
    return fingerprint(name) or name


def _digest(target: str, draft: str | None, companion: str | None, extra: dict) -> str:
    identity = [model_identity(target), model_identity(draft), model_identity(companion), extra]
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:_DIGEST]


def _slug(*names) -> str:
    return "-".join(
        re.sub(r"[^A-Za-z0-9.-]+", "_", Path(str(n).rstrip("/")).name)[:_SLUG_PART].strip("_") or "_" for n in names
    )


def _legacy_slug(*names) -> str:
    """The names of an earlier blockspec's profiles: base names only."""
    return "-".join(re.sub(r"[^A-Za-z0-9.:-]+", "_", Path(str(n)).name).replace(":", "") for n in names)


def _default_file(path: Path, legacy_name: str, subcommand: str, command: str | None) -> Path:
    """``path`` if it exists, else FileNotFoundError naming the command that makes it and the profiles saved for
    the same model names that a user may know to be right: under another digest, or an earlier blockspec's name."""
    if path.exists():
        return path
    stem = path.name[: -(_DIGEST + len(".json"))]  # up to the digest
    others = sorted(str(p) for p in path.parent.glob(f"{stem}{'[0-9a-f]' * _DIGEST}.json"))
    found = []
    if others:
        found.append(
            f"{', '.join(others)} {'was' if len(others) == 1 else 'were'} saved for the same names under another "
            "digest: for other weights or settings, an earlier copy of these, or by a blockspec that told models "
            "apart by path and modification time"
        )
    legacy = path.with_name(legacy_name)
    if legacy.exists():
        found.append(
            f"{legacy} was saved by an earlier blockspec, whose file names told apart neither models of the same file "
            "name nor sampling values equal to 6 digits"
        )
    if found:
        option = {"calibrate": "--sv-profile", "profile": "--latency"}[subcommand]
        again = f"`{command}`" if command else f"`blockspec sv {subcommand}` again"
        raise FileNotFoundError(
            f"{path} does not exist; {'; '.join(found)}: pass one with {option} if it was measured for these models, "
            f"or run {again}"
        )
    return _require_file(path, subcommand, command)
