"""The attention HFModel runs under its slot mask (`slots`), and the check that a model's attention can run so.

With the slot cache's explicit 4D mask, transformers' sdpa attention repeats each key/value head of a grouped-query
model for its query heads whenever more than one token is scored: a copy of the whole cache in every layer of every
verification forward. ``grouped_sdpa``, registered with transformers under ``GROUPED_SDPA`` when this module is
imported, attends in place instead; HFModel switches sdpa models to it during its own forwards only. Attention the
explicit mask cannot express (flash kernels, short sliding windows) is refused (``unsupported_attention``).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

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


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # other callers' 2D masks are built as for sdpa

# The attention implementations known to apply the explicit 4D slot mask: in transformers 5.23 eager and sdpa add it
# to the scores. Flash kernels (flash_attention_2/3/4, hub kernels such as kernels-community/flash-attn2) read a 2D
# padding mask instead; paged|eager needs continuous batching's cache; flex_attention adds a 4D mask in a score_mod,
# but its compiled CPU kernel aborted the process on the slot mask (torch 2.13).
MASKED_ATTENTION = ("eager", "sdpa", GROUPED_SDPA)


def unsupported_attention(config) -> str | None:
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
