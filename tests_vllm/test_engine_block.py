"""End to end: vLLM's offline engine with blockspec's plugin (BLOCKSPEC_VLLM_RULE=block), on a tiny target and
draft built in-process. The first three tokens' joint law is the target's (chi-square against the exact law from
the same float32 weights, cells expected fewer than 5 times pooled), with and without a repetition penalty and
with a seed per request, with drafts cut by the draft's confidence and with SV choosing what is drafted and
verified; a seeded request's tokens depend on its seed alone, not on other requests or its prompt's prefill
chunks; greedy decoding is the target's own; logprobs are the target's; the worker reports the block rule in
place; structured outputs with sampled drafts, which vLLM cannot verify exactly, are refused, and with the
refusal lifted the grammar's cut breaks the law that the target alone (a second engine) follows.
test_engine_stock.py runs the same law test on vLLM CPU as shipped, which must fail it.
"""

from __future__ import annotations

import pytest
import tinyvllm
import torch
from tinyvllm import LENGTH, SAMPLES

from blockspec.vllm.fixes import refuse_cut_grammar_drafts
from blockspec.vllm.status import check


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    engine = tinyvllm.start(tmp_path_factory.mktemp("models"), "block")
    yield engine
    del engine


@pytest.fixture(scope="module")
def target(llm):
    return llm.llm_engine.model_config.model


@pytest.fixture(scope="module")
def target_alone(tmp_path_factory):
    """vLLM's engine on the tiny target alone, without speculative decoding."""
    engine = tinyvllm.start(tmp_path_factory.mktemp("models"), None, num_speculative_tokens=0)
    yield engine
    del engine


def test_every_worker_runs_the_block_rule(llm):
    statuses = check(llm, "block")
    assert statuses and all(s["expand"] in ("fixed", "triton") and s["runner"] == "v1" for s in statuses)
    with pytest.raises(RuntimeError, match="asked for the token rule"):
        check(llm, "token")


def test_first_tokens_follow_the_target_at_temperature_1(llm, target):
    before = check(llm, "block")[0]["steps"]["block"]
    sequences = tinyvllm.first_tokens(llm, SAMPLES, LENGTH, temperature=1.0)
    result = tinyvllm.law_test(sequences, tinyvllm.exact_law(target, LENGTH))
    assert result.passed, result
    steps = check(llm, "block", verified=True)[0]["steps"]
    assert steps["block"] - before > steps["token"], steps  # the block rule verified (nearly) every step


@pytest.mark.parametrize("drafts", ["request seeds", "replayed"])
def test_seeded_first_tokens_follow_the_target(llm, target, drafts):
    """Each request with its own seed: drafts, uniforms and recovery draws all come from the request's generator,
    one after the other. Drafts that replay the draws the verifier makes next (broken) must fail."""
    llm.collective_rpc(tinyvllm.draft_sampler, args=(drafts,))
    try:
        sequences = tinyvllm.first_tokens(llm, SAMPLES, LENGTH, seeds=list(range(SAMPLES)), temperature=1.0)
    finally:
        llm.collective_rpc(tinyvllm.draft_sampler, args=("request seeds",))
    assert tinyvllm.law_test(sequences, tinyvllm.exact_law(target, LENGTH)).passed == (drafts == "request seeds")


def test_a_seeded_request_s_tokens_depend_on_its_seed_alone(llm):
    """The same seeded request gives the same tokens after unseeded requests moved the engine's global generator.
    With vLLM's own draft sampler put back in the worker (drafts from the global generator) it does not."""

    def seeded_after_traffic(rounds: int) -> list[list[int]]:
        outputs = []
        for _ in range(rounds):
            tinyvllm.first_tokens(llm, 8, 4, temperature=1.0)  # unseeded: draws from the global generator
            outputs.append(tinyvllm.first_tokens(llm, 1, 24, seeds=[11], temperature=1.0)[0])
        return outputs

    first = tinyvllm.first_tokens(llm, 1, 24, seeds=[11], temperature=1.0)[0]
    assert seeded_after_traffic(3) == [first] * 3
    llm.collective_rpc(tinyvllm.draft_sampler, args=("global",))
    try:
        with pytest.raises(RuntimeError, match="asked for the block rule"):
            check(llm, "block")  # the presence check sees the unseeded drafter
        assert seeded_after_traffic(3) != [first] * 3
    finally:
        llm.collective_rpc(tinyvllm.draft_sampler, args=("request seeds",))
    check(llm, "block")


