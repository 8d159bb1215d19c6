"""benchmarks/step_costs.py: every forward of real decoding timed with its width, and the summary of those times."""

from __future__ import annotations

import argparse

import pytest
from kits.tiny import tiny_model

from blockspec import PromptLookup, SamplingParams, SpeculativeDecoder
from blockspec.models.hf import HFModel


@pytest.fixture(scope="module")
def costs(benchmark_script):
    return benchmark_script("step_costs")


def test_each_step_logs_its_target_forward_with_the_width_it_verified(costs):
    target = HFModel(tiny_model(), name="tiny")
    log = costs.log_forwards({"target": target})
    prompt = [5, 6, 7, 8] * 6  # it repeats itself: lookup proposes what followed
    decoder = SpeculativeDecoder(target, lookup=PromptLookup(max_draft=3))
    result = decoder.generate([prompt], max_new_tokens=12, seed=0, sampling=SamplingParams(temperature=0.0))
    assert [(name, width) for name, width, _ in log] == [("target", 1 + s.verified[0]) for s in result.stats]
    assert any(width > 1 for _, width, _ in log) and all(seconds > 0 for _, _, seconds in log)


def test_the_summary_counts_draft_forwards_over_more_than_two_tokens_as_catch_ups(costs):
    # a draft reads 1 or 2 tokens as drafting goes on; 3 or more only after steps that left it behind
    forwards = [("draft", 1, 0.01), ("draft", 2, 0.02), ("draft", 3, 0.05), ("draft", 9, 0.12), ("target", 3, 0.3)]
    run = {"config": "default", "temperature": 1.0, "tokens": 8, "steps": 4, "decode_s": 1.0, "forwards": forwards}
    (row,) = costs.summarize([run])
    assert row["catch_up_share"] == pytest.approx(0.17)


def test_the_summary_takes_medians_per_width_and_the_rest_of_the_step_by_difference(costs):
    forwards = [("target", 1, 0.010), ("target", 1, 0.014), ("target", 1, 0.012), ("target", 3, 0.030)]
    runs = [
        {"config": "lookup", "temperature": 0.0, "tokens": 6, "steps": 4, "decode_s": 0.070, "forwards": forwards},
        {"config": "lookup", "temperature": 0.0, "tokens": 2, "steps": 2, "decode_s": 0.030, "forwards": forwards[:2]},
        {"config": "lookup", "temperature": 1.0, "tokens": 1, "steps": 1, "decode_s": 0.020, "forwards": forwards[:1]},
    ]
    greedy, sampled = costs.summarize(runs)
    assert (greedy["config"], greedy["temperature"], sampled["temperature"]) == ("lookup", 0.0, 1.0)
    assert greedy["calls"] == {"target 1": 5, "target 3": 1}
    assert greedy["median_s"] == pytest.approx({"target 1": 0.012, "target 3": 0.030})
    assert greedy["target_ratio"] == pytest.approx({"1": 1.0, "3": 2.5})
    assert greedy["tokens_per_s"] == pytest.approx(8 / 0.100)
    assert greedy["outside_s_per_step"] == pytest.approx((0.100 - 0.090) / 6)
    assert sampled["outside_s_per_step"] == pytest.approx(0.010)


def test_the_probes_spread_is_over_their_ratios_to_one_token(costs):
    probes = [[0.010, 0.020, 0.025], [0.020, 0.030, 0.050], [0.010, 0.018, 0.030]]
    spread = costs.spread((1, 2, 4), probes)
    assert list(spread) == ["2", "4"]
    assert spread["2"] == pytest.approx((1.5, 1.8, 2.0)) and spread["4"] == pytest.approx((2.5, 2.5, 3.0))
    assert costs.spread((1, 2), []) == {}


@pytest.mark.parametrize("text", ["alone", "lookup", "default", "block:4", "token:1"])
def test_configurations_are_named_as_the_help_says(costs, text):
    assert costs.config_name(text) == text


@pytest.mark.parametrize("text", ["block", "block:0", "tree:2", "block:x", "Alone"])
def test_other_configuration_names_are_refused(costs, text):
    with pytest.raises(argparse.ArgumentTypeError, match="alone, lookup, default, token:K or block:K"):
        costs.config_name(text)
