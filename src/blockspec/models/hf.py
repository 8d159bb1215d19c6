"""HFModel: the LanguageModel interface over a transformers causal LM, with a per-row KV cache (`slots`).

Prompts are prefilled in groups of similar length (``prefill_groups``), so a batch's short prompts are not padded to
its longest; a prompt longer than the prefill budget is prefilled in chunks, each attending to the ones before it
through the cache. During its own forwards HFModel switches sdpa models to ``attention.grouped_sdpa``; between them
the caller's model is as the caller left it (its own ``generate`` runs transformers' kernels).

HFModel is a ``TreeLanguageModel``: ``forward_tree`` scores a drafted tree in one forward (or grows the waiting tree
by a level), each node at its depth's position under an ancestor mask (``slots.tree_mask``), and ``commit`` moves
the accepted path's keys and values to the tree's first slots, so a tree step grows the cache by the path it keeps
and never by the nodes it drops.

``load_model`` loads one by name: a bundled preset (`convert`), a GGUF file, a folder or a hub id.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache

from ..defaults import BACKENDS, DTYPES, LLAMACPP_QUANTS, QUANTS
from .attention import GROUPED_SDPA, unsupported_attention
from .base import check_tree, committed_path, left_pad
from .convert import load_preset
from .identity import hub_snapshot
from .presets import PRESETS
from .quant import quantize
from .slots import SlotCache, SlotLayer, slot_mask, tree_mask

if TYPE_CHECKING:
    from .llamacpp import LlamaCppModel
    from .vocab_cut import VocabularyCut

log = logging.getLogger(__name__)


PREFILL_TOKENS = 2048  # padded tokens per prefill forward: enough for efficient matmuls, bounds activations


class HFModel:
    """Wraps an already-loaded transformers ``PreTrainedModel`` (and optionally its tokenizer), without changing it:
    only for the duration of HFModel's own forwards is the model in eval mode and, if it uses sdpa attention, on
    ``grouped_sdpa``, which computes the same attention without copying the cache. Raises ValueError for a model
    whose attention the slot mask cannot express (``attention.unsupported_attention``).

    ``on_prefill(done, total)``, if set, is called after each prefill forward with the prompt tokens prefilled so
    far and the total: a long prompt on a slow CPU takes minutes, and a caller can show that it advances.
    """

    def __init__(
        self, model, tokenizer=None, *, name: str | None = None, on_prefill: Callable[[int, int], None] | None = None
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.name = name or getattr(model, "name_or_path", None) or type(model).__name__
        head = model.get_output_embeddings()  # an int8 (quantized) head has out_features but no weight tensor
        self.vocab_size = int(getattr(head, "out_features", None) or head.weight.shape[0])
        config = model.config.get_text_config(decoder=True)
        reason = unsupported_attention(config)
        if reason:
            raise ValueError(f"{self.name}: {reason}")
        # What `_own_settings` switches per forward, listed once: every module, and every config a module reads its
        # attention implementation from (a target-prefix companion's layers read the target's); no config for a
        # model whose attention does not dispatch on it, where set_attn_implementation would switch none either.
        self._modules = tuple(model.modules())
        configs = {id(c): c for m in self._modules if isinstance(c := getattr(m, "config", None), PreTrainedConfig)}
        self._configs = tuple(configs.values()) if model._can_set_attn_implementation() else ()
        self.max_length = getattr(config, "max_position_embeddings", None)
        self.num_layers = int(config.num_hidden_layers)
        self.eos_token_ids = _eos_ids(model, tokenizer)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.prefill_tokens = PREFILL_TOKENS
        self.on_prefill = on_prefill
        self._cache = SlotCache(self.num_layers, self.device)
        self._tree: _Tree | None = None  # the nodes of the forward_tree calls since the last commit

    def __repr__(self) -> str:
        return f"HFModel({self.name}, {self.dtype}, {self.device})"

    @property
    def lengths(self) -> torch.Tensor:
        return self._cache.lengths

    # --- the LanguageModel interface ----------------------------------------------------------------------

    def prefill(self, sequences: list[list[int]]) -> None:
        longest = max((len(s) for s in sequences), default=0)
        if self.max_length is not None and longest > self.max_length:
            raise ValueError(f"{self.name}: a prompt of {longest} tokens exceeds the context of {self.max_length}")
        self._cache.start([len(s) for s in sequences])
        self._tree = None
        done, total = 0, sum(len(s) for s in sequences)
        for rows in prefill_groups([len(s) for s in sequences], self.prefill_tokens):
            tokens, valid = left_pad([sequences[b] for b in rows])
            tokens, valid, width = tokens.to(self.device), valid.to(self.device), tokens.shape[1]
            positions = valid.cumsum(1) - 1
            slot_pos = positions.masked_fill(~valid, -1)
            part = self._cache.group(width)
            # One forward per group, except for a row alone over the budget: its columns [start, end) go in chunks,
            # each appended to `part` and attending to the slots before it, as a decoding forward does.
            chunk = max(1, self.prefill_tokens // len(rows))
            for start in range(0, width, chunk):
                end = min(start + chunk, width)
                mask = slot_mask(slot_pos[:, :end], end - start, self.dtype)
                self._call(part, tokens[:, start:end], mask, positions[:, start:end], logits_to_keep=1)
                done += int(valid[:, start:end].sum())
                if self.on_prefill is not None:
                    self.on_prefill(done, total)
            self._cache.place(rows, part, slot_pos)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        self._no_tree_pending("forward")
        if tokens.numel() == 0:
            return self._no_logits(tokens)
        return self._run(tokens, valid, logits_to_keep=0)

    def rollback(self, lengths: torch.Tensor) -> None:
        self._no_tree_pending("rollback")
        self._cache.rollback(lengths)

    def select(self, rows: torch.Tensor) -> None:
        self._no_tree_pending("select")
        self._cache.select(rows)

    # --- the TreeLanguageModel interface --------------------------------------------------------------------

    @torch.no_grad()
    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        tokens, parents, valid = (t.to(self.device) for t in (tokens, parents, valid))
        tree = self._tree  # the nodes waiting for a commit, which this forward's nodes grow (None: a new tree)
        waiting = 0 if tree is None else tree.parents.shape[1]
        before = None if tree is None else (tree.parents, tree.valid)
        ancestors = check_tree(tokens, parents, valid, len(self.lengths), before)  # [B, P+N, P+N]
        nodes = tokens.shape[1]
        if tree is not None:
            parents, valid = torch.cat([tree.parents, parents], dim=1), torch.cat([tree.valid, valid], dim=1)
        # A node and its ancestors among all the tree's nodes, so 1 for a child of the root: [B, N] for the new ones
        depth = ancestors[:, waiting:].sum(2)
        positions = self.lengths[:, None] + depth - 1  # [B, N]
        if self.max_length is not None and bool((positions[valid[:, waiting:]] >= self.max_length).any()):
            raise ValueError(f"{self.name}: the tree outgrew the model's context of {self.max_length} tokens")
        start = self._cache.extend_tree(nodes, waiting)
        if tokens.numel() == 0:
            logits = self._no_logits(tokens)
        else:  # the new nodes' queries over the cached slots, the waiting nodes and their own
            mask = tree_mask(self._cache.slot_pos, ancestors, valid, self.dtype)[:, :, waiting:]
            logits = self._call(self._cache.layers, tokens, mask, positions, logits_to_keep=0)
        self._tree = _Tree(parents, valid, start)
        return logits

    def commit(self, path: torch.Tensor) -> None:
        tree, columns = committed_path(self.name, self._tree, path, self.device)  # columns [B, L]
        self._cache.keep_path(tree.start, columns)
        self._tree = None

    # --- internals ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _run(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        positions, slot_pos = self._cache.extend(valid)  # [B, S], [B, T+S]
        if self.max_length is not None and bool((positions[valid] >= self.max_length).any()):
            raise ValueError(f"{self.name}: the sequence outgrew the model's context of {self.max_length} tokens")
        mask = slot_mask(slot_pos, tokens.shape[1], self.dtype)
        logits = self._call(self._cache.layers, tokens, mask, positions, logits_to_keep)
        self._cache.commit(slot_pos, valid)
        return logits

    @torch.no_grad()
    def _call(
        self,
        layers: list[SlotLayer],
        tokens: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        logits_to_keep: int,
    ) -> torch.Tensor:
        """The model's forward of ``tokens`` [B, S] at ``positions``, appended to ``layers``, under the additive
        ``mask`` [B, 1, S, T+S] over the cached slots and the new ones (``slot_mask``, ``tree_mask``)."""
        with self._own_settings():
            return self.model(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions.clamp(min=0),  # a hole's position is irrelevant: nobody attends to it
                past_key_values=Cache(layers=[*layers]),  # a list of the base type transformers declares
                use_cache=True,
                logits_to_keep=logits_to_keep,
            ).logits

    def _no_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logits [B, S, V] of ``tokens`` [B, S] with no rows or no tokens: none to score, and transformers'
        forward takes no empty input."""
        return torch.zeros(*tokens.shape, self.vocab_size, dtype=self.dtype, device=self.device)

    def _no_tree_pending(self, call: str) -> None:
        if self._tree is not None:
            raise RuntimeError(f"{self.name}: {call} after forward_tree; commit the tree's accepted path first")

    @contextlib.contextmanager
    def _own_settings(self) -> Iterator[None]:
        """Eval mode, and ``grouped_sdpa`` for configs on sdpa, while the block runs; then (also after an error) the
        caller's flags and implementations are back. Flags are set one by one, so a mix of train and eval returns."""
        training = [module for module in self._modules if module.training]
        sdpa = [config for config in self._configs if config._attn_implementation == "sdpa"]
        for module in training:
            module.training = False
        for config in sdpa:  # the attribute set_attn_implementation writes, minus checks a model on sdpa passes
            config._attn_implementation_internal = GROUPED_SDPA
        try:
            yield
        finally:
            for module in training:
                module.training = True
            for config in sdpa:
                config._attn_implementation_internal = "sdpa"


@dataclass(frozen=True)
class _Tree:
    """A tree awaiting its commit (one or several forwards): its nodes' ``parents`` and ``valid`` [B, N], in slots
    from ``start``."""

    parents: torch.Tensor
    valid: torch.Tensor
    start: int


def prefill_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows to prefill together: by decreasing length, as many as fit ``budget`` tokens once padded to the
    group's longest (at least one), so short prompts are not padded to the batch's longest. Empty rows need no
    forward and are left out."""
    groups: list[list[int]] = []
    for b in sorted((b for b, n in enumerate(lengths) if n), key=lambda b: -lengths[b]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        for token in [eos] if isinstance(eos, int) else (eos or []):
            if token not in ids:
                ids.append(int(token))
    return tuple(ids)


# --- loading ------------------------------------------------------------------------------------------------

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
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, trust_remote_code=False)
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
