"""Tiny randomly initialised transformers models, built in-process (no hub), for engine tests."""

from __future__ import annotations

import copy
import itertools

import torch

VOCAB = 48
EOS = VOCAB - 1


def tiny_model(
    *,
    family: str = "qwen2",
    layers: int = 2,
    seed: int = 0,
    vocab: int = VOCAB,
    sharpness: float = 1.0,
    context: int = 256,
):
    """A float32 causal LM with a small vocabulary; ``sharpness`` scales the output head (peakier laws), ``context``
    is its ``max_position_embeddings``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        family
    ]
    config = config_class(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        eos_token_id=vocab - 1,
        bos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_class(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    return model


def perturbed(model, *, scale: float, seed: int):
    """A draft that agrees with ``model`` often but not always: its weights plus Gaussian noise."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(scale * param.std() * torch.randn(param.shape, generator=gen).to(param.device))
    return draft


def tiny_tokenizer(vocab: int = VOCAB):
    """A byte-level tokenizer with no merges: id 0 is the space (and padding), then one id per ASCII letter,
    the last id is EOS. It is a Qwen2 tokenizer, the class AutoTokenizer picks for these Qwen2 configs."""
    import string

    from transformers import Qwen2Tokenizer

    symbols = ["\u0120"] + list(string.ascii_letters[: vocab - 2]) + ["<eos>"]  # \u0120 is byte-level's space
    return Qwen2Tokenizer(  # unk_token=None (no unknown token) works, though transformers annotates it str
        vocab={s: i for i, s in enumerate(symbols)},
        merges=[],
        unk_token=None,  # pyright: ignore[reportArgumentType]
        eos_token="<eos>",
        pad_token="\u0120",
    )


def save_tiny(path, *, seed: int = 0, sharpness: float = 5.0, noise: float = 0.0) -> str:
    """A tiny model (optionally a perturbed copy, as a draft) with its tokenizer, saved for ``load_model``."""
    model = tiny_model(seed=seed, sharpness=sharpness)
    if noise:
        model = perturbed(model, scale=noise, seed=seed + 1)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def exact_law_of_first_tokens(
    model, prompt: list[int], length: int, repetition_penalty: float = 1.0, allowed: list[int] | None = None
) -> torch.Tensor:
    """The target's exact joint law of its first ``length`` tokens, [V] * length, from its conditionals; with
    vLLM's repetition penalty, a logit of a token already in the context is divided by the penalty if positive,
    multiplied by it otherwise; with ``allowed``, each conditional restricted to those tokens (a grammar that
    allows them at every position)."""
    vocab = model.config.vocab_size
    law = torch.ones((), dtype=torch.float64)
    with torch.no_grad():
        for i in range(length):
            prefixes = torch.tensor(list(itertools.product(range(vocab), repeat=i)), dtype=torch.long)
            contexts = torch.cat(
                [torch.tensor(prompt).expand(len(prefixes), -1), prefixes.reshape(len(prefixes), i)], 1
            )
            logits = model(contexts.to(model.device)).logits[:, -1].double().cpu()
            seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, contexts, True)
            penalised = torch.where(logits > 0, logits / repetition_penalty, logits * repetition_penalty)
            logits = torch.where(seen, penalised, logits)
            if allowed is not None:
                logits = torch.full_like(logits, -torch.inf).index_copy(1, torch.tensor(allowed), logits[:, allowed])
            law = law.reshape(-1, 1) * logits.softmax(-1)
    return law.reshape([vocab] * length)
