"""Machine-aware defaults: the int8 draft, the arithmetic probe and its choices, and AdaptiveLength, the
cost-driven draft length; each drafter and policy keeps the target's exact law."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
from dataclasses import replace

import pytest
import torch
from kits import lawkit
from kits.enginekit import off_by_one, reference_greedy
from kits.svkit import AVX2_LLAMACPP, CHEAP_VERIFICATION, LINEAR_VERIFICATION, profile
from kits.tiny import exact_law_of_first_tokens, perturbed, save_tiny, tiny_model

from blockspec import SamplingParams, SpeculativeDecoder, auto, cli, machine
from blockspec.defaults import ADAPTIVE_MAX_DRAFT
from blockspec.models.hf import HFModel
from blockspec.models.load import load_model
from blockspec.models.quant import quantize
from blockspec.policy import AdaptiveLength, FixedLength, LatencyTable, latency
from blockspec.verify import RULES, SAMPLED_RULES

GREEDY = SamplingParams(temperature=0.0)


def test_int8_draft_quantizes_every_linear_layer_and_stays_close_to_the_float_model():
    model = tiny_model(sharpness=5.0)
    reference = HFModel(perturbed(model, scale=0.0, seed=0))
    quantized = HFModel(quantize(perturbed(model, scale=0.0, seed=0), "int8"))
    linear = [m for m in quantized.model.modules() if type(m).__name__ == "Linear"]
    assert len(linear) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the head: all int8
    assert all(type(m).__module__.startswith("torch.ao.nn.quantized") for m in linear)
    assert quantized.vocab_size == reference.vocab_size == model.config.vocab_size
    prompt = [[1, 2, 3, 4, 5]]
    for m in (reference, quantized):
        m.prefill(prompt)
    step = torch.tensor([[6, 7]])
    valid = torch.ones_like(step, dtype=torch.bool)
    a, b = reference.forward(step, valid).softmax(-1), quantized.forward(step, valid).softmax(-1)
    distance = 0.5 * (a - b).abs().sum(-1).max()  # total variation: quantization moves the law, a little
    assert 0 < distance < 0.1, distance


def test_quantization_is_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="quant must be one of"):
        quantize(tiny_model(), "int4")
    path = save_tiny(tmp_path / "m")
    with pytest.raises(ValueError, match="quant must be one of"):
        load_model(path, dtype="float32", quant="int3")
    loaded = load_model(path, dtype="bfloat16", quant="int8")
    assert loaded.dtype == torch.float32 and loaded.name.endswith("(int8)")


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
@pytest.mark.parametrize("rule", SAMPLED_RULES)
def test_law_of_the_first_tokens_is_the_targets_with_an_int8_draft(rule, monkeypatch):
    """The quantized draft proposes from its own distribution, which verification sees: the target's law stays
    exact (chi-square over 6**3 outcomes); the misaligned engine must fail the same test."""
    vocab, length, samples = 6, 3, 6000
    target = tiny_model(vocab=vocab, sharpness=5.0)
    draft = quantize(perturbed(target, scale=0.6, seed=1), "int8")
    law = exact_law_of_first_tokens(target, [1, 2, 3], length)
    decoder = SpeculativeDecoder(target, draft, rule=rule, max_draft=2)
    test = lawkit.chi_square(lawkit.first_tokens_counts(decoder, [1, 2, 3], vocab, length, samples), law)
    assert test.passed, test
    monkeypatch.setitem(RULES, rule, replace(RULES[rule], verify=off_by_one(RULES[rule].verify)))
    broken = lawkit.chi_square(lawkit.first_tokens_counts(decoder, [1, 2, 3], vocab, length, samples), law)
    assert not broken.passed, broken


def test_greedy_output_with_an_int8_draft_equals_plain_greedy_decoding():
    target = tiny_model(sharpness=5.0)
    draft = quantize(perturbed(target, scale=0.3, seed=1), "int8")
    decoder = SpeculativeDecoder(target, draft, rule="block", max_draft=3)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
    result = decoder.generate(prompts, max_new_tokens=16, sampling=GREEDY)
    assert result.sequences == [reference_greedy(target, p, 16) for p in prompts]
    assert result.acceptance_rate > 0.3  # the int8 draft still agrees with the target


@pytest.mark.parametrize("costs, expected", [(CHEAP_VERIFICATION, 8), (LINEAR_VERIFICATION, 0)])
def test_adaptive_length_drafts_long_where_verification_is_cheap_and_not_at_all_where_it_is_not(costs, expected):
    policy = AdaptiveLength(profile(costs, draft_ms=2), max_draft=8, prior=0.8)
    assert policy.best_length(1) == expected == policy.draft_budget(1, 1)


def test_adaptive_length_prices_its_step_for_prompt_lookup():
    """``expected_rate`` is the goodput of the step ``draft_budget`` would take, by hand: 1 + a + .. + a^K tokens
    over K draft forwards and the target over K + 1 tokens, in tokens per plain target step's time; the draft's
    first forward reads 2 tokens after a step that accepted all K (chance a^K), else 1, and what reading more costs
    beyond 2 tokens is spread over ``horizon`` steps."""
    costs = [100, 130, 160, 190, 220, 250, 280, 310, 340]
    draft = LatencyTable((1,), (1, 2, 4), ((0.020, 0.030, 0.040),))
    costed = latency.LatencyProfile(profile(costs, 20).target, draft, None, meta={})
    policy = AdaptiveLength(costed, max_draft=8, prior=0.8, horizon=10)

    def seconds(k: int, behind: float = 0.0) -> float:  # the draft's k forwards, the first reading 2 with chance 0.8^k
        return 0.8**k * (30 + 20 * (k - 1)) + (1 - 0.8**k) * 20 * k + behind if k else 0.0

    def rates(behind: float = 0.0) -> list[float]:
        return [sum(0.8**i for i in range(k + 1)) / ((seconds(k, behind) + costs[k]) / 1e3) for k in range(9)]

    by_hand = rates()
    assert policy.goodputs(1) == pytest.approx(by_hand) == policy.goodputs(1, catch_up=2)
    assert policy.expected_rate(1, catch_up=1) == pytest.approx(max(by_hand) * costs[0] / 1e3)  # per plain step
    assert policy.best_length(1) == by_hand.index(max(by_hand)) == policy.draft_budget(1, catch_up=1)
    assert policy.draft_budget(1, catch_up=2) == policy.best_length(1)
    behind = rates((45 - 30) / 10)  # 5 tokens to read: 45 ms (the table extended past 4 tokens), 30 for 2
    assert policy.goodputs(1, catch_up=5) == pytest.approx(behind)
    assert policy.expected_rate(1, catch_up=5) == pytest.approx(max(behind) * costs[0] / 1e3)
    assert policy.draft_budget(1, catch_up=5) == behind.index(max(behind))
    assert policy.acceptance == 0.8  # asking changes nothing
    assert FixedLength(3).expected_rate(1, 1) is None  # a policy that knows no costs


def observe(policy, agree: bool, width: int) -> None:
    """One step in which the draft, certain of token 0, drafted ``width`` tokens; the target puts all its mass
    on token 0 (``agree``) or on token 1."""
    tokens = torch.zeros(1, width, dtype=torch.long)
    draft = torch.nn.functional.one_hot(tokens, 4).float()  # [1, K, V]
    target = torch.nn.functional.one_hot(torch.full((1, width + 1), 0 if agree else 1), 4).float()
    policy.observe([0], tokens, draft, target, torch.tensor([width]), torch.tensor([width if agree else 0]))


def test_adaptive_length_follows_the_acceptance_it_observes():
    """Between the two extremes the best K depends on the acceptance: drafts never accepted bring it to 0,
    drafts always accepted grow it; the acceptance learnt is the exact one of the positions verified, each position
    keeping the weight ``memory``."""
    costs = [100, 130, 160, 190, 220, 250, 280, 310, 340]
    shrinking = AdaptiveLength(profile(costs, draft_ms=20), max_draft=8, prior=0.8, memory=0.5)
    start = shrinking.best_length(1)
    assert 0 < start < 8
    for _ in range(8):
        observe(shrinking, agree=False, width=start)
    assert shrinking.best_length(1) == 0 and shrinking.acceptance == pytest.approx(0.8 / 2 ** (8 * start))
    growing = AdaptiveLength(profile(costs, draft_ms=20), max_draft=8, prior=0.8, memory=0.5)
    widths = []
    for _ in range(8):
        widths.append(growing.best_length(1))
        observe(growing, agree=True, width=widths[-1])
    assert growing.best_length(1) > start and growing.acceptance == pytest.approx(1 - 0.2 / 2 ** sum(widths))
    unchanged = AdaptiveLength(profile(costs, draft_ms=20), max_draft=8, prior=0.8, memory=0.5)
    observe(unchanged, agree=False, width=0)  # a step that verified nothing teaches nothing
    assert unchanged.acceptance == 0.8


def test_adaptive_length_drafts_again_after_a_bad_patch():
    """Steps that draft nothing teach nothing, so the acceptance drifts back towards the prior on them (by 1 - memory
    a step): after drafts that were never accepted, the policy decodes alone for a few steps, then drafts again, and
    learns from what that step verifies. Without the drift it would decode alone for the rest of the call."""
    costs = [100, 130, 160, 190, 220, 250, 280, 310, 340]
    # the draft's forward costs 20 ms over 1 token, 30 over 2, 100 over 4 and 35 ms more for each further token
    growing = latency.LatencyProfile(
        profile(costs, draft_ms=20).target, LatencyTable((1,), (1, 2, 4), ((0.020, 0.030, 0.100),)), None, meta={}
    )
    policy = AdaptiveLength(growing, max_draft=8, prior=0.8, memory=0.5)
    for _ in range(8):
        observe(policy, agree=False, width=policy.best_length(1))
    low = policy.acceptance  # 0.8 / 2**8
    idle = 0
    # each idle step leaves the draft one more token to catch up on, as the proposer counts them: a cost paid back
    # over the steps that draft again, which a draft that pays this well gains back
    while policy.draft_budget(1, catch_up=1 + idle) == 0:
        idle += 1
        assert idle < 10, policy.acceptance
    # the first K > 0 comes once 0.8 - (0.8 - low) / 2**idle reaches the break-even acceptance, which lies in
    # (0, 0.8): after 1 to 9 idle steps
    assert 1 <= idle and policy.acceptance == pytest.approx(0.8 - (0.8 - low) / 2**idle)
    hopeless = AdaptiveLength(profile(LINEAR_VERIFICATION, draft_ms=2), max_draft=8, prior=0.8)
    assert [hopeless.draft_budget(1, 1) for _ in range(20)] == [0] * 20  # the drift never passes the prior


def test_one_rejected_step_does_not_end_drafting_where_a_step_reading_two_tokens_does_not_pay_at_the_prior():
    """Costs measured on llama.cpp's kernels for the bundled pair (the q4_0 draft, 2 threads, a loaded machine): at
    the prior, drafting K = 3 step after step pays (3 % over the target alone), a step whose draft first reads 2
    tokens alone does not. Priced by its own catch-up, the policy drafted once, saw those drafts rejected, decoded
    alone, and after a step without drafts (2 tokens to read) never drafted again in the call, since the drift back
    to the prior never passes it. Priced as drafting goes on, it drafts again once the drift brings the acceptance
    back above break-even, and keeps drafting while its drafts are accepted."""
    seconds = (0.0963, 0.1539, 0.2071, 0.1659, 0.2203, 0.2749, 0.3297, 0.3251, 0.3659)
    target = LatencyTable((1,), tuple(range(1, 10)), (seconds,))
    draft = LatencyTable((1,), (1, 2, 4), ((0.0329, 0.0538, 0.0479),))
    policy = AdaptiveLength(latency.LatencyProfile(target, draft, None, meta={}), max_draft=8, prior=0.8, memory=0.9)
    assert policy.draft_budget(1, catch_up=1) == 3
    observe(policy, agree=False, width=3)  # the first drafts rejected: the acceptance falls to 0.8 * 0.9^3
    idle = 0
    while policy.draft_budget(1, catch_up=2 + idle) == 0:
        idle += 1
        assert idle < 30, policy.acceptance
    assert idle > 0
    lengths = []
    for _ in range(6):  # every step accepted whole: the draft reads 2 tokens first each time
        lengths.append(policy.draft_budget(1, catch_up=2))
        observe(policy, agree=True, width=lengths[-1])
    assert all(k > 0 for k in lengths) and lengths[-1] >= 3


def test_the_adaptive_length_drafts_where_drafting_step_after_step_pays_and_only_there():
    """llama.cpp's AVX2 kernels on the bundled pair (the q4_0 draft's latency probe on an AMX machine with llama.cpp
    built for AVX2 only): at an acceptance of 0.8 a step drafting 3 pays after a rejection (its draft reads 1 token
    first) and not after a full acceptance (2 tokens), and drafting step after step does not pay: the policy decodes
    alone rather than drafting once and stopping. At the default prior, 0.85, near this pair's measured acceptance,
    drafting 3 pays step after step, so the policy drafts after any step."""
    target = LatencyTable((1,), tuple(range(1, 10)), ((0.089, 0.136, 0.182, 0.173, 0.217, 0.260, 0.300, 0.356, 0.381),))
    draft = LatencyTable((1,), (1, 2, 4), ((0.0296, 0.0484, 0.0563),))
    costs = latency.LatencyProfile(target, draft, None, meta={})
    assert AdaptiveLength(costs, max_draft=8, prior=0.8).best_length(1) == 0
    policy = auto.adaptive_policy(costs, 1, 8)
    assert policy is not None and policy.prior == 0.85
    assert [policy.draft_budget(1, catch_up=c) for c in (1, 2, 3)] == [3, 3, 3]


def test_the_default_decoder_is_lookup_beside_the_adaptive_draft_and_leaves_out_a_draft_that_cannot_pay(monkeypatch):
    """``auto.default_decoder`` (what `blockspec generate` runs): the draft under the adaptive length over the
    measured costs, its options passed on, with prompt lookup priced by the target's own measured costs; where no
    length pays, lookup alone, or the target alone without lookup; a latency given is used, not measured again."""
    target, draft = HFModel(tiny_model(), name="tiny-target"), HFModel(tiny_model(), name="tiny-draft")
    costs = {"cheap": profile(CHEAP_VERIFICATION, draft_ms=10), "dear": profile(LINEAR_VERIFICATION, draft_ms=100)}
    probed = []  # (draft, batch size) of each latency probe, and the costs it returns

    def probe(target, draft, batch):
        probed.append((draft.name, batch))
        return costs["dear" if len(probed) > 1 else "cheap"]

    table = LatencyTable((1, 3), (1, 2), ((0.1, 0.2), (0.2, 0.4)))
    monkeypatch.setattr(auto, "latency_probe", probe)
    monkeypatch.setattr(auto, "lookup_latency", lambda target, batch: table if batch == 3 else None)

    decoder = auto.default_decoder(target, draft, batch_size=3, rule="token", max_draft=5, horizon=12)
    assert probed == [("tiny-draft", 3)] and decoder.draft is draft and decoder.rule == "token"
    assert isinstance(decoder.policy, AdaptiveLength) and (decoder.policy.max_draft, decoder.policy.horizon) == (5, 12)
    assert decoder.lookup is not None and decoder.lookup.costs is table
    alone = auto.default_decoder(target, draft, batch_size=3)  # the dear costs
    assert alone.draft is None and alone.lookup is not None and alone.lookup.costs is table  # lookup alone
    plain = auto.default_decoder(target, draft, lookup=False, latency=costs["dear"])
    assert plain.draft is None and plain.lookup is None and plain.max_draft == 0  # the target alone
    given = auto.default_decoder(target, draft, lookup=False, latency=costs["cheap"])
    assert given.draft is draft and given.lookup is None and given.policy.max_draft == ADAPTIVE_MAX_DRAFT
    assert len(probed) == 2  # a latency given is not measured again
    assert auto.default_decoder(target, batch_size=3).draft is None  # no draft model: lookup alone


def test_a_draft_that_pays_by_a_hair_does_not_draft_again_once_its_catch_up_costs_more_than_it_gains():
    """On the bundled pair's costs on llama.cpp's AVX2 kernels, drafting 1 token step after step gains 0.2 % over the
    target alone at the prior, and a draft forward over the 20 tokens decoded while the draft idled costs 1.5 plain
    steps more than one over 2. After a bad patch the policy decodes alone for the rest of the call, though the drift
    brings its acceptance back to the prior, and prompt lookup's bar is the target alone's; priced blind to the
    catch-up, it drafted again. A draft that gains 9 % (its forwards at 0.6 of those costs) drafts again within a few
    steps, catch-up included."""

    def policy(scale: float, horizon: float = 30) -> AdaptiveLength:
        draft = AVX2_LLAMACPP.draft
        scaled = LatencyTable(draft.batch_sizes, draft.tokens, (tuple(scale * s for s in draft.seconds[0]),))
        return AdaptiveLength(replace(AVX2_LLAMACPP, draft=scaled), horizon=horizon)

    def idle_steps(policy: AdaptiveLength) -> int:
        """Plain steps after four rejected ones, until it drafts again (60: it did not)."""
        width = policy.draft_budget(1, catch_up=1)
        for _ in range(4):
            observe(policy, agree=False, width=width)
        idle = 0
        while idle < 60 and policy.draft_budget(1, catch_up=2 + idle) == 0:
            idle += 1
        return idle

    hair = policy(1.0)
    assert max(hair.goodputs(1)) * AVX2_LLAMACPP.target(1, 1) == pytest.approx(1.002, abs=5e-4)
    assert hair.draft_budget(1, catch_up=1) == hair.draft_budget(1, catch_up=2) == 1  # drafting step after step
    assert hair.expected_rate(1, catch_up=21) == 1.0  # behind by 20 tokens: lookup need only beat the target alone
    assert idle_steps(hair) == 60 and hair.acceptance == pytest.approx(hair.prior, abs=1e-3)
    assert idle_steps(policy(1.0, horizon=math.inf)) < 60
    gaining = policy(0.6)
    assert max(gaining.goodputs(1)) * AVX2_LLAMACPP.target(1, 1) == pytest.approx(1.09, abs=0.01)
    assert idle_steps(gaining) < 10


@pytest.mark.slow  # a subprocess or thousands of rows: the full suite runs it
@pytest.mark.parametrize("rule", SAMPLED_RULES)
def test_law_of_the_first_tokens_is_the_targets_under_adaptive_length(rule, monkeypatch):
    """AdaptiveLength changes K between steps from what earlier steps accepted: still the target's law."""
    vocab, length, samples = 6, 3, 6000
    target = tiny_model(vocab=vocab, sharpness=5.0)
    draft = perturbed(target, scale=0.6, seed=1)
    law = exact_law_of_first_tokens(target, [1, 2, 3], length)
    costs = [100, 125, 150, 175, 200, 225, 250, 275, 300]
    policy = AdaptiveLength(profile(costs, draft_ms=10), max_draft=4, prior=0.8, memory=0.5)
    assert 0 < policy.best_length(1) < 4  # a length between the extremes, which the steps then move
    decoder = SpeculativeDecoder(target, draft, rule=rule, policy=policy)
    counts = lawkit.first_tokens_counts(decoder, [1, 2, 3], vocab, length, samples)
    assert lawkit.chi_square(counts, law).passed
    assert policy.acceptance != 0.8  # it learnt from the steps
    monkeypatch.setitem(RULES, rule, replace(RULES[rule], verify=off_by_one(RULES[rule].verify)))
    broken = lawkit.chi_square(lawkit.first_tokens_counts(decoder, [1, 2, 3], vocab, length, samples), law)
    assert not broken.passed, broken


