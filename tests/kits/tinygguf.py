"""Tiny transformers Qwen2 models (``tiny.tiny_model``, ``tiny.perturbed``) written as F32 GGUF files that llama.cpp
loads, so the llama.cpp adapter is tested on in-process models, with no download.

The layout is convert_hf_to_gguf.py's for architecture "qwen2": the HF tensors go in unchanged (the writer reverses
numpy's shape into GGUF's, so an HF [out, in] weight is ggml's {in, out}, which llama.cpp expects), and q/k are NOT
permuted: qwen2 ropes in NEOX mode (rotate-half, as transformers does), where llama's converter permutes q/k rows
into interleaved pairs for its NORM mode. The tokenizer mirrors ``tiny.tiny_tokenizer``: byte-level BPE, same
symbols, same ids, and no merge that ever applies (see ``_DEAD_MERGE``)."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import torch

from kits.tiny import tiny_tokenizer

# HF parameter name in one decoder layer -> GGUF tensor kind (its name is gguf.TENSOR_NAMES[kind] + suffix)
_LAYER_TENSORS = {
    "input_layernorm.weight": (gguf.MODEL_TENSOR.ATTN_NORM, ".weight"),
    "self_attn.q_proj.weight": (gguf.MODEL_TENSOR.ATTN_Q, ".weight"),
    "self_attn.q_proj.bias": (gguf.MODEL_TENSOR.ATTN_Q, ".bias"),
    "self_attn.k_proj.weight": (gguf.MODEL_TENSOR.ATTN_K, ".weight"),
    "self_attn.k_proj.bias": (gguf.MODEL_TENSOR.ATTN_K, ".bias"),
    "self_attn.v_proj.weight": (gguf.MODEL_TENSOR.ATTN_V, ".weight"),
    "self_attn.v_proj.bias": (gguf.MODEL_TENSOR.ATTN_V, ".bias"),
    "self_attn.o_proj.weight": (gguf.MODEL_TENSOR.ATTN_OUT, ".weight"),
    "post_attention_layernorm.weight": (gguf.MODEL_TENSOR.FFN_NORM, ".weight"),
    "mlp.gate_proj.weight": (gguf.MODEL_TENSOR.FFN_GATE, ".weight"),
    "mlp.up_proj.weight": (gguf.MODEL_TENSOR.FFN_UP, ".weight"),
    "mlp.down_proj.weight": (gguf.MODEL_TENSOR.FFN_DOWN, ".weight"),
}
_ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2]  # "qwen2"

# gguf's writer refuses an empty array, and llama.cpp refuses a "gpt2" vocabulary without a merges key. This one
# merge never fires: BPE starts from single characters, and only a merge could build the 5-character "<eos>".
_DEAD_MERGE = "<eos> <eos>"


def save_gguf(model, path: str | os.PathLike) -> str:
    """Write ``model`` (a float32 transformers Qwen2ForCausalLM, e.g. ``tiny.tiny_model()``) to ``path`` as an F32
    GGUF of architecture "qwen2" with ``tiny.tiny_tokenizer``'s vocabulary; returns the path. llama.cpp's logits
    for it equal transformers' up to float rounding and llama.cpp's f16 KV cache (at most 3.4e-4 measured with the
    default f16 cache, 5.2e-7 with an f32 one: tests/models/test_tinygguf.py)."""
    config = model.config
    heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    # what the qwen2 graph of llama.cpp cannot express: it derives head size from hidden / heads, ropes every
    # dimension with plain theta, and attends to the full context in every layer
    assert config.model_type == "qwen2", config.model_type
    assert getattr(config, "head_dim", None) in (None, hidden // heads) and hidden % heads == 0
    assert config.rope_parameters.get("rope_type", "default") == "default", config.rope_parameters
    assert not getattr(config, "use_sliding_window", False)
    assert model.lm_head.weight.dtype == torch.float32

    writer = gguf.GGUFWriter(path, _ARCH)
    writer.add_name("tiny")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    _add_tokenizer(writer, config)

    def add(kind: gguf.MODEL_TENSOR, suffix: str, tensor: torch.Tensor, block: int | None = None) -> None:
        name = gguf.TENSOR_NAMES[kind].format(bid=block) + suffix
        writer.add_tensor(name, tensor.detach().to(torch.float32).contiguous().numpy())

    add(gguf.MODEL_TENSOR.TOKEN_EMBD, ".weight", model.model.embed_tokens.weight)  # [V, hidden]
    for block, layer in enumerate(model.model.layers):
        params = dict(layer.named_parameters())
        assert params.keys() == _LAYER_TENSORS.keys(), sorted(params.keys() ^ _LAYER_TENSORS.keys())
        for hf_name, (kind, suffix) in _LAYER_TENSORS.items():
            add(kind, suffix, params[hf_name], block)
    add(gguf.MODEL_TENSOR.OUTPUT_NORM, ".weight", model.model.norm.weight)  # [hidden]
    add(gguf.MODEL_TENSOR.OUTPUT, ".weight", model.lm_head.weight)  # [V, hidden], written even when tied

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _add_tokenizer(writer: gguf.GGUFWriter, config) -> None:
    """``tiny_tokenizer``'s vocabulary as a byte-level BPE ("gpt2") one with Qwen2's pre-tokenizer: the symbols
    are already in byte-level form (\\u0120 is the space), EOS is a control token, no BOS is prepended."""
    tokenizer = tiny_tokenizer(config.vocab_size)
    tokens = tokenizer.convert_ids_to_tokens(list(range(config.vocab_size)))
    assert len(tokens) == config.vocab_size and tokenizer.eos_token_id == config.eos_token_id
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    # only EOS is a control token: the padding id is the space, an ordinary token that must detokenize to " "
    writer.add_token_types(
        [gguf.TokenType.CONTROL if i == config.eos_token_id else gguf.TokenType.NORMAL for i in range(len(tokens))]
    )
    writer.add_token_merges([_DEAD_MERGE])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_add_bos_token(False)


# How a GGUF file gets damaged, as byte edits of a good one. The header: magic (4 bytes), version (u32), tensor count
# (u64 at offset 8), metadata key-value count (u64 at offset 16).
DAMAGES = ("tensor count", "metadata count", "100 bytes", "truncated")


def damage_gguf(good: str | os.PathLike, damaged: str | os.PathLike, how: str) -> str:
    """Write ``damaged``: the GGUF file ``good`` damaged as ``how`` (one of DAMAGES) says; returns its path."""
    data = open(good, "rb").read()
    edits = {
        "tensor count": lambda: data[:8] + (1 << 40).to_bytes(8, "little") + data[16:],
        "metadata count": lambda: data[:16] + (1 << 40).to_bytes(8, "little") + data[24:],
        "100 bytes": lambda: data[:100],
        "truncated": lambda: data[: len(data) // 2],
    }
    with open(damaged, "wb") as file:
        file.write(edits[how]())
    return str(damaged)


def header_reads(monkeypatch) -> list[str]:
    """The names of the GGUF files whose header transformers reads a tokenizer from, appended to as read."""
    from transformers import AutoTokenizer

    reads, load = [], AutoTokenizer.from_pretrained

    def counted(folder, *args, **kwargs):
        if "gguf_file" in kwargs:
            reads.append(kwargs["gguf_file"])
        return load(folder, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counted)
    return reads


def tokenizer_gguf(path: Path, eos: str = "<eos>") -> Path:
    """A GGUF file holding a byte-level BPE tokenizer of six tokens (one merge, "a b", and the end token ``eos``) in
    its metadata, as transformers reads one, and no tensor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["\u0120", "a", "b", "c", "ab", eos])
    writer.add_token_types([gguf.TokenType.NORMAL] * 5 + [gguf.TokenType.CONTROL])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(5)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
