"""save_gguf: llama.cpp, loading the GGUF of a tiny transformers Qwen2, gives transformers' logits at every
position, with the same vocabulary; a GGUF with one wrong weight (q/k permuted the llama way, the converter's
mistake for a NEOX-rope model, or the q bias dropped) fails the same comparison."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from kits.tiny import tiny_model, tiny_tokenizer
from kits.tinygguf import save_gguf

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.usefixtures("one_thread")

# Tolerances, per KV cache type, from the maximum |llama.cpp - transformers| measured over 40 positions of the
# tiny models (vocab 6 and 48, sharpness 3 and 5, plain, perturbed and with random biases and norms; logits up to
# 2.4 in absolute value), on a CPU build of llama.cpp (0.3.36). With llama.cpp's default f16 cache, attention's
# operands (q, the cached k and v, the scores) are rounded to f16: at most 3.4e-4, so 1e-3. With an f32 cache
# only summation order differs: at most 5.2e-7, so 1e-5. The negative controls miss by 1.3e-2 and 2.6e-2 on the
# model they use (13x the f16 tolerance or more), so the f32 comparison is the sharp one and the f16 one checks
# what the adapter meets by default.
ATOL = {"f16": 1e-3, "f32": 1e-5}
CACHE_TYPE = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}


def with_random_biases_and_norms(model, seed: int):
    """``model`` with random q/k/v biases and RMSNorm weights: at initialisation they are all 0 and all 1, so a
    dropped bias or a swapped attn/ffn norm would go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            elif "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=gen))
    return model


def with_llama_permuted_qk(model):
    """A copy with q/k rows (weights and biases) permuted as convert_hf_to_gguf.py does for llama, whose NORM rope
    rotates adjacent pairs; qwen2's NEOX rope rotates halves, as transformers does, so this copy is wrong."""
    model = copy.deepcopy(model)

    def permute(rows: torch.Tensor, heads: int) -> torch.Tensor:  # [heads * head_dim, ...]
        return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            for proj, heads in (
                (attention.q_proj, model.config.num_attention_heads),
                (attention.k_proj, model.config.num_key_value_heads),
            ):
                proj.weight.copy_(permute(proj.weight, heads))
                proj.bias.copy_(permute(proj.bias, heads))
    return model


def without_q_bias(model):
    """A copy with every q_proj bias zeroed: llama.cpp loads it (the biases are optional), and it is wrong."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.bias.zero_()
    return model


def llama_cpp_logits(path: str, row: list[int], cache: str) -> torch.Tensor:
    """[len(row), V] float32: llama.cpp's logits at every position of ``row``, from a fresh context whose KV
    cache holds ``cache`` ("f16" or "f32") values."""
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=64,
        logits_all=True,
        verbose=False,
        n_threads=1,
        type_k=CACHE_TYPE[cache],
        type_v=CACHE_TYPE[cache],
    )
    try:
        llm.eval(row)
        return torch.from_numpy(np.array(llm.scores[: len(row)], dtype=np.float32))
    finally:
        llm.close()


def transformers_logits(model, row: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([row])).logits[0]  # [len(row), V]


def a_model(vocab: int, sharpness: float):
    return with_random_biases_and_norms(tiny_model(vocab=vocab, sharpness=sharpness), seed=2)


def a_row(vocab: int) -> list[int]:
    return torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.mark.parametrize("cache", ["f16", "f32"])
@pytest.mark.parametrize("vocab, sharpness", [(6, 5.0), (48, 3.0)])
def test_llama_cpp_gives_transformers_logits(tmp_path, vocab, sharpness, cache):
    model, row = a_model(vocab, sharpness), a_row(vocab)
    path = save_gguf(model, tmp_path / "tiny.gguf")
    expected = transformers_logits(model, row)
    torch.testing.assert_close(llama_cpp_logits(path, row, cache), expected, atol=ATOL[cache], rtol=0)


@pytest.mark.parametrize("cache", ["f16", "f32"])
@pytest.mark.parametrize("wrong", [with_llama_permuted_qk, without_q_bias])
def test_a_wrong_weight_fails_the_comparison(tmp_path, wrong, cache):
    """Negative control: the comparison above sees a rope layout error and a missing bias."""
    model, row = a_model(48, 3.0), a_row(48)
    path = save_gguf(wrong(model), tmp_path / "wrong.gguf")
    # with rtol=0, assert_close fails exactly when the largest absolute difference exceeds atol
    difference = (llama_cpp_logits(path, row, cache) - transformers_logits(model, row)).abs().max().item()
    assert difference > ATOL[cache], difference


def test_the_vocabulary_is_the_tiny_tokenizers(tmp_path):
    vocab, text = 48, "ab Cd e"
    ids = tiny_tokenizer(vocab).encode(text)
    path = save_gguf(tiny_model(vocab=vocab), tmp_path / "tiny.gguf")
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, verbose=False, n_threads=1)
    try:
        assert llm.n_vocab() == vocab and llm.token_eos() == vocab - 1
        assert llm.tokenize(text.encode(), add_bos=False) == ids
        assert llm.detokenize(ids) == text.encode()
    finally:
        llm.close()
