"""Companion models for Speculative Verification (SV; Kim et al., arXiv 2509.24328).

A companion is a small model that shares the target's tokenizer and scores each step's drafted block with one
forward, so SV can predict how much of the block the target will accept and choose how much of it to verify.
Like the draft, it keeps its own KV cache, rolled back to the committed tokens after every step: any
``HFModel`` can be one. The built-in one, ``target_prefix``, is the target's first k decoder layers under its
own final norm and output head, sharing the target's weights; its cost: docs/guide/sv.md ("Choices").
"""

from __future__ import annotations

import copy

import torch

from .base import check_shared_vocabulary, target_vocabulary
from .hf import HFModel
from .load import load_model


def target_prefix(target, layers: int) -> HFModel:
    """The target's first ``layers`` decoder layers under its own final norm and output head, as an HFModel.

    ``target`` is an HFModel or a transformers PreTrainedModel of a decoder-only family with ``model.layers``,
    ``model.norm`` and ``lm_head`` (Qwen2, Llama, ...). Every parameter is the target's own object, so the
    companion adds no weights; it has its own cache, so using it never disturbs the target's.
    """
    target = _as_hf(target)
    source = target.model
    body = getattr(source, "model", None)
    shared = ("embed_tokens", "layers", "norm", "rotary_emb")
    if body is None or not (all(hasattr(body, name) for name in shared) and hasattr(source, "lm_head")):
        raise ValueError(
            f"{type(source).__name__}: a target-prefix companion needs a decoder-only model with model.embed_tokens,"
            " model.layers, model.norm, model.rotary_emb and lm_head (Qwen2, Llama, ...)"
        )
    if not 1 <= layers < target.num_layers:
        raise ValueError(
            f"a target-prefix companion of {target.name} takes 1 to {target.num_layers - 1} layers, got {layers}"
        )

    config = copy.deepcopy(source.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):  # no memory, no initialisation: every weight is replaced by the target's below
        prefix = type(source)(config)
    prefix.model.embed_tokens = body.embed_tokens
    prefix.model.layers = torch.nn.ModuleList(body.layers[:layers])
    prefix.model.norm = body.norm
    prefix.model.rotary_emb = body.rotary_emb
    prefix.lm_head = source.lm_head
    prefix.generation_config = copy.deepcopy(source.generation_config)  # same EOS ids as the target
    left_behind = [name for name, tensor in [*prefix.named_parameters(), *prefix.named_buffers()] if tensor.is_meta]
    if left_behind:  # a family with more top-level modules than the ones shared above
        raise ValueError(f"{type(source).__name__}: cannot build a target-prefix companion, unshared {left_behind}")
    return HFModel(prefix, target.tokenizer, name=f"{target.name}[:{layers}]")


def load_companion(
    spec: str,
    target,
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    progress: bool = True,
    allow_download: bool = False,
) -> HFModel:
    """``prefix:K`` is the target's first K layers (``target_prefix``); anything else is loaded by ``load_model``
    (a preset, a GGUF file, a directory or a hub id: downloaded only with ``allow_download``) and must share the
    target's tokenizer."""
    target = _as_hf(target)
    if spec.startswith("prefix:"):
        try:
            layers = int(spec.removeprefix("prefix:"))
        except ValueError:
            raise ValueError(f"a target-prefix companion is written prefix:K (K an integer), got {spec!r}") from None
        return target_prefix(target, layers)
    companion = load_model(spec, dtype=dtype, device=device, progress=progress, allow_download=allow_download)
    try:
        check_shared_vocabulary(target, companion, target_vocabulary(target), "companion")
    except ValueError as error:
        raise ValueError(f"companion {spec!r} must share the target's tokenizer ({error})") from error
    return companion


def _as_hf(model) -> HFModel:
    return model if isinstance(model, HFModel) else HFModel(model)
