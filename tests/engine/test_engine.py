"""The engine on tiny random transformers models: greedy equivalence, exact law at temperature 1, rollback,
EOS and length exactness, row independence, and clear errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kits import lawkit
from kits.enginekit import off_by_one, reference_greedy
from kits.tiny import exact_law_of_first_tokens, perturbed, tiny_model, tiny_tokenizer

from blockspec import SamplingParams, SpeculativeDecoder
from blockspec.batch import Batch
from blockspec.bench.executor import ExpectedScores
from blockspec.engine import plain
from blockspec.models.hf import PREFILL_TOKENS, HFModel, prefill_groups
from blockspec.policy import FixedLength
from blockspec.verify import RULES, SAMPLED_RULES

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]


@pytest.mark.parametrize("rule", [*RULES, None])  # None: the target alone
@pytest.mark.parametrize("max_draft", [1, 3, 5])
def test_greedy_output_equals_plain_greedy_decoding(pair, rule, max_draft):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft if rule else None, rule=rule or "block", max_draft=max_draft)
    for prompts in (PROMPTS[:1], PROMPTS):  # batch 1, and batch 4 with different prompt lengths
        result = decoder.generate(prompts, max_new_tokens=24, sampling=GREEDY)
        for b, prompt in enumerate(prompts):
            assert result.sequences[b] == reference_greedy(target, prompt, 24), f"row {b}"
    if rule is not None:  # the check means something only if drafts were both accepted and rejected
        assert 1.3 < result.block_efficiency < max_draft + 1 or max_draft == 1


def test_greedy_equivalence_on_a_llama_model(device):
    target = tiny_model(family="llama", sharpness=5.0, seed=3)
    draft = perturbed(target, scale=0.3, seed=2).to(device)
    target = target.to(device)
    decoder = SpeculativeDecoder(target, draft, rule="block", max_draft=4)
    result = decoder.generate(PROMPTS, max_new_tokens=20, sampling=GREEDY)
    assert result.sequences == [reference_greedy(target, p, 20) for p in PROMPTS]


@pytest.mark.parametrize("prefill_tokens", [PREFILL_TOKENS, 6])  # one prefill forward; rows 0 and (3, 1) apart
def test_rollback_then_replay_gives_the_logits_of_a_fresh_forward(prefill_tokens):
    model = tiny_model(sharpness=5.0)  # 4 query heads share 2 key/value heads
    adapter = HFModel(model)
    assert model.config._attn_implementation == "sdpa"  # grouped_sdpa only inside its forwards (test_hf_untouched)
    adapter.prefill_tokens = prefill_tokens
    gen = torch.Generator().manual_seed(0)
    rows = [[1, 2, 3, 4, 5], [6], [], [7, 8, 9]]
    adapter.prefill(rows)
    for step in range(40):  # append 1-4 tokens per row (some as holes), then roll back a random amount
        width = 1 + step % 4
        tokens = torch.randint(1, 40, (len(rows), width), generator=gen)
        valid = torch.rand(len(rows), width, generator=gen) < 0.8
        logits = adapter.forward(tokens, valid)
        for b, row in enumerate(rows):
            new = tokens[b][valid[b]].tolist()
            if row + new:  # no cache, no mask: transformers' own sdpa
                fresh = model(torch.tensor([row + new])).logits[0, len(row) :]
                torch.testing.assert_close(logits[b][valid[b]], fresh, atol=1e-5, rtol=1e-5)
            row += new
        drop = torch.randint(0, 3, (len(rows),), generator=gen)
        keep = torch.minimum(adapter.lengths, (adapter.lengths - drop).clamp(min=1))
        adapter.rollback(keep)
        rows = [row[: int(k)] for row, k in zip(rows, keep)]
        if step == 20:  # a finished row leaves the batch
            adapter.select(torch.tensor([0, 2, 3]))
            rows = [rows[0], rows[2], rows[3]]
    assert adapter.lengths.tolist() == [len(r) for r in rows]


def test_prefill_groups_rows_by_length_within_the_token_budget():
    assert prefill_groups([5, 1, 0, 3], 6) == [[0], [3, 1]]  # the empty row needs no forward
    assert prefill_groups([5, 1, 0, 3], PREFILL_TOKENS) == [[0, 3, 1]]
    assert prefill_groups([9, 9], 4) == [[0], [1]]  # a row longer than the budget still gets its forward


def test_eos_and_max_new_tokens_are_exact(pair):
    target, draft = pair
    plain = [reference_greedy(target, p, 30, eos=None) for p in PROMPTS]
    eos = plain[0][6]  # make a token the greedy continuation of prompt 0 reaches an end of sequence
    decoder = SpeculativeDecoder(target, draft, rule="block", max_draft=4)
    decoder.target.eos_token_ids = (eos,)
    result = decoder.generate(PROMPTS, max_new_tokens=30, sampling=GREEDY)
    for b, seq in enumerate(plain):
        expected = seq[: seq.index(eos) + 1] if eos in seq else seq
        assert result.sequences[b] == expected
        assert result.finish_reasons[b] == ("eos" if eos in seq else "length")
    for max_new in (1, 2, 7):
        sampled = decoder.generate(PROMPTS, max_new_tokens=max_new, seed=3, stop_on_eos=False)
        assert [len(s) for s in sampled.sequences] == [max_new] * len(PROMPTS)


def test_sampled_rows_stop_right_after_their_first_eos(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, rule="token", max_draft=4)
    decoder.target.eos_token_ids = (3, 7, 11)  # several EOS ids, frequent enough to end rows mid-draft
    result = decoder.generate(PROMPTS * 4, max_new_tokens=40, seed=0)
    for seq, reason in zip(result.sequences, result.finish_reasons):
        ends = [n for n, t in enumerate(seq) if t in (3, 7, 11)]
        assert ends == ([len(seq) - 1] if reason == "eos" else [])
    assert "eos" in result.finish_reasons
    rows_per_step = [len(s.rows) for s in result.stats]
    assert rows_per_step == sorted(rows_per_step, reverse=True) and rows_per_step[-1] < rows_per_step[0]


@pytest.mark.parametrize("rule", SAMPLED_RULES)
def test_law_of_the_first_tokens_is_the_targets(rule, device, monkeypatch):
    """Chi-square of the joint law of the first 3 tokens (6**3 outcomes) against the exact target law; the
    same test on an engine whose verifier sees misaligned target distributions must fail."""
    vocab, length, samples = 6, 3, 6000
    target = tiny_model(vocab=vocab, sharpness=5.0)
    draft = perturbed(target, scale=0.6, seed=1).to(device)
    target = target.to(device)
    law = exact_law_of_first_tokens(target, [1, 2, 3], length)
    decoder = SpeculativeDecoder(target, draft, rule=rule, max_draft=2)

    def counts():
        result = decoder.generate([[1, 2, 3]] * samples, max_new_tokens=length, seed=0, stop_on_eos=False)
        return lawkit.joint_counts(result.sequences, vocab), result

    observed, result = counts()
    test = lawkit.chi_square(observed, law)
    assert test.passed, f"{rule}: {test}"
    assert 1.3 < result.block_efficiency < 2.9  # drafts were both accepted and rejected

    monkeypatch.setitem(RULES, rule, replace(RULES[rule], verify=off_by_one(RULES[rule].verify)))
    broken = lawkit.chi_square(counts()[0], law)
    assert not broken.passed, f"negative control passed: {broken}"


def test_law_of_the_target_alone_is_the_targets(monkeypatch):
    """The target alone at temperature 1 (every step plain: one uniform per row, by inversion): chi-square of the joint
    law of the first 3 tokens; the same test on an engine that draws each row's plain uniform once, not once a step
    (each token then fine on its own, the three together not), must fail."""
    vocab, length, samples = 6, 3, 6000
    target = tiny_model(vocab=vocab, sharpness=5.0)
    law = exact_law_of_first_tokens(target, [1, 2, 3], length)
    decoder = SpeculativeDecoder(target)

    def counts():
        result = decoder.generate([[1, 2, 3]] * samples, max_new_tokens=length, seed=0, stop_on_eos=False)
        return lawkit.joint_counts(result.sequences, vocab)

    test = lawkit.chi_square(counts(), law)
    assert test.passed, test
    draw, first = Batch.draw, []

    def stale(self, *args):
        draws = draw(self, *args)
        assert draws is not None  # temperature 1: a step draws uniforms
        first.append(first[0] if first else draws.plain)
        return replace(draws, plain=first[-1])

    monkeypatch.setattr(Batch, "draw", stale)
    broken = lawkit.chi_square(counts(), law)
    assert len(first) == length and not broken.passed, f"negative control passed: {broken}"


@pytest.mark.parametrize("vocab", [5, 151_936])
def test_a_plain_greedy_step_is_every_rules_verdict(vocab):
    # without uniforms (temperature 0: one-hot probabilities) the engine's plain verdict is each row's argmax, ties to
    # the lowest id, as every rule's on a step that drafted nothing
    target = torch.rand(64, 1, vocab, generator=torch.Generator().manual_seed(3))
    target = torch.zeros_like(target).scatter_(-1, target.argmax(-1, keepdim=True), 1.0)
    out = plain(target, None)
    for rule in RULES.values():
        verdict = rule.verify(torch.empty(64, 0, dtype=torch.long), None, target)
        assert torch.equal(out.tokens, verdict.tokens) and torch.equal(out.num_accepted, verdict.num_accepted)
    assert len(set(out.tokens[:, 0].tolist())) > min(64, vocab) // 2, "rows this alike compare little"


class Schedule(FixedLength):
    """Drafts ``budgets[s]`` tokens at step s and records the catch-up width the engine reports before drafting."""

    def __init__(self, budgets):
        super().__init__(max(budgets))
        self.budgets, self.catch_ups = list(budgets), []

    def draft_budget(self, batch: int, catch_up: int) -> int:
        self.catch_ups.append(catch_up)
        return self.budgets[len(self.catch_ups) - 1]


def test_the_policy_is_told_how_many_tokens_the_draft_reads_before_drafting(pair):
    """1 token at first, 2 after a fully accepted step, one more per step that did not draft: what the draft's
    first forward of the step then reads (the policy prices drafting with it)."""
    target, _ = pair
    policy = Schedule([2, 2, 0, 0, 2, 2])
    decoder = SpeculativeDecoder(target, target, rule="block", policy=policy)  # the target drafts: all accepted
    widths = []
    forward = decoder.draft.forward
    decoder.draft.forward = lambda tokens, valid, **kw: widths.append(tokens.shape[1]) or forward(tokens, valid, **kw)
    result = decoder.generate(PROMPTS[:1], max_new_tokens=14, sampling=GREEDY, stop_on_eos=False)
    assert result.sequences[0] == reference_greedy(target, PROMPTS[0], 14, eos=None)
    assert policy.catch_ups == [1, 2, 2, 3, 4, 2]
    assert widths == [1, 1, 2, 1, 4, 1, 2, 1]  # per drafting step: the catch-up forward, then one per position


def test_a_row_does_not_depend_on_its_neighbours(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, rule="block", max_draft=3)
    together = decoder.generate(PROMPTS, max_new_tokens=20, seed=[11, 12, 13, 14])
    for b, prompt in enumerate(PROMPTS):
        alone = decoder.generate([prompt], max_new_tokens=20, seed=[11 + b])
        assert alone.sequences[0] == together.sequences[b]


def test_same_seed_same_output_and_seeds_matter(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, rule="block", max_draft=3)
    first = decoder.generate(PROMPTS, max_new_tokens=15, seed=5).sequences
    assert decoder.generate(PROMPTS, max_new_tokens=15, seed=5).sequences == first
    assert decoder.generate(PROMPTS, max_new_tokens=15, seed=6).sequences != first


def test_expected_accepted_lengths_are_recorded_and_match_the_observed_mean(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, rule="block", max_draft=4)
    scores = ExpectedScores()
    result = decoder.generate(PROMPTS * 8, max_new_tokens=30, seed=0, on_step=scores)
    accepted = [a for s in result.stats for a in s.accepted]
    verified = [k for s in result.stats for k in s.verified]
    rows = zip(accepted, scores.expected["block"], scores.expected["token"], verified, strict=True)
    full = [(a, e, t) for a, e, t, k in rows if k == 4]
    observed = sum(a for a, _, _ in full) / len(full)
    predicted = sum(e for _, e, _ in full) / len(full)
    # tau lies in [0, 4]: its standard deviation is at most 2, so 5 standard errors is 10 / sqrt(n).
    assert abs(observed - predicted) < 10 / len(full) ** 0.5
    assert sum(e for _, e, _ in full) >= sum(t for _, _, t in full) - 1e-6 * len(full)
    # sampled drafts of 4 tokens: the block rule's expectation is above the token rule's on average, so an observer
    # that scored both columns with one rule (equal sums) fails here
    assert sum(e for _, e, _ in full) > sum(t for _, _, t in full) + 1e-3 * len(full)


def test_options_that_cannot_stay_lossless_are_refused(pair):
    decoder = SpeculativeDecoder(*pair)
    with pytest.raises(ValueError, match="repetition_penalty is not supported"):
        decoder.generate(PROMPTS, max_new_tokens=4, repetition_penalty=1.2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
        decoder.generate(PROMPTS, max_new_tokens=4, max_tokens=4)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda d: d.generate(PROMPTS, max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (lambda d: d.generate([[1], []], max_new_tokens=3), "prompt 1 is empty"),
        (lambda d: d.generate(["hello"], max_new_tokens=3), "string prompts need a tokenizer"),
        (lambda d: d.generate([[1, 99]], max_new_tokens=3), "outside the vocabulary"),
        (lambda d: d.generate([[1] * 300], max_new_tokens=3), "exceeds the context of 256"),
        (lambda d: d.generate([[1]], max_new_tokens=3, seed=[1, 2]), "one int per prompt"),
        (lambda d: d.generate([[1]], max_new_tokens=3, stop_strings=["x"]), "stop_strings need a tokenizer"),
    ],
)
def test_bad_generate_arguments_get_clear_errors(pair, call, message):
    with pytest.raises(ValueError, match=message):
        call(SpeculativeDecoder(*pair))


def test_bad_decoder_arguments_get_clear_errors(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="rule must be one of"):
        SpeculativeDecoder(target, draft, rule="typical")
    with pytest.raises(ValueError, match="a length policy needs a draft model"):
        SpeculativeDecoder(target, None, policy=FixedLength(2))
    with pytest.raises(ValueError, match="max_draft must be an int >= 1"):
        SpeculativeDecoder(target, draft, max_draft=0)
    with pytest.raises(ValueError, match="needs temperature 0"):
        SpeculativeDecoder(target, draft, rule="greedy").generate([[1]], max_new_tokens=2)
    with pytest.raises(ValueError, match="cannot check they share a vocabulary"):
        SpeculativeDecoder(target, tiny_model(vocab=40))


def test_stop_strings_end_a_row_right_after_the_text(pair):
    target, draft = pair
    tokenizer = tiny_tokenizer()
    decoder = SpeculativeDecoder(HFModel(target, tokenizer), HFModel(draft, tokenizer), max_draft=4)
    free = decoder.generate(PROMPTS, max_new_tokens=30, sampling=GREEDY, stop_on_eos=False)
    stop = str(tokenizer.decode(free.sequences[0][5:7]))  # text that row 0 produces mid-way, inside some step
    result = decoder.generate(PROMPTS, max_new_tokens=30, sampling=GREEDY, stop_on_eos=False, stop_strings=[stop])
    for seq, got, reason in zip(free.sequences, result.sequences, result.finish_reasons):
        ends = [n for n in range(1, len(seq) + 1) if stop in tokenizer.decode(seq[:n])]
        assert got == (seq[: ends[0]] if ends else seq)
        assert reason == ("stop" if ends else "length")
    assert result.finish_reasons[0] == "stop"


def test_sliding_window_models_are_refused_not_silently_given_full_attention():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=16,
        max_window_layers=1,
    )
    with pytest.raises(ValueError, match="sliding_attention"):
        HFModel(Qwen2ForCausalLM(config))