@pytest.mark.parametrize("chunk_draws", ["apart", "consumed"])
def test_a_seeded_request_s_tokens_do_not_depend_on_prefill_chunks(llm, chunk_draws):
    """300 prompts of 48 tokens at once exceed the offline engine's 4096-token budget per step on CPU, so some are
    prefilled in chunks, and vLLM discards the token sampled after a chunk. The plugin draws that sample apart
    from the request's generator: each seeded request gives the tokens it gives alone, unchunked. Letting its
    generator take those draws (broken) must change a chunked request's tokens (at temperature 2, so that its
    tokens are not nearly certain). vLLM CPU as shipped dies here (test_engine_stock.py). Fresh prompts each
    time: a cached prefix would not be prefilled again."""
    prompts = tinyvllm.long_prompts(300, 48, seed=len(chunk_draws))
    seeds = list(range(500, 800))
    before = check(llm, "block")[0]["chunks"]["drawn apart"]
    llm.collective_rpc(tinyvllm.chunk_sampler, args=(chunk_draws,))
    try:
        together = tinyvllm.continuations(llm, prompts, 8, seeds, temperature=2.0)
    finally:
        llm.collective_rpc(tinyvllm.chunk_sampler, args=("apart",))
    if chunk_draws == "apart":  # some prompt was chunked (without a chunk, "consumed" could not fail)
        assert check(llm, "block")[0]["chunks"]["drawn apart"] > before
    alone = [
        tinyvllm.continuations(llm, [prompt], 8, [seed], temperature=2.0)[0] for prompt, seed in zip(prompts, seeds)
    ]
    differ = sum(a != b for a, b in zip(together, alone))
    assert (differ == 0) == (chunk_draws == "apart")


@pytest.mark.parametrize("cut", ["top probability", "drafted token's probability"])
def test_first_tokens_follow_the_target_with_unsure_drafts_cut(llm, target, cut):
    """Drafts verified only while the draft's top probability is at least 0.3 (BLOCKSPEC_VLLM_MIN_DRAFT_PROB; on
    this pair that cuts about 5 % of them): a stopping rule, so the law stays the target's. A cut by the drafted
    token's own probability (broken: it looks at x_i) must fail."""
    llm.collective_rpc(tinyvllm.draft_cut, args=(0.3, cut))
    try:
        before = check(llm, "block")[0]["cut"]
        sequences = tinyvllm.first_tokens(llm, SAMPLES, LENGTH, temperature=1.0)
        after = check(llm, "block")[0]["cut"]
    finally:
        llm.collective_rpc(tinyvllm.draft_cut, args=(None, "top probability"))
    if cut == "top probability":  # some drafts were cut, some verified
        drafted, verified = (after[key] - before[key] for key in ("drafted", "verified"))
        assert 0 < verified < drafted, after
    assert tinyvllm.law_test(sequences, tinyvllm.exact_law(target, LENGTH)).passed == (cut == "top probability")