@pytest.mark.parametrize(
    "ms, dtype, quant",
    [
        ({"bfloat16": {"1": 10.0}, "float32": {"1": 20.0}, "int8": {"1": 5.0}}, "bfloat16", "int8"),
        ({"bfloat16": {"1": 30.0}, "float32": {"1": 20.0}, "int8": {"1": 17.0}}, "float32", None),  # int8 within margin
        ({"bfloat16": {"1": 30.0}, "float32": {"1": 20.0}}, "float32", None),  # a torch without int8 kernels
    ],
)
def test_the_arithmetic_is_the_fastest_the_probe_measured(ms, dtype, quant, monkeypatch):
    monkeypatch.setattr(auto, "cpu_probe", lambda refresh=False: ms)
    chosen = auto.choose_arithmetic("cpu")
    assert (chosen.dtype, chosen.draft_quant) == (dtype, quant) and dtype in chosen.reason


@pytest.fixture
def probe_load(monkeypatch):
    """Sets the CPU time (in cores) other processes seem to use during a probe."""
    load = {"others_cpu_s": 0.0, "others_cores": 0.0}
    monkeypatch.setattr(auto.machine, "others_load", lambda start, end: load)
    return load


def test_the_cpu_probe_is_measured_once_per_machine_and_cached(tmp_path, monkeypatch, probe_load):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(auto, "_measure", lambda: calls.append(1) or {"bfloat16": {"1": 1.0}, "float32": {"1": 2.0}})
    first, second = auto.cpu_probe(), auto.cpu_probe()
    assert first == second and len(calls) == 1
    [cached] = (tmp_path / "machine").glob("probe-*.json")
    assert json.loads(cached.read_text())["key"]["threads"] == torch.get_num_threads()
    auto.cpu_probe(refresh=True)
    assert len(calls) == 2
    # a cache shared by machines of other kinds measures again on each: other CPU flags, another CPU model
    monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx512_made_up"])  # flags no machine has
    auto.cpu_probe()
    auto.cpu_probe()
    assert len(calls) == 3
    monkeypatch.setattr(machine, "cpu_model", lambda: "another CPU")
    auto.cpu_probe()
    assert len(calls) == 4


