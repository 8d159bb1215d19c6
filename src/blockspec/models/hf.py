"""HFModel: the LanguageModel interface over a transformers causal LM, with a slot-indexed KV cache.

transformers' DynamicCache cuts every row at once (``crop(-k)``) and grows by concatenation. Speculative
decoding needs per-row rollback, so the cache here is a preallocated buffer of *slots*: each forward appends
S slots to every row; each slot records the position of the token in it, or -1 for a hole (a rolled-back
token or padding). An explicit 4D attention mask lets a token see exactly the earlier non-hole slots of its
row, and explicit position ids keep every row's positions contiguous, so holes cost nothing but memory until
an occasional compaction squeezes them out. Rolling back is a mask update: free. Prompts are prefilled in
groups of similar length (``prefill_groups``), so a batch's short prompts are not padded to its longest; a prompt
longer than the prefill budget is prefilled in chunks, each attending to the ones before it through the cache.

With that explicit mask, transformers' sdpa attention repeats each key/value head of a grouped-query model for
its query heads whenever more than one token is scored: a copy of the whole cache in every layer of every
verification forward. During its own forwards HFModel switches sdpa models to ``grouped_sdpa`` below, which
attends in place instead; between them the caller's model is as the caller left it (its own ``generate`` runs
transformers' kernels). Attention the explicit mask cannot express (flash kernels, short sliding windows) is refused.

This module and ``presets`` are the only ones that import transformers; nothing imports this module eagerly.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..defaults import DTYPES, QUANTS
from .base import left_pad
from .convert import load_preset
from .presets import PRESETS
from .quant import quantize

log = logging.getLogger(__name__)


PREFILL_TOKENS = 2048  # padded tokens per prefill forward: enough for efficient matmuls, bounds activations


class HFModel:
    """Wraps an already-loaded transformers ``PreTrainedModel`` (and optionally its tokenizer), without changing it:
    only for the duration of HFModel's own forwards is the model in eval mode and, if it uses sdpa attention, on
    ``grouped_sdpa``, which computes the same attention without copying the cache. Raises ValueError for a model
    whose attention the slot mask cannot express (``_unsupported_attention``).

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
        reason = _unsupported_attention(config)
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
        self._layers: list[_SlotLayer] = []
        self._slot_pos = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [B, T]: position or -1
        self._lengths = torch.zeros(0, dtype=torch.long, device=self.device)  # [B]

    def __repr__(self) -> str:
        return f"HFModel({self.name}, {self.dtype}, {self.device})"

    @property
    def lengths(self) -> torch.Tensor:
        return self._lengths

    # --- the LanguageModel interface ----------------------------------------------------------------------

    def prefill(self, sequences: list[list[int]]) -> None:
        batch, longest = len(sequences), max((len(s) for s in sequences), default=0)
        if self.max_length is not None and longest > self.max_length:
            raise ValueError(f"{self.name}: a prompt of {longest} tokens exceeds the context of {self.max_length}")
        self._layers = [_SlotLayer() for _ in range(self.num_layers)]
        self._slot_pos = torch.full((batch, longest), -1, dtype=torch.long, device=self.device)
        self._lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long, device=self.device)
        done, total = 0, sum(len(s) for s in sequences)
        for rows in prefill_groups([len(s) for s in sequences], self.prefill_tokens):
            tokens, valid = left_pad([sequences[b] for b in rows])
            tokens, valid, width = tokens.to(self.device), valid.to(self.device), tokens.shape[1]
            positions = valid.cumsum(1) - 1
            slot_pos = positions.masked_fill(~valid, -1)
            part = [_SlotLayer() for _ in range(self.num_layers)]
            for layer in part:
                layer.reserve(width)
            # One forward per group, except for a row alone over the budget: its columns [start, end) go in chunks,
            # each appended to `part` and attending to the slots before it, as a decoding forward does.
            chunk = max(1, self.prefill_tokens // len(rows))
            for start in range(0, width, chunk):
                end = min(start + chunk, width)
                self._call(part, tokens[:, start:end], slot_pos[:, :end], positions[:, start:end], logits_to_keep=1)
                done += int(valid[:, start:end].sum())
                if self.on_prefill is not None:
                    self.on_prefill(done, total)
            rows = torch.tensor(rows, device=self.device)
            self._slot_pos[rows, longest - width :] = slot_pos  # right-aligned: every row's last token at the end
            for layer, filled in zip(self._layers, part):
                layer.place(rows, filled, batch, longest)

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return self._run(tokens, valid, logits_to_keep=0)

    def rollback(self, lengths: torch.Tensor) -> None:
        if bool((lengths > self._lengths).any()):
            raise ValueError(f"rollback can only shorten rows: {lengths.tolist()} > {self._lengths.tolist()}")
        self._slot_pos = self._slot_pos.masked_fill(self._slot_pos >= lengths[:, None], -1)
        self._lengths = lengths.clone()

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.device)
        for layer in self._layers:
            layer.select(rows)
        self._slot_pos, self._lengths = self._slot_pos[rows], self._lengths[rows]

    # --- internals ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _run(self, tokens: torch.Tensor, valid: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
        batch, new = tokens.shape
        self._make_room(new)
        old = self._slot_pos.shape[1]
        positions = self._lengths[:, None] + valid.cumsum(1) - 1  # [B, S]: contiguous per row over valid slots
        if self.max_length is not None and bool((positions[valid] >= self.max_length).any()):
            raise ValueError(f"{self.name}: the sequence outgrew the model's context of {self.max_length} tokens")
        slot_pos = torch.cat([self._slot_pos, positions.masked_fill(~valid, -1)], dim=1)  # [B, T+S]
        logits = self._call(self._layers, tokens, slot_pos, positions, logits_to_keep)
        self._slot_pos = slot_pos
        self._lengths = self._lengths + valid.sum(1)
        assert all(layer.used == old + new for layer in self._layers)
        return logits

    @torch.no_grad()
    def _call(
        self,
        layers: list[_SlotLayer],
        tokens: torch.Tensor,
        slot_pos: torch.Tensor,
        positions: torch.Tensor,
        logits_to_keep: int,
    ) -> torch.Tensor:
        """The model's forward of ``tokens`` [B, S] at ``positions``, appended to ``layers``; ``slot_pos`` [B, T+S]
        covers the cached slots and the new ones."""
        with self._own_settings():
            return self.model(
                input_ids=tokens,
                attention_mask=_slot_mask(slot_pos, tokens.shape[1], self.dtype),
                position_ids=positions.clamp(min=0),  # a hole's position is irrelevant: nobody attends to it
                past_key_values=Cache(layers=layers),
                use_cache=True,
                logits_to_keep=logits_to_keep,
            ).logits

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

    def _make_room(self, new: int) -> None:
        """Compact when holes are at least half the slots or the buffers are full; grow only if still needed."""
        used = self._slot_pos.shape[1]
        longest = int(self._lengths.max()) if len(self._lengths) else 0
        capacity = self._layers[0].capacity if self._layers and self._layers[0].keys is not None else 0
        if used > 32 and (used >= 2 * longest or used + new > capacity):
            # Stable sort puts each row's holes (-1) first and its tokens in position order after them; the
            # last `longest` columns hold every row's tokens, right-aligned.
            order = self._slot_pos.argsort(dim=1, stable=True)[:, used - longest :]
            for layer in self._layers:
                layer.gather(order)
            self._slot_pos = self._slot_pos.gather(1, order)
            log.debug("%s: compacted the KV cache from %d to %d slots", self.name, used, longest)
        for layer in self._layers:
            layer.reserve(self._slot_pos.shape[1] + new)


