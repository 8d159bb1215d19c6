"""The bundled Qwen2.5-Coder pair end to end (slow: loads 2 GB of weights; CI installs and runs it).

Greedy speculative output must equal greedy target-only output token for token. The check runs in float32:
in bf16 a (K+1)-token verification forward and a 1-token forward differ in the last bits, which can flip an
argmax between near-tied tokens without anything being wrong (docs/algorithms.md). The models load from the bf16
copies in the model cache (the ones `blockspec bench` uses) and are cast to float32 in memory: float32 arithmetic
on the same weights for both paths, without writing 8 GB of float32 copies into the user's cache.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def qwen_pair():
    from blockspec.models import presets
    from blockspec.models.hf import HFModel
    from blockspec.models.load import load_model

    missing = [name for name in (TARGET, DRAFT) if not presets.is_installed(name)]
    if missing:
        pytest.skip(f"presets {missing} not installed: run {presets.INSTALL_HINT}")

    def in_float32(name: str) -> HFModel:
        model = load_model(name, dtype="bfloat16")
        return HFModel(model.model.float(), model.tokenizer, name=name)

    return in_float32(TARGET), in_float32(DRAFT)


def test_the_pair_shares_a_tokenizer_and_stops_on_both_eos_ids(qwen_pair):
    from blockspec import SpeculativeDecoder

    target, draft = qwen_pair
    decoder = SpeculativeDecoder(target, draft)  # refuses differing tokenizers
    assert decoder.vocab == len(target.tokenizer) <= target.vocab_size == draft.vocab_size
    im_end, endoftext = target.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert {im_end, endoftext} <= set(target.eos_token_ids)


def test_greedy_speculative_output_equals_greedy_target_output(qwen_pair):
    from blockspec import SamplingParams, SpeculativeDecoder
    from blockspec.models.chat import encode_prompt
    from blockspec.verify import SAMPLED_RULES

    target, draft = qwen_pair
    prompts = [
        encode_prompt(target.tokenizer, text)
        for text in ("Write a Python function that returns the n-th Fibonacci number.", "What is a hash map?")
    ]
    greedy = SamplingParams(temperature=0.0)
    plain = SpeculativeDecoder(target).generate(prompts, max_new_tokens=24, sampling=greedy)
    for rule in SAMPLED_RULES:
        fast = SpeculativeDecoder(target, draft, rule=rule, max_draft=4)
        result = fast.generate(prompts, max_new_tokens=24, sampling=greedy)
        assert result.sequences == plain.sequences, rule
        assert result.block_efficiency > 1.5  # the draft really was accepted most of the time