@pytest.mark.parametrize("sv", ["stopping rule", "never drafting", "x_i's own probability"])
def test_first_tokens_follow_the_target_with_sv_choosing_the_drafts(llm, target, sv, tmp_path):
    """SV (BLOCKSPEC_VLLM_SV) with hand-made profiles: a gain of about 1 where the draft's top probability is above
    0.3 and about 0 below, each verified token costing a fifth of a step; it verifies some drafts and not others,
    learns its offset from them (on this pair the gains are lower: the offset falls), and the law stays the
    target's. With each draft forward priced at 10 steps and gains of 0.1 expected, no step drafts (vLLM runs the
    draft only for its cache), nothing is learnt and the law is the target's. SV reading the drafted token's own
    probability in place of the top probability (broken: it looks at x_i) must fail."""
    never = sv == "never drafting"
    paths = tinyvllm.sv_profiles(tmp_path, drafting=10.0 if never else 0.0, prior=0.1 if never else 0.9, llm=llm)
    llm.collective_rpc(tinyvllm.sv, args=(paths, sv == "x_i's own probability"))
    try:
        before = check(llm, "block")[0]["cut"]
        sequences = tinyvllm.first_tokens(llm, SAMPLES, LENGTH, temperature=1.0)
        after = check(llm, "block")[0]["cut"]
    finally:
        llm.collective_rpc(tinyvllm.sv, args=(None,))
    skipped, drafted, verified = (after[key] - before[key] for key in ("skipped", "drafted", "verified"))
    if sv == "stopping rule":
        assert 0 < verified < drafted and after["offset"] != 0.0, after
    if sv == "never drafting":
        assert skipped > 0 and drafted == 0 and after["offset"] == 0.0, after
    assert tinyvllm.law_test(sequences, tinyvllm.exact_law(target, LENGTH)).passed == (sv != "x_i's own probability")


def test_first_tokens_follow_the_penalised_target(llm, target):
    """The repetition penalty is applied by vLLM to the target before verification, never again by the rule."""
    sequences = tinyvllm.first_tokens(llm, SAMPLES, LENGTH, temperature=1.0, repetition_penalty=1.6)
    penalised = tinyvllm.exact_law(target, LENGTH, repetition_penalty=1.6)
    assert tinyvllm.law_test(sequences, penalised).passed
    assert not tinyvllm.law_test(sequences, tinyvllm.exact_law(target, LENGTH)).passed  # the penalty matters


def test_greedy_is_the_target_s_own(llm, target):
    assert tinyvllm.first_tokens(llm, 1, 12, temperature=0.0)[0] == tinyvllm.greedy_continuation(target, 12)


def test_logprobs_are_the_target_s(llm, target):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=tinyvllm.PROMPT)] * 20,
        SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, logprobs=5),
        use_tqdm=False,
    )
    model = tinyvllm.load(target)
    for output in outputs:
        tokens = list(output.outputs[0].token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([tinyvllm.PROMPT + tokens])).logits[0, len(tinyvllm.PROMPT) - 1 : -1]
        expected = logits.double().log_softmax(-1)
        for position, (token, top) in enumerate(zip(tokens, output.outputs[0].logprobs)):
            assert abs(top[token].logprob - float(expected[position, token])) < 1e-3
            assert len(top) >= 5