GROUPED_SDPA = "blockspec_grouped_sdpa"


def grouped_sdpa(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """transformers' sdpa attention, except that several query tokens under a 4D mask attend to grouped
    key/value heads in place: the query heads sharing a key/value head are stacked along the query axis (and the
    mask, which is small, repeated for each), instead of the keys and values being copied once per query head.
    """
    batch, heads, length, dim = query.shape
    groups = key.shape[1]
    if (
        length == 1
        or groups == heads
        or dropout
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or kwargs.get("position_bias") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    per_group = heads // groups
    stacked = query.reshape(batch, groups, per_group * length, dim)  # head g * per_group + r: group g, block r
    mask = attention_mask.repeat(1, 1, per_group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


def _register_grouped_sdpa() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # other callers' 2D masks are built as for sdpa


_register_grouped_sdpa()

# The attention implementations known to apply the explicit 4D slot mask: in transformers 5.23 eager and sdpa add it
# to the scores. Flash kernels (flash_attention_2/3/4, hub kernels such as kernels-community/flash-attn2) read a 2D
# padding mask instead; paged|eager needs continuous batching's cache; flex_attention adds a 4D mask in a score_mod,
# but its compiled CPU kernel aborted the process on the slot mask (torch 2.13).
MASKED_ATTENTION = ("eager", "sdpa", GROUPED_SDPA)


def _unsupported_attention(config) -> str | None:
    """Why the slot mask cannot give the decoder of text config ``config`` its attention, or None if it can."""
    implementation = config._attn_implementation
    if implementation not in MASKED_ATTENTION:
        return (
            f"attention implementation {implementation!r} is not supported: the slot cache needs one known to "
            f"apply an explicit 4D attention mask ({', '.join(MASKED_ATTENTION)}); load the model with "
            "attn_implementation='sdpa'"
        )
    layer_types = getattr(config, "layer_types", None)
    other = sorted({t for t in layer_types or () if t not in ("full_attention", "sliding_attention")})
    if other:
        return f"attention layers of type {other} are not supported: the slot cache holds full and sliding attention"
    # A window counts where the config switches it on (Qwen2 configs carry one with use_sliding_window=False), on
    # layers that slide (every layer of a config without layer types), and only if a row can outgrow it.
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    reach = getattr(config, "max_position_embeddings", None)
    slides = layer_types is None or "sliding_attention" in layer_types
    if window is not None and slides and (reach is None or window < reach):
        limit = "the model's unstated context" if reach is None else f"the context of {reach}"
        return (
            f"sliding_attention over a window of {window} tokens, shorter than {limit}, is not supported: the "
            "slot mask would silently give it full attention"
        )
    return None


def _slot_mask(slot_pos: torch.Tensor, new: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [B, 1, S, T+S] for the last ``new`` slots of ``slot_pos`` [B, T+S].

    Query slot q sees key slot k when k <= q and k holds a token (not a hole); every slot also sees itself, so
    a hole's query row is never all -inf (that would put NaN in its keys and values, and NaN * 0 is NaN).
    """
    total = slot_pos.shape[1]
    key = torch.arange(total, device=slot_pos.device)
    query = key[total - new :, None]  # [S, 1]
    visible = ((key <= query) & (slot_pos[:, None, :] >= 0)) | (key == query)  # [B, S, T+S]
    mask = torch.zeros(visible.shape, dtype=dtype, device=slot_pos.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min)[:, None]


class _SlotLayer(DynamicLayer):
    """One layer's keys and values in a preallocated [B, H, capacity, D] buffer; ``used`` slots are filled."""

    def __init__(self):
        super().__init__()
        self.used = 0
        self.capacity = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys is None:
            self.keys = key_states.new_empty(*key_states.shape[:2], self.capacity, key_states.shape[3])
            self.values = value_states.new_empty(*value_states.shape[:2], self.capacity, value_states.shape[3])
        new = key_states.shape[2]
        self.keys[:, :, self.used : self.used + new] = key_states
        self.values[:, :, self.used : self.used + new] = value_states
        self.used += new
        return self.keys[:, :, : self.used], self.values[:, :, : self.used]

    def get_seq_length(self) -> int:
        return self.used

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.used + query_length, 0

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` in all; grows by doubling, so appends are amortised O(1)."""
        if slots <= self.capacity:
            return
        self.capacity = max(slots, 2 * self.capacity, 64)
        if self.keys is not None:
            keys = self.keys.new_empty(*self.keys.shape[:2], self.capacity, self.keys.shape[3])
            values = self.values.new_empty(*self.values.shape[:2], self.capacity, self.values.shape[3])
            keys[:, :, : self.used] = self.keys[:, :, : self.used]
            values[:, :, : self.used] = self.values[:, :, : self.used]
            self.keys, self.values = keys, values

    def gather(self, order: torch.Tensor) -> None:
        """Keep, per row b, the slots ``order[b]`` [T'] (in that order) as the first T' slots."""
        if self.keys is None:
            return
        index = order[:, None, :, None].expand(-1, self.keys.shape[1], -1, self.keys.shape[3])
        kept = order.shape[1]
        self.keys[:, :, :kept] = self.keys[:, :, : self.used].gather(2, index)
        self.values[:, :, :kept] = self.values[:, :, : self.used].gather(2, index)
        self.used = kept

    def place(self, rows: torch.Tensor, part: _SlotLayer, batch: int, slots: int) -> None:
        """Copy ``part``'s filled slots into rows ``rows`` (of ``batch``), right-aligned in the first ``slots``."""
        if part.keys is None:
            return
        if self.keys is None:  # zeros, not garbage, in the slots no row fills: masked keys must still be finite
            self.lazy_initialization(part.keys, part.values)
            self.capacity = max(self.capacity, slots)
            self.keys = part.keys.new_zeros(batch, part.keys.shape[1], self.capacity, part.keys.shape[3])
            self.values = part.values.new_zeros(batch, part.values.shape[1], self.capacity, part.values.shape[3])
            self.used = slots
        self.keys[rows, :, slots - part.used : slots] = part.keys[:, :, : part.used]
        self.values[rows, :, slots - part.used : slots] = part.values[:, :, : part.used]

    def select(self, rows: torch.Tensor) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]


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


def load_model(
    name_or_path: str,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    progress: bool = True,
    allow_download: bool = False,
    quant: str | None = None,
) -> HFModel:
    """Load a causal LM as an HFModel: a bundled preset name, a GGUF file, a local directory or a hub id.

    Hub ids resolve from the local Hugging Face cache only: a name that is none of these is refused with the
    closest preset name, before any network access, unless ``allow_download=True`` lets a hub id be downloaded.
    The dtype and the device are checked before anything loads. GGUF files need the ``gguf`` and ``accelerate``
    packages (the ``hf`` extra). ``quant="int8"`` quantizes the loaded model's linear layers (``models.quant``: for
    a draft on the CPU; the rest of the model then runs in float32).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    elif os.path.isdir(name_or_path) or allow_download or _in_hub_cache(name_or_path):
        local = not allow_download
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, local_files_only=local)
        tokenizer = _optional_tokenizer(name_or_path, local_files_only=local)
    else:
        raise ValueError(_unknown_model_message(name_or_path, PRESETS))
    model = model.to(target_device) if quant is None else quantize(model, quant)
    return HFModel(model, tokenizer, name=name_or_path if quant is None else f"{name_or_path} ({quant})")


def _in_hub_cache(name: str) -> bool:
    """Whether hub id ``name`` has a config in the local Hugging Face cache: a file-system look-up, no network."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)  # else None, or a "known absent" marker
    except HFValidationError:  # not even shaped like a hub id (a mistyped path, ...)
        return False


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
        return AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_files_only)
    except (OSError, ValueError) as error:  # a bare model directory without tokenizer files
        log.warning("%s: no tokenizer (%s); pass token ids instead of strings", name_or_path, error)
        return None