def test_a_probe_measured_while_the_machine_was_busy_is_not_kept(tmp_path, monkeypatch, probe_load):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(auto, "_measure", lambda: {"bfloat16": {"1": 1.0}, "float32": {"1": 2.0}})
    probe_load["others_cores"] = 1.0
    assert auto.cpu_probe()["bfloat16"] == {"1": 1.0}
    assert not list(tmp_path.glob("machine/probe-*.json"))


def test_latency_probes_measured_while_the_machine_was_busy_are_not_kept(tmp_path, monkeypatch, probe_load, caplog):
    """A busy machine prices wider forwards wrong (a forward over several tokens suffers more from a shared core):
    kept, such costs would misprice every later run here, e.g. stop the adaptive length from drafting."""
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    target = HFModel(tiny_model(), name="tiny-target")
    draft = HFModel(perturbed(tiny_model(), scale=0.3, seed=1), name="tiny-draft")
    probe_load["others_cores"] = 1.0
    with caplog.at_level(logging.WARNING, logger=auto.__name__):
        assert auto.latency_probe(target, draft, 1).target(1, 1) > 0
        assert auto.lookup_latency(target, 1, max_draft=2).tokens == (1, 2, 3)
    assert not list(tmp_path.rglob("*.json"))
    warnings = [r.getMessage() for r in caplog.records if "cores busy" in r.getMessage()]
    assert len(warnings) == 2 and "using it for this run only" in warnings[0]
    probe_load["others_cores"] = 0.0  # idle: measured again, and kept
    auto.latency_probe(target, draft, 1)
    auto.lookup_latency(target, 1, max_draft=2)
    assert len(list(tmp_path.rglob("*.json"))) == 2


