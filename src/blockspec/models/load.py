"""``load_model``: a causal LM by name (a bundled preset, a GGUF file, a model folder or a hub id) on either backend,
llama.cpp (``llamacpp``) or transformers (``hf``), with the checks that come before anything loads (``resolve_device``,
``resolve_backend``, ``refuse_model_code``). transformers' modeling code is imported only for the ``hf`` backend, so a
llama.cpp run does not pay the seconds that import costs.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from ..defaults import BACKENDS, DTYPES, LLAMACPP_QUANTS, QUANTS
from .identity import hub_snapshot
from .presets import PRESETS

if TYPE_CHECKING:
    from .hf import HFModel
    from .llamacpp import LlamaCppModel
    from .vocab_cut import VocabularyCut

log = logging.getLogger(__name__)

DEVICE_TYPES = ("cpu", "cuda", "mps")


def resolve_device(device: str) -> torch.device:
    """The torch device for ``device``: ``auto`` (CUDA when present, else the CPU), ``cpu``, ``cuda``, ``cuda:N``
    or ``mps``. Raises ValueError for any other string and for a device this torch cannot use (CUDA on a CPU-only
    build, a missing GPU index), so a caller can refuse it before loading anything."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):  # torch's message lists every backend it was built to name, usable or not
        resolved = None
    if resolved is None or resolved.type not in DEVICE_TYPES:
        raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda, cuda:N or mps")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {device!r} requested but torch has no CUDA here (torch.cuda.is_available() is "
                "False); use --device cpu or auto"
            )
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise ValueError(
                f"device {device!r} requested but torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            f"device {device!r} requested but torch has no MPS here (torch.backends.mps.is_available() "
            "is False); use --device cpu or auto"
        )
    return resolved


@overload
def load_model(
    name_or_path: str,
    *,
    dtype: str = ...,
    device: str = ...,
    progress: bool = ...,
    allow_download: bool = ...,
    quant: str | None = ...,
    backend: Literal["hf"] = ...,
    vocabulary: None = ...,
) -> HFModel: ...
@overload
def load_model(
    name_or_path: str,
    *,
    dtype: str = ...,
    device: str = ...,
    progress: bool = ...,
    allow_download: bool = ...,
    quant: str | None = ...,
    backend: str,
    vocabulary: int | None = ...,
) -> HFModel | LlamaCppModel | VocabularyCut: ...
def load_model(
    name_or_path: str,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    progress: bool = True,
    allow_download: bool = False,
    quant: str | None = None,
    backend: str = "hf",
    vocabulary: int | None = None,
) -> HFModel | LlamaCppModel | VocabularyCut:
    """Load a causal LM as an HFModel: a bundled preset name, a GGUF file, a local directory or a hub id; with
    ``backend="llamacpp"`` a preset or GGUF file as a ``llamacpp.LlamaCppModel`` instead (CPU only; the GGUF's own
    quantization, so ``dtype`` does not apply; ``quant`` is one of LLAMACPP_QUANTS there, a requantized copy;
    ``vocabulary`` runs a copy whose vocabulary is cut to that many ids and the special tokens, a cheaper draft:
    ``vocab_cut``). ``resolve_backend`` picks one.

    Hub ids resolve from the local Hugging Face cache only: a name that is none of these is refused with the
    closest preset name, before any network access, unless ``allow_download=True`` lets a hub id be downloaded.
    The dtype and the device are checked before anything loads. GGUF files need the ``gguf`` and ``accelerate``
    packages (the ``hf`` extra). ``quant="int8"`` quantizes the loaded model's linear layers (``models.quant``: for
    a draft on the CPU; the rest of the model then runs in float32).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "llamacpp":
        if quant not in (None, *LLAMACPP_QUANTS) or resolve_device(device).type != "cpu":
            raise ValueError(
                f"the llama.cpp backend runs on the CPU, quant None or one of {LLAMACPP_QUANTS}; got quant={quant!r} "
                f"on {device}"
            )
        from .llamacpp import load_llamacpp

        with _reading_gguf(None if name_or_path in PRESETS else name_or_path):
            return load_llamacpp(name_or_path, quant=quant, vocabulary=vocabulary, progress=progress)
    if vocabulary is not None:
        raise ValueError("a cut vocabulary (vocabulary=...) runs on the llama.cpp backend only")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    torch_dtype, target_device = getattr(torch, dtype), resolve_device(device)
    if quant is not None and (quant not in QUANTS or target_device.type != "cpu"):
        raise ValueError(f"quant must be one of {QUANTS}, on the CPU only; got {quant!r} on {target_device}")
    from transformers import AutoModelForCausalLM

    from .convert import gguf_tokenizer, load_preset
    from .hf import HFModel
    from .quant import quantize

    if name_or_path in PRESETS:
        model, tokenizer = load_preset(name_or_path, dtype=dtype, progress=progress)
    elif name_or_path.endswith(".gguf"):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"no GGUF file at {name_or_path}")
        folder, file = os.path.split(os.path.abspath(name_or_path))
        with _reading_gguf(name_or_path):
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=file, dtype=torch_dtype, trust_remote_code=False
            )
            tokenizer = gguf_tokenizer(Path(folder, file))
    elif os.path.isdir(name_or_path) or allow_download or hub_snapshot(name_or_path) is not None:
        folder = name_or_path if os.path.isdir(name_or_path) else _hub_config_folder(name_or_path, allow_download)
        if folder is not None:
            refuse_model_code(folder)
        local = not allow_download
        model = AutoModelForCausalLM.from_pretrained(
            name_or_path, dtype=torch_dtype, local_files_only=local, trust_remote_code=False
        )
        tokenizer = _optional_tokenizer(name_or_path, local_files_only=local)
    else:
        raise ValueError(_unknown_model_message(name_or_path, PRESETS))
    # PreTrainedModel.to is decorated with functools.wraps(Module.to), which pyright reads as an unbound function
    model = model.to(target_device) if quant is None else quantize(model, quant)  # pyright: ignore[reportArgumentType]
    return HFModel(model, tokenizer, name=name_or_path if quant is None else f"{name_or_path} ({quant})")


def resolve_backend(backend: str, device: str, *names: str | None) -> str:
    """``backend``, or for ``auto``: ``llamacpp`` when every named model is a preset or GGUF file, the device is the
    CPU and llama-cpp-python is installed (llama.cpp's kernels on the file's own quantization decode the bundled
    pair faster than transformers on dequantized weights: docs/results.md), else ``hf``."""
    import importlib.util

    if backend != "auto":
        if backend not in BACKENDS:
            raise ValueError(f"backend must be auto or one of {BACKENDS}, got {backend!r}")
        return backend
    gguf = all(name in PRESETS or name.endswith(".gguf") for name in names if name)
    if gguf and resolve_device(device).type == "cpu" and importlib.util.find_spec("llama_cpp") is not None:
        return "llamacpp"
    return "hf"


@contextlib.contextmanager
def _reading_gguf(path: str | None) -> Iterator[None]:
    """While the block loads the GGUF file ``path`` (None: a preset, whose bytes are hash-checked), turn a failure
    into a ValueError naming the file when gguf's own reader cannot read the file either: the loaders fail deep in
    the parse of a corrupted or truncated file, with numpy's or struct's words, naming neither the file nor the
    cause. Any other failure (a missing file too) passes unchanged; the file is read again only after a failure."""
    try:
        yield
    except Exception as error:
        if path is None or not os.path.isfile(path) or gguf_readable(path):
            raise
        raise ValueError(f"{path}: not a valid GGUF file; it is truncated or corrupted") from error


def gguf_readable(path: str) -> bool:
    """Whether gguf's reader reads the file at ``path`` whole (header, metadata, every tensor within the file).
    Slow on a large vocabulary (seconds): for the error path."""
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except Exception:  # numpy's and struct's errors, whatever the defect
        return False
    return True


MODEL_CODE_FILES = ("config.json", "tokenizer_config.json")  # where transformers finds an auto_map


def refuse_model_code(folder: str) -> None:
    """Raise ValueError when the model folder ``folder`` maps its model or tokenizer to Python code of its own (an
    ``auto_map`` in config.json or tokenizer_config.json), before anything loads. Every load passes
    ``trust_remote_code=False`` as well (without it transformers asks on stdin, and a "y" runs the folder's code);
    on such a folder transformers would then either fail with advice to trust the code or quietly use its built-in
    class for the ``model_type``, which need not be the model the folder's code defines."""
    for name in MODEL_CODE_FILES:
        try:
            with open(os.path.join(folder, name)) as file:
                config = json.load(file)
        except (OSError, ValueError):  # absent, or unreadable: transformers reports that one itself
            continue
        if isinstance(config, dict) and "auto_map" in config:
            raise ValueError(
                f"{folder}: its {name} maps to Python code in the folder (auto_map); blockspec never runs code "
                "from a model folder"
            )


def _hub_config_folder(name: str, allow_download: bool) -> str | None:
    """The snapshot folder holding hub id ``name``'s config files (MODEL_CODE_FILES), those not in the local cache
    downloaded first when ``allow_download``: where ``refuse_model_code`` looks, before any weights are read."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError

    folder = None
    for file in MODEL_CODE_FILES:
        path = try_to_load_from_cache(name, file)
        if not isinstance(path, str) and allow_download:
            try:
                path = hf_hub_download(name, file)
            except EntryNotFoundError:  # no tokenizer_config.json, say: nothing there maps to code
                path = None
        if isinstance(path, str):
            folder = os.path.dirname(path)
    return folder


def _unknown_model_message(name: str, preset_names) -> str:
    close = difflib.get_close_matches(name.lower(), preset_names, n=1)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"unknown model {name!r}; presets: {', '.join(preset_names)}{suggestion}. Otherwise give a .gguf file, a "
        "model folder, or a Hugging Face hub id already in the local Hugging Face cache; to download a hub id, "
        "pass --allow-download (allow_download=True)"
    )


def _optional_tokenizer(name_or_path: str, *, local_files_only: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_files_only, trust_remote_code=False)
    except (OSError, ValueError) as error:  # a bare model directory without tokenizer files
        log.warning("%s: no tokenizer (%s); pass token ids instead of strings", name_or_path, error)
        return None
