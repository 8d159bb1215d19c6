"""End to end: vLLM's own batch-size schedule of K (``num_speculative_tokens_per_batch_size``) with blockspec's
block rule, on the tiny pair. Requests arrive a few at a time while others are decoded, so the number of requests in
a step, and with it the K the scheduler asks the drafter for (2, 1 or 0), changes while requests are in flight; the
first three tokens' joint law stays the target's (chi-square against the exact law). A cut that reads the drafted
token's own probability (broken) must fail the same test in the same traffic.
"""

from __future__ import annotations

import pytest
import tinyvllm

from blockspec.vllm.status import check

SAMPLES, LENGTH = 6000, 3
SCHEDULE = [(1, 3, 2), (4, 5, 1), (6, 16, 0)]  # (first batch size, last batch size, K)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    engine = tinyvllm.start(tmp_path_factory.mktemp("models"), "block", schedule=SCHEDULE, max_num_seqs=16)
    yield engine
    del engine


@pytest.mark.parametrize("cut", ["none", "drafted token's probability"])
def test_first_tokens_follow_the_target_while_k_follows_the_batch_size(llm, cut):
    check(llm, "block")
    llm.collective_rpc(tinyvllm.count_scheduled_k, args=(True,))
    if cut != "none":
        llm.collective_rpc(tinyvllm.draft_cut, args=(0.3, cut))
    try:
        sequences = tinyvllm.arriving_first_tokens(llm, SAMPLES, LENGTH, arrivals=3, seed=0, temperature=1.0)
    finally:
        llm.collective_rpc(tinyvllm.draft_cut, args=(None, "top probability"))
        steps = llm.collective_rpc(tinyvllm.count_scheduled_k, args=(False,))[0]
    assert all(steps.get(k, 0) >= 500 for k in (0, 1, 2)), steps  # every K of the schedule, many times
    test = tinyvllm.law_test(sequences, tinyvllm.exact_law(llm.llm_engine.model_config.model, LENGTH))
    print(f"schedule {SCHEDULE}, steps by K {steps}, cut {cut}: {test}")
    assert test.passed == (cut == "none")
