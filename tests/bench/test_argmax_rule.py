"""benchmarks/argmax_rule.py: llama.cpp's rule (argmax draft, sample-and-match) against the token and block rules,
in exact expectations at the same contexts."""

from __future__ import annotations

import pytest
import torch
from kits.tiny import tiny_model

from blockspec import SamplingParams
from blockspec.models.hf import HFModel

PROMPT = [1, 2, 3, 4, 5]
TEXT = [6, 7, 8, 9, 10, 11, 12]
LAW = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def argmax(benchmark_script):
    return benchmark_script("argmax_rule")


def laws(model: HFModel, tokens: list[int]) -> torch.Tensor:
    """The model's laws at temperature 1 after each prefix of ``tokens``, from one plain forward [len, V]."""
    with torch.no_grad():
        return model.model(torch.tensor([tokens])).logits[0].double().softmax(-1)


def test_each_context_is_the_prompt_and_the_text_so_far(argmax):
    target, draft = HFModel(tiny_model(seed=0, sharpness=4.0)), HFModel(tiny_model(seed=1, sharpness=4.0))
    vocab = target.vocab_size
    found = argmax.contexts(target, draft, PROMPT, TEXT, 3, 2, LAW, vocab, seed=0)
    assert [c["t"] for c in found] == [0, 3, 6]
    for c in found:
        context = PROMPT + TEXT[: c["t"]]
        first = int(laws(draft, context)[-1].argmax())  # the draft's argmax after the context
        second = int(laws(draft, context + [first])[-1].argmax())
        p = laws(target, context + [first, second])[-3:]  # the target after the context, then after each
        # llama.cpp's rule accepts x_1 with chance p(x_1), and x_2 after it with chance p(x_2 | x_1)
        expected = [float(p[0, first]), float(p[0, first] * (1 + p[1, second]))]
        assert c["llama.cpp"] == pytest.approx(expected, abs=1e-4)
        assert c["token"][0] == pytest.approx(c["block"][0], abs=1e-6)  # one drafted token: the rules agree
    for model in (target, draft):  # the caches end where the last context left them, the text read up to its end
        assert int(model.lengths[0]) == len(PROMPT) + len(TEXT) - 1


def test_a_draft_equal_to_the_target_is_always_accepted_when_sampled_not_when_argmax(argmax):
    target, draft = HFModel(tiny_model(seed=0)), HFModel(tiny_model(seed=0))
    found = argmax.contexts(target, draft, PROMPT, TEXT, 2, 3, LAW, target.vocab_size, seed=0)
    for c in found:
        assert c["token"] == pytest.approx([1.0, 2.0, 3.0], abs=1e-5)
        assert c["block"] == pytest.approx([1.0, 2.0, 3.0], abs=1e-5)
        assert c["llama.cpp"][2] < 2.5  # a flat tiny model: its argmax is far from sure


def context(llama: float, token: float, block: float) -> dict:
    return {"llama.cpp": [llama], "token": [token], "block": [block]}


PROMPTS = [
    {"dataset": "a", "contexts": [context(1.0, 1.0, 1.2), context(1.0, 1.0, 1.2)]},
    {"dataset": "a", "contexts": [context(2.0, 2.0, 2.2)]},
    {"dataset": "b", "contexts": [context(1.0, 2.0, 2.0)]},
    {"dataset": "b", "contexts": [context(1.0, 2.0, 2.0)]},
]


def test_summary_pools_contexts_and_gives_the_ratio_of_the_means(argmax):
    rows = {r["dataset"]: r for r in argmax.summary(PROMPTS, [1])}
    assert rows["a"]["contexts"] == 3 and rows["a"]["llama.cpp"] == pytest.approx(4 / 3)
    assert rows["a"]["block/llama.cpp"][0] == pytest.approx(4.6 / 4.0)
    assert rows["all"]["block/llama.cpp"][0] == pytest.approx(8.6 / 6.0)
    assert rows["all"]["token/llama.cpp"][0] == pytest.approx(8.0 / 6.0)
    value, lo, hi = rows["all"]["block/llama.cpp"]
    assert lo is not None and lo <= value <= hi


def test_report_prints_both_sections_with_the_machine(argmax, capsys):
    machine = {"temperature": 1.0, "cpu_flags": ["avx2"], "threads": 2}
    argmax.report([p | machine for p in PROMPTS])
    out = capsys.readouterr().out
    assert out.startswith("Machine: CPU flags avx2; 2 threads.")
    by_k = out[out.index("## accepted tokens per step, by K") : out.index("## accepted tokens per step, by dataset")]
    assert "| 1 | all | 1 | 4 | 5 | 1.200 | 1.600 | 1.720 | 1.333x [" in by_k
    assert "| 1 | a | 1 | 2 | 3 | 1.333 | 1.333 | 1.533 | 1.000x [1.000, 1.000] | 1.150x [" in out