def test_structured_outputs_with_sampled_drafts_are_refused(llm):
    """vLLM cuts a sampled draft at the first token the grammar refuses, which is not the target's law: the plugin
    refuses such requests and lets greedy ones through (for those the cut is exact)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    prompt = [TokensPrompt(prompt_token_ids=tinyvllm.PROMPT)]
    choice = StructuredOutputsParams(choice=["w3", "w5"])  # token ids 5 and 7
    with pytest.raises(VLLMValidationError, match="structured outputs at temperature > 0"):
        llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=2, structured_outputs=choice), use_tqdm=False)
    greedy = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=choice), use_tqdm=False
    )
    assert greedy[0].outputs[0].token_ids[0] in (5, 7)


GRAMMAR_WORDS = [4, 10, 15]  # w2, w8, w13: the target's likely tokens and the draft's, which also drafts <eos>


def grammar_samples(llm, monkeypatch):
    """The first tokens of sampled requests held to GRAMMAR_WORDS, the plugin's refusal lifted. vLLM CPU lets an
    occasional such request emit a token outside the grammar (1 or 2 in 6000 when tried, some of them then ended
    with finish reason "error", with or without speculative decoding): those are left out, at most 1 %."""
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.engine.input_processor import InputProcessor

    words = "|".join(tinyvllm.WORDS[i] for i in GRAMMAR_WORDS)
    stock = getattr(refuse_cut_grammar_drafts, "stock", InputProcessor._validate_params)
    monkeypatch.setattr(InputProcessor, "_validate_params", stock)
    grammar = StructuredOutputsParams(regex=f"({words}){{{LENGTH}}}")
    sequences = tinyvllm.first_tokens(llm, SAMPLES, LENGTH, temperature=1.0, structured_outputs=grammar)
    complete = [
        sequence
        for sequence in sequences
        if len(sequence) == LENGTH and all(token in GRAMMAR_WORDS for token in sequence)
    ]
    assert len(complete) >= 0.99 * len(sequences)
    return complete


def test_grammar_held_first_tokens_of_the_target_alone_follow_its_restricted_law(target_alone, monkeypatch):
    """The control of the next test: without speculative decoding, vLLM's structured outputs give the target's
    law restricted to the grammar's words at every position."""
    law = tinyvllm.exact_law(target_alone.llm_engine.model_config.model, LENGTH, allowed=GRAMMAR_WORDS)
    test = tinyvllm.law_test(grammar_samples(target_alone, monkeypatch), law)
    print(f"grammar, target alone: {test}")
    assert test.passed


@pytest.mark.parametrize("rule", ["token", "block"])
def test_vllm_s_grammar_cut_of_sampled_drafts_breaks_the_target_s_law(llm, target, monkeypatch, rule):
    """Why the plugin refuses structured outputs with sampled drafts, shown with the refusal lifted: vLLM's
    scheduler cuts a draft at the first token the grammar refuses and verifies the rest as if nothing had been
    drafted there. Held to three words the draft often leaves (it drafts <eos> a third of the time first), the
    first tokens do not follow the target's restricted law, with vLLM's token rule (its expand kernel fixed) or
    with the block rule."""
    llm.collective_rpc(tinyvllm.verification_rule, args=(rule,))
    try:
        sequences = grammar_samples(llm, monkeypatch)
    finally:
        llm.collective_rpc(tinyvllm.verification_rule, args=("block",))
    test = tinyvllm.law_test(sequences, tinyvllm.exact_law(target, LENGTH, allowed=GRAMMAR_WORDS))
    print(f"grammar cut, {rule} rule: {test}")
    assert not test.passed


def test_the_latency_profile_times_every_verification_width(llm, tmp_path):
    """python -m blockspec.vllm.profile's measurement on this engine (K = 2): for each batch size and each width
    w = 0..K it finds steps where every request verified w drafts (it raises otherwise), and what it writes is a
    latency profile SV loads. Last in the module: it leaves its timing wrappers in the worker."""
    from blockspec.policy.latency import LatencyProfile
    from blockspec.vllm import profile

    measured = profile.profile(
        llm, "target", "draft", "float32", [1, 2], max_draft=2, context=8, repeats=4, log=lambda line: None
    )
    measured.save(tmp_path / "latency.json")
    loaded = LatencyProfile.load(tmp_path / "latency.json")
    assert (loaded.target.batch_sizes, loaded.target.tokens) == ((1, 2), (1, 2, 3))
    assert (loaded.draft.batch_sizes, loaded.draft.tokens) == ((1, 2), (1, 2, 3))  # the first forward per width
    assert all(seconds > 0 for row in loaded.target.seconds + loaded.draft.seconds for seconds in row)
    assert (loaded.meta["target"], loaded.meta["context"], loaded.meta["repeats"]) == ("target", 8, 4)