def test_the_real_probe_measures_every_arithmetic():
    ms = auto._measure(repeats=1)
    assert set(ms) == {"bfloat16", "float32", "int8"}
    assert all(v[str(n)] > 0 for v in ms.values() for n in auto.PROBE_TOKENS)


@pytest.fixture(params=["chmod", "failing writes"])
def read_only_cache(request, tmp_path, monkeypatch):
    """A cache that cannot be written: a folder without write permission (which does not stop root, so that
    variant is skipped there) or one whose writes fail as on a read-only file system."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(cache))
    if request.param == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root writes into a folder without write permission")
        cache.chmod(0o500)
        request.addfinalizer(lambda: cache.chmod(0o700))
    else:

        def refuse(path, text):
            raise PermissionError(errno.EROFS, "Read-only file system", str(path))

        monkeypatch.setattr(auto, "write_atomic", refuse)
        monkeypatch.setattr(latency, "write_atomic", refuse)
    return cache


def test_a_read_only_cache_serves_the_probes_measured_and_says_they_cannot_be_kept(
    read_only_cache, monkeypatch, probe_load, caplog
):
    monkeypatch.setattr(auto, "_measure", lambda: {"bfloat16": {"1": 1.0}, "float32": {"1": 2.0}})
    target = HFModel(tiny_model(), name="tiny-target")
    draft = HFModel(perturbed(tiny_model(), scale=0.3, seed=1), name="tiny-draft")
    with caplog.at_level(logging.WARNING, logger=auto.__name__):
        assert auto.cpu_probe()["bfloat16"] == {"1": 1.0}
        assert auto.latency_probe(target, draft, 1).target(1, 1) > 0
    warnings = [r.getMessage() for r in caplog.records if "cannot cache" in r.getMessage()]
    assert len(warnings) == 2 and "arithmetic probe" in warnings[0] and "latency probe" in warnings[1]
    assert not list(read_only_cache.rglob("*.json"))


def test_the_lookup_probe_measures_every_width_once_and_measures_a_broken_file_again(tmp_path, monkeypatch, probe_load):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    target = HFModel(tiny_model(), name="tiny-target")
    timed = []
    real = auto.time_forwards
    monkeypatch.setattr(
        auto, "time_forwards", lambda models, *a, **kw: timed.append(models["target"][1]) or real(models, *a, **kw)
    )
    table = auto.lookup_latency(target, 3, max_draft=5)
    assert timed == [(1, 2, 3, 4, 5, 6)] and table.batch_sizes == (1, 3) and table.tokens == (1, 2, 3, 4, 5, 6)
    assert auto.lookup_latency(target, 3, max_draft=5) == table and len(timed) == 1  # read from the cache
    auto.lookup_latency(target, 3, max_draft=7)  # another width, another file
    (cached,) = [p for p in (tmp_path / "sv").glob("lookup-b3-*-w6-*")]
    cached.write_text('{"tokens": [1]}')
    assert auto.lookup_latency(target, 3, max_draft=5).tokens == (1, 2, 3, 4, 5, 6) and len(timed) == 3


def test_the_latency_probes_are_measured_again_on_other_kernels(tmp_path, monkeypatch, probe_load):
    """A cache shared by machines of other kinds (a home folder on a cluster), or kept across a new torch, must not
    price steps with their costs: another CPU model, other CPU flags or another torch measure both probes again; the
    same ones read the cache."""
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    target = HFModel(tiny_model(), name="tiny-target")
    draft = HFModel(perturbed(tiny_model(), scale=0.3, seed=1), name="tiny-draft")
    timed = []
    real = auto.time_forwards
    monkeypatch.setattr(auto, "time_forwards", lambda models, *a, **kw: timed.append(1) or real(models, *a, **kw))

    def probes() -> int:
        before = len(timed)
        auto.lookup_latency(target, 1, max_draft=2)
        auto.latency_probe(target, draft, 1)
        return len(timed) - before

    assert probes() == 2 and probes() == 0
    monkeypatch.setattr(machine, "cpu_flags", lambda: ["avx512_made_up"])  # flags no machine has
    assert probes() == 2 and probes() == 0
    monkeypatch.setattr(machine, "cpu_model", lambda: "another CPU")
    assert probes() == 2
    monkeypatch.setattr(torch, "__version__", "0.0")
    assert probes() == 2


def test_the_cached_latency_probe_is_found_by_the_drafts_name_before_it_loads(tmp_path, monkeypatch, probe_load):
    """What generate asks before it loads its draft: latency_probe's cached profile, found from the name the draft's
    adapter will have; None where nothing is cached for that name or batch size, or the file cannot be read."""
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    target = HFModel(tiny_model(), name="tiny-target")
    draft = HFModel(perturbed(tiny_model(), scale=0.3, seed=1), name="tiny-draft")
    assert auto.cached_latency(target, "tiny-draft", 1) is None
    measured = auto.latency_probe(target, draft, 1)
    cached = auto.cached_latency(target, "tiny-draft", 1)
    assert cached is not None and cached.target.seconds == measured.target.seconds
    assert cached.draft.seconds == measured.draft.seconds
    assert (
        auto.cached_latency(target, "tiny-draft (int8)", 1) is None
        and auto.cached_latency(target, "tiny-draft", 2) is None
    )
    (saved,) = (tmp_path / "sv").glob("probe-*.json")
    saved.write_text("{")
    assert auto.cached_latency(target, "tiny-draft", 1) is None


def test_the_kernels_of_a_model_on_llama_cpp_include_its_build(monkeypatch):
    """Another llama.cpp build (AVX2 against AVX-512 kernels) prices steps differently on the same CPU."""
    from blockspec.models import llamacpp

    build = ["CPU : AVX2 = 1 | AVX512 = 1 |"]
    monkeypatch.setattr(llamacpp, "build_info", lambda: build[0])
    on_llamacpp = type("OnLlamaCpp", (), {"dtype": "gguf", "device": "cpu"})()
    on_torch = type("OnTorch", (), {"dtype": torch.float32, "device": "cpu"})()
    avx512 = latency.kernels(on_llamacpp)
    build[0] = "CPU : AVX2 = 1 |"
    assert latency.kernels(on_llamacpp) != avx512
    assert latency.kernels(on_torch) == latency.kernels(on_torch, on_torch) != latency.kernels(on_torch, on_llamacpp)


def test_the_lookup_probe_keeps_its_cost_ratios_through_two_slow_rounds(tmp_path, monkeypatch):
    """A shared machine has slow phases: here the 1-token forward of two timed rounds takes 1.4 times as long (a
    forward of w tokens costs w otherwise). The probe's 2-token / 1-token ratio must stay 2; with 2 timed rounds
    (whose median is their mean) it fell to 1.67 or 1.43, and lookup proposed where a proposal loses."""
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    calls = {1: 0}

    def fake_seconds(model, step, last_only):
        width = step.shape[1]
        if width == 1:
            calls[1] += 1  # call 1 is the warm-up round; calls 2 and 3 are the first two timed rounds
            return 1.4 if calls[1] in (2, 3) else 1.0
        return float(width)

    monkeypatch.setattr(auto, "step_seconds", fake_seconds)
    table = auto.lookup_latency(HFModel(tiny_model(), name="tiny-target"), 1, max_draft=3)
    assert calls[1] == 1 + auto.LATENCY_REPEATS
    assert table(1, 2) / table(1, 1) == pytest.approx(2.0)


def test_the_lookup_probe_times_no_forward_right_after_a_much_wider_one(tmp_path, monkeypatch):
    """A forward timed right after a much wider one ran up to twice as slow on a 2-core CPU (the wide one's
    processing leaves threads busy), which decoding, where steps of one token follow each other, never pays. Here
    such a forward costs 1.5 more (a forward of w tokens costs w otherwise): timed widest first, the probe's ratios
    stay exact; timed narrowest first, each round's 1-token forward follows the 4-token one and the ratio falls."""
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    before = [0]

    def fake_seconds(model, step, last_only):
        width, wider = step.shape[1], before[0]
        before[0] = width
        return width + (1.5 if wider > 2 * width else 0.0)

    monkeypatch.setattr(auto, "step_seconds", fake_seconds)
    table = auto.lookup_latency(HFModel(tiny_model(), name="tiny-target"), 1, max_draft=3)
    assert [table(1, w) / table(1, 1) for w in (2, 3, 4)] == pytest.approx([2.0, 3.0, 4.0])


def test_generate_with_its_defaults_runs_from_a_read_only_cache(read_only_cache, tmp_path, monkeypatch, probe_load):
    """Every model is there: the probes that cannot be cached are measured for this run, not an error."""
    monkeypatch.setattr(auto, "_measure", lambda: {"bfloat16": {"1": 2.0}, "float32": {"1": 1.0}})
    target, draft = save_tiny(tmp_path / "target"), save_tiny(tmp_path / "draft", noise=0.3)
    status = cli.main(["generate", "--target", target, "--draft", draft, "--max-new-tokens", "4", "abc"])
    assert status == 0
