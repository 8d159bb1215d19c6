"""Prompt lookup drafting: golden tests of the matcher and of the cost-aware length, greedy equivalence and the exact
law at temperature 1 (with negative controls) for lookup alone and lookup mixed with a draft model, per-prompt
state in batches whose rows finish early, and clear errors."""

from __future__ import annotations

import random

import pytest
import torch
from kits import lawkit
from kits.enginekit import reference_greedy
from kits.svkit import profile
from kits.tiny import exact_law_of_first_tokens, perturbed, tiny_model

from blockspec import PromptLookup, SamplingParams, SpeculativeDecoder
from blockspec.bench.executor import ExpectedScores
from blockspec.defaults import LOOKUP_MAX_DRAFT
from blockspec.drafting import LookupState
from blockspec.drafting import proposer as proposer_module
from blockspec.drafting.lookup import Odds, ngram_class
from blockspec.drafting.proposer import behind
from blockspec.models.hf import HFModel
from blockspec.policy import AdaptiveLength, FixedLength, LatencyTable, SVPolicy
from blockspec.verify import RULES, SAMPLED_RULES

pytestmark = pytest.mark.usefixtures("one_thread")  # thousands of tiny rows: faster on one thread

GREEDY = SamplingParams(temperature=0.0)
# Prompts that repeat themselves (lookup fires at once), a short one and ones that do not (it fires later, if at all)
PROMPTS = [
    [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2],
    [8, 9],
    [10, 11, 12, 10, 11, 12, 10],
    [14],
    [20, 21, 22, 23, 24, 25, 26, 27],
]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(sharpness=5.0)
    return target, perturbed(target, scale=0.3, seed=1)


# --- the matcher -----------------------------------------------------------------------------------------------


def reference_match(context: list[int], max_ngram: int, min_ngram: int, length: int) -> tuple[int, list[int]]:
    """The rule, written plainly: longest n first, then the occurrence ending latest before the last token."""
    for n in range(max_ngram, min_ngram - 1, -1):
        for start in range(len(context) - n - 1, -1, -1):  # the occurrence ends at start + n - 1 <= len - 2
            if n <= len(context) - 1 and context[start : start + n] == context[len(context) - n :]:
                tokens = context[start + n : start + n + length]
                return (n, tokens) if tokens else (0, [])
    return 0, []


def test_the_most_recent_occurrence_wins():
    assert PromptLookup(max_ngram=1).match([1, 7, 1, 8, 1], 5) == (1, [8, 1])
    assert PromptLookup().match([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 10) == (3, [7, 5, 1, 2, 3])


def test_the_longest_ngram_wins_over_a_more_recent_shorter_one():
    context = [2, 3, 4, 9, 3, 5, 2, 3]  # [2, 3] occurs at 0; [3] alone more recently at 4
    assert PromptLookup(max_ngram=2).match(context, 3) == (2, [4, 9, 3])
    assert PromptLookup(max_ngram=1).match(context, 3) == (1, [5, 2, 3])


def test_no_match_gives_an_empty_proposal():
    assert PromptLookup().match([1, 2, 3], 4) == (0, [])
    assert PromptLookup(min_ngram=2).match([5, 1, 6, 1], 4) == (0, [])  # only the 1-gram [1] occurs before
    assert PromptLookup().match([7], 4) == (0, [])


def test_the_proposal_is_cut_at_the_context_end_and_at_the_allowed_length():
    lookup = PromptLookup()
    assert lookup.match([1, 2, 1], 5) == (1, [2, 1])  # what follows the occurrence runs to the context's end
    assert lookup.match([1, 2, 3, 4, 1], 2) == (1, [2, 3])
    assert lookup.match([1, 2, 3, 4, 1], 0) == (0, [])


def test_the_suffix_does_not_match_itself():
    assert PromptLookup().match([4, 5], 3) == (0, [])
    assert PromptLookup().match([4, 4], 3) == (1, [4])  # the first 4 is an earlier occurrence of the last one
    assert PromptLookup().match([6, 6, 6], 3) == (2, [6])  # [6, 6] at 0 ends before the last token: one follows


def test_a_byte_match_straddling_two_tokens_is_not_an_occurrence():
    # little-endian bytes: 0x01000000 = 00 00 00 01 and 2 = 02 00 00 00 contain 0x201's bytes 01 02 00 00
    assert PromptLookup().match([0x01000000, 2, 9, 0x201], 3) == (0, [])
    assert PromptLookup().match([0x201, 5, 0x01000000, 2, 9, 0x201], 3) == (1, [5, 0x01000000, 2])


def test_the_matcher_agrees_with_a_plain_reference_on_random_contexts():
    rng = random.Random(0)
    for trial in range(400):
        vocab = rng.choice([2, 3, 5, 40])
        context = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        max_ngram = rng.randint(1, 13)
        min_ngram, length = rng.randint(1, max_ngram), rng.randint(0, 6)
        lookup = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram, max_draft=10)
        assert lookup.match(context, length) == reference_match(context, max_ngram, min_ngram, length), trial
    long = [rng.randrange(150_000) for _ in range(4000)]  # a 4k context with one planted repeat
    long[1000:1003] = long[-3:]
    assert PromptLookup().match(long, 10) == (3, long[1003:1013])


# --- the cost-aware length -------------------------------------------------------------------------------------


def table(*ms: float, batch: int = 1) -> LatencyTable:
    """A latency table at one batch size: ``ms[w - 1]`` milliseconds for a forward over w tokens."""
    return LatencyTable((batch,), tuple(range(1, len(ms) + 1)), (tuple(m / 1e3 for m in ms),))


def best_rate_length(first: float, then: float, available: int, cost, alone: float = 0.0) -> int:
    """The documented choice, written plainly: argmax over k of E(k) / (cost(k + 1) / cost(1)), the shortest on a
    tie, where k = 0 is worth the more of a plain step (1) and ``alone`` tokens per plain step."""
    rates = [(1 + sum(first * then**j for j in range(k))) / (cost(k + 1) / cost(1)) for k in range(available + 1)]
    rates[0] = max(rates[0], alone)
    return max(range(available + 1), key=lambda k: (rates[k], -k))


def test_the_length_is_the_most_tokens_per_second():
    steep = table(26, 50, 66, 77, 94, 109, 126, 130, 138)  # one of this machine kind's llama.cpp probes, ms
    assert PromptLookup(costs=steep).length(0.99, 0.99, 8, rows=1) == 8  # a sure copy pays in full
    assert PromptLookup(costs=steep).length(0.5, 0.9, 8, rows=1) == 0  # an unsure first token does not pay
    assert PromptLookup().length(0.01, 0.01, 5, rows=1) == 5  # no costs: every width costs one step
    dip = table(10, 30, 40, 30, 50)  # 3 drafted tokens cost less than 2 or 1 (a forward over 4 tokens is cheap)
    assert PromptLookup(costs=dip).length(0.9, 0.9, 4, rows=1) == 3
    rng = random.Random(0)
    for _ in range(300):
        ms = sorted(rng.uniform(5, 100) for _ in range(9))
        first, then, available = rng.random(), rng.random(), rng.randint(0, 8)
        alone = rng.choice([None, rng.uniform(0, 3)])  # tokens per plain step without a proposal
        lookup = PromptLookup(costs=table(*ms))
        expected = best_rate_length(first, then, available, lambda w, ms=ms: ms[w - 1] / 1e3, alone or 0.0)
        assert lookup.length(first, then, available, rows=1, alone=alone) == expected, (ms, first, then, alone)
        slower = PromptLookup(costs=table(*(1.3 * m for m in ms)))  # measured while the machine ran slower
        assert slower.length(first, then, available, rows=1, alone=alone) == expected, (ms, first, then, alone)
    # no costs: every width costs one step, E(5) = 1.97 tokens, and the draft's rate is in the same unit
    assert PromptLookup().length(0.5, 0.5, 5, rows=1, alone=1.9) == 5
    assert PromptLookup().length(0.5, 0.5, 5, rows=1, alone=2.0) == 0


def test_the_costs_are_read_at_the_steps_batch_size():
    costs = LatencyTable((1, 8), (1, 2), ((0.010, 0.011), (0.010, 0.030)))  # at 8 rows, a wider forward is dear
    assert PromptLookup(costs=costs).length(0.6, 0.6, 1, rows=1) == 1
    assert PromptLookup(costs=costs).length(0.6, 0.6, 1, rows=8) == 0


def test_the_odds_start_at_the_prior_and_count_first_and_later_tokens():
    odds = Odds(3, weight=2.0)
    assert odds.rates() == pytest.approx((1 / 3, 0.75))  # below class 9 the first token at 1/3, later ones n / (n + 1)
    odds.observe(compared=5, agreed=3)  # the first agreed; 2 later ones agreed, the 4th differed
    assert odds.rates() == pytest.approx((5 / 3 / 3, 3.5 / 5))
    odds.observe(compared=4, agreed=4)  # all agreed: 3 later ones, none differed
    assert odds.rates() == pytest.approx((8 / 3 / 4, 6.5 / 8))
    odds.observe(compared=2, agreed=0)  # the first differed: nothing is known of the later ones
    assert odds.rates() == pytest.approx((8 / 3 / 5, 6.5 / 8))
    assert Odds(9, weight=2.0).rates() == pytest.approx((0.9, 0.9))  # a long match is a copy under way
    assert [ngram_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 40)] == [1, 2, 3, 4, 5, 5, 9, 9]


def test_the_odds_are_per_prompt_and_match_length():
    # flat costs up to 2 drafted tokens, then dear: each row proposes what fits, and each prompt keeps its own counts
    state = LookupState(PromptLookup(costs=table(10, 10, 10, 1000)), prompts=3)
    contexts = [[1, 2, 3, 4, 5, 1, 2], [9, 8], [7, 6, 5, 4, 7]]
    assert state.propose([0, 1, 2], contexts, [10, 10, 1]) == [[3, 4], [], [6]]  # at most limit[b] tokens
    # prompt 1 left the batch, so rows 0 and 1 are prompts 2 and 0; prompt 2 committed 6, prompt 0 3 and 8
    state.propose([2, 0], [contexts[2] + [6], contexts[0] + [3, 8]], [1, 10])
    assert state.odds[0][2].rates() == pytest.approx((5 / 9, 4 / 9))  # prompt 0 matched 2 tokens: class 2
    assert state.odds[1] == {} and state.odds[2][1].rates() == pytest.approx((5 / 9, 1 / 2))


def test_every_match_counts_against_what_the_target_committed_proposed_or_not():
    # steep costs: at the prior no match pays; one whose first token the target went on to commit raises its class's
    # odds without a proposal, and the class's next match is proposed
    state = LookupState(PromptLookup(costs=table(10, 14, 17, 40)), prompts=1)
    text = [1, 2, 3, 9, 2, 3]
    assert state.propose([0], [text], [5]) == [[]] and state.pending[0] == (2, [9, 2, 3], 6)
    assert state.propose([0], [text + [9]], [5]) == [[]]  # 9 committed: the first token agreed
    assert state.odds[0][2].rates() == pytest.approx((5 / 9, 2 / 3)) and state.pending[0] == (3, [2, 3, 9], 7)
    # 7 7 2 3 committed: the class-3 match's first token differed; "2 3" matches again, followed by 9 7 7 2 3
    assert state.propose([0], [text + [9, 7, 7, 2, 3]], [5]) == [[9, 7]]
    assert state.odds[0][3].rates() == pytest.approx((2 / 9, 3 / 4))
    fresh = LookupState(PromptLookup(costs=table(10, 14, 17, 40)), prompts=1)
    assert fresh.propose([0], [text + [9, 7, 7, 2, 3]], [5]) == [[]]  # at the prior, the same match does not pay


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(max_ngram=0), "max_ngram must be an int >= 1"),
        (dict(min_ngram=0), "min_ngram must be an int >= 1"),
        (dict(max_draft=2.0), "max_draft must be an int >= 1"),
        (dict(max_ngram=True), "max_ngram must be an int >= 1"),
        (dict(min_ngram=3, max_ngram=2), "min_ngram \\(3\\) must not exceed max_ngram \\(2\\)"),
        (dict(prior_weight=0), "prior_weight must be a number > 0"),
        (dict(prior_weight=float("nan")), "prior_weight must be a number > 0"),
        (dict(costs={1: 0.01}), "costs must be a LatencyTable or None, got dict"),
    ],
)
def test_bad_settings_get_clear_errors(settings, message):
    with pytest.raises(ValueError, match=message):
        PromptLookup(**settings)


# --- the engine ------------------------------------------------------------------------------------------------


def lookup_steps(result) -> list[tuple[int, int]]:
    """(drafted, accepted) of every row step whose draft was a lookup proposal."""
    return [(k, a) for s in result.stats for used, k, a in zip(s.lookup, s.verified, s.accepted) if used]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("mode", ["lookup", "lookup+model"])
def test_greedy_output_equals_plain_greedy_decoding(pair, mode, rule):
    target, draft = pair
    decoder = SpeculativeDecoder(
        target, draft if mode == "lookup+model" else None, rule=rule, max_draft=3, lookup=PromptLookup()
    )
    result = decoder.generate(PROMPTS, max_new_tokens=30, sampling=GREEDY)
    assert result.sequences == [reference_greedy(target, p, 30) for p in PROMPTS]
    used = lookup_steps(result)  # lookup fired, and its proposals were both accepted and rejected
    assert any(a > 0 for _, a in used) and any(a < k for k, a in used)
    if mode == "lookup+model":
        assert any(any(s.lookup) and any(not u and k > 0 for u, k in zip(s.lookup, s.verified)) for s in result.stats)


def smoothed(with_proposals, vocab: int):
    """A plausible bug: lookup rows verified against a smoothed one-hot law, not the one they were drafted from."""

    def broken(proposals, draft_tokens, draft_probs, num_verified):
        tokens, probs, num_verified = with_proposals(proposals, draft_tokens, draft_probs, num_verified)
        one_hot = torch.nn.functional.one_hot(tokens, vocab).float()  # [B, K, V]
        rows = torch.tensor([len(p) > 0 for p in proposals])[:, None, None]
        return tokens, torch.where(rows, 0.5 * one_hot + 0.5 / vocab, one_hot if probs is None else probs), num_verified

    return broken


def model_rows_kept(with_proposals, vocab: int):
    """A plausible bug of a mixed step: the lookup rows keep what the model's tensor holds there (the outputs of
    holes in the draft's forward, zeros past its width) instead of one-hot rows. (Passing draft_probs=None for a
    mixed step, one-hot for the model's rows too, is no such control: verifying any drafted token as if it were
    one-hot, accept x with probability target(x), else draw from the target without x, is lossless.)"""

    def broken(proposals, draft_tokens, draft_probs, num_verified):
        tokens, probs, num_verified = with_proposals(proposals, draft_tokens, draft_probs, num_verified)
        if probs is not None:
            kept = torch.nn.functional.pad(draft_probs, (0, 0, 0, probs.shape[1] - draft_probs.shape[1]))
            rows = torch.tensor([len(p) > 0 for p in proposals])[:, None, None]
            probs = torch.where(rows, kept, probs)
        return tokens, probs, num_verified

    return broken


@pytest.mark.parametrize("rule", SAMPLED_RULES)
@pytest.mark.parametrize("mode", ["lookup", "lookup+costs", "lookup+model", "lookup+adaptive", "lookup+priced"])
def test_law_of_the_first_tokens_is_the_targets(mode, rule, monkeypatch):
    """Chi-square of the joint law of the first 3 tokens (6**3 outcomes) against the exact target law, for two
    prompts in one batch: one whose last 2-gram occurred before (lookup proposes [1, 1] at the first step, each
    token with target probability about 1/2), one with no match at the first step (a model draft, or a plain
    target step without a draft model); later steps look up in some rows and not in others. The same test on
    engines that verify lookup rows against a smoothed law, or against the model's rows of a mixed step, fails.
    "lookup+adaptive": the model rows' lengths come from AdaptiveLength, which learns from earlier steps;
    "lookup+priced": as lookup+adaptive, and the lookup rows' lengths come from costs and the model's expected rate
    (a proposal must beat it: some steps it does not);
    "lookup+costs": the lookup rows' lengths come from step costs and how their earlier matches compared with what
    the target committed (one token at the prior odds, none after a first token that differed: ``replay`` checks
    every step)."""
    vocab, length, samples = 6, 3, 3000
    target = tiny_model(vocab=vocab, sharpness=5.0)
    draft = perturbed(target, scale=0.6, seed=1) if mode != "lookup" and mode != "lookup+costs" else None
    prompts = [[1, 3, 1, 1, 3], [1, 2, 3]]
    laws = [exact_law_of_first_tokens(target, p, length) for p in prompts]
    policy = None
    if mode in ("lookup+adaptive", "lookup+priced"):  # latency under which the prior's K is 1 and what the steps
        # teach moves it
        policy = AdaptiveLength(profile([100, 150, 200, 250, 300], draft_ms=10), max_draft=4, prior=0.8, memory=0.5)
    first_k = policy.best_length(2 * samples) if policy else 2
    costs = {"lookup+costs": table(10, 12.5, 21), "lookup+priced": table(100, 118, 190, 240, 290)}.get(mode)
    lookup = PromptLookup(costs=costs)
    decoder = SpeculativeDecoder(target, draft, rule=rule, max_draft=2, policy=policy, lookup=lookup)
    priced = []  # per lookup choice: whether the model's expected rate changed it
    choose = PromptLookup.length

    def spy(self, first, then, available, rows, alone=None):
        chosen = choose(self, first, then, available, rows, alone)
        priced.append(chosen != choose(self, first, then, available, rows))
        return chosen

    monkeypatch.setattr(PromptLookup, "length", spy)

    def tests():
        result = decoder.generate(
            [p for p in prompts for _ in range(samples)], max_new_tokens=length, seed=0, stop_on_eos=False
        )
        out = []
        for g, law in enumerate(laws):
            rows = result.sequences[g * samples : (g + 1) * samples]
            out.append(lawkit.chi_square(lawkit.joint_counts(rows, vocab), law))
        return out, result

    passed, result = tests()
    assert all(test.passed for test in passed), f"{mode}, {rule}: {passed}"
    first = result.stats[0]  # lookup in the first prompt's rows, not in the second's, in one step
    assert first.lookup == [True] * samples + [False] * samples
    assert set(first.verified[samples:]) == ({first_k} if draft is not None else {0})
    if mode == "lookup+adaptive" and policy is not None:
        assert 0 < first_k < 4 and policy.best_length(2 * samples) != first_k  # it learnt from the model rows
    used = lookup_steps(result)
    assert any(a == k for k, a in used) and any(a < k for k, a in used)
    if mode == "lookup+priced":  # the model's rate kept the second step's matches from proposing, not the first's
        assert any(priced) and not all(priced)
    else:  # lookup after the first step too; nothing priced without costs and a policy that prices its steps
        assert len(used) > samples and not any(priced)
    if mode == "lookup+costs":
        assert set(first.verified[:samples]) == {1}
        replay(result, [p for p in prompts for _ in range(samples)], lookup, length, None)

    controls = [smoothed] + ([model_rows_kept] if draft is not None else [])
    for control in controls:
        monkeypatch.setattr(proposer_module, "with_proposals", control(proposer_module.with_proposals, vocab))
        broken, _ = tests()
        assert not all(test.passed for test in broken), f"negative control {control.__name__} passed: {broken}"
        monkeypatch.undo()


def replay(result, prompts, settings: PromptLookup, max_new_tokens: int, model_len: int | None):
    """Replays, prompt by prompt, what the engine should have proposed at every step from the documented rules
    (each prompt's own counts per match-length class, every match counted at the prompt's next step against the
    tokens committed since, the length of most tokens per second) and checks each row step's lookup flag and
    verified length against it."""
    counts = [{} for _ in prompts]  # prompt -> class -> [first agreed, first compared, later agreed, later compared]
    pending = {}  # prompt -> (class, match, tokens generated when it was found)
    generated = [0] * len(prompts)
    for step in result.stats:
        for b, i in enumerate(step.rows):
            if i in pending:
                cls, match, then = pending.pop(i)
                committed = result.sequences[i][then : generated[i]]
                compared = min(len(match), len(committed))
                agreed = next((j for j in range(compared) if match[j] != committed[j]), compared)
                record = counts[i][cls]
                if compared:
                    record[0] += agreed > 0
                    record[1] += 1
                    if agreed > 0:
                        record[2] += agreed - 1
                        record[3] += agreed - 1 + (agreed < compared)
            context = prompts[i] + result.sequences[i][: generated[i]]
            limit = max_new_tokens - generated[i] - 1
            n, match = settings.match(context, min(settings.max_draft, limit))
            proposal = []
            if match:
                cls = max(c for c in (1, 2, 3, 4, 5, 9) if c <= n)
                pending[i] = (cls, match, generated[i])
                weight = settings.prior_weight
                first_hits, first_tries, then_hits, then_tries = counts[i].setdefault(
                    cls, [(0.9 if cls == 9 else 1 / 3) * weight, weight, cls / (cls + 1) * weight, weight]
                )
                rows = len(step.rows)
                cost = (lambda w: 1.0) if settings.costs is None else (lambda w, rows=rows: settings.costs(rows, w))
                k = best_rate_length(first_hits / first_tries, then_hits / then_tries, len(match), cost)
                proposal = match[:k]
            assert step.lookup[b] == bool(proposal), (i, context)
            if proposal:
                assert step.verified[b] == len(proposal)
            else:
                assert step.verified[b] == (min(model_len, limit) if model_len else 0)
            generated[i] += step.emitted[b]
    assert generated == [len(s) for s in result.sequences]


@pytest.mark.parametrize("sampling", [SamplingParams(), GREEDY], ids=["T=1", "T=0"])
@pytest.mark.parametrize("mode", ["lookup", "lookup+model"])
def test_each_prompt_keeps_its_own_odds_while_rows_finish(pair, mode, sampling):
    """Rows of different lengths, with and without matches, some ending at an EOS mid-way (so batch rows and
    prompts stop lining up), others at max_new_tokens; step costs under which the lengths follow the match lengths
    and what each prompt's proposals met (sampled, the tiny target rejects them; greedy, it accepts some)."""
    target, draft = pair
    plain = [reference_greedy(target, p, 40, eos=None) for p in PROMPTS]
    eos = plain[1][9]
    costs = LatencyTable((1, 10), tuple(range(1, 8)), ((10, 11, 12, 13, 14, 15, 16), (10, 12, 14, 16, 18, 20, 22)))
    settings = PromptLookup(max_draft=6, costs=costs)
    decoder = SpeculativeDecoder(
        target, draft if mode == "lookup+model" else None, rule="block", max_draft=3, lookup=settings
    )
    decoder.target.eos_token_ids = (eos,)
    result = decoder.generate(PROMPTS * 2, max_new_tokens=40, sampling=sampling, seed=0)
    assert "eos" in result.finish_reasons and "length" in result.finish_reasons
    assert len(result.stats[-1].rows) < len(PROMPTS) * 2
    assert len({k for k, _ in lookup_steps(result)}) >= 3  # the lengths moved
    if sampling.greedy:
        assert any(a > 0 for _, a in lookup_steps(result))
    replay(result, PROMPTS * 2, settings, 40, 3 if mode == "lookup+model" else None)
    again = decoder.generate(PROMPTS * 2, max_new_tokens=40, sampling=sampling, seed=0)  # fresh odds per call
    assert [s.verified for s in again.stats] == [s.verified for s in result.stats]


def test_the_draft_catches_up_on_tokens_committed_by_lookup_steps(pair):
    """The target's own weights as the draft: every model draft must be accepted in full, which holds only if the
    draft's cache read the tokens that lookup steps committed while it skipped them."""
    target, _ = pair
    decoder = SpeculativeDecoder(target, HFModel(target), rule="block", max_draft=3, lookup=PromptLookup(max_draft=1))
    result = decoder.generate(PROMPTS, max_new_tokens=30, sampling=GREEDY, stop_on_eos=False)
    assert result.sequences == [reference_greedy(target, p, 30, eos=None) for p in PROMPTS]
    looked_up, caught_up = set(), False
    for step in result.stats:
        for i, used, drafted, accepted in zip(step.rows, step.lookup, step.verified, step.accepted):
            if used:
                looked_up.add(i)
            elif drafted:
                assert accepted == drafted, f"prompt {i}: a model draft was rejected"
                caught_up |= i in looked_up
    assert caught_up  # some prompt drafted with the model after a lookup step


def test_a_row_does_not_depend_on_its_neighbours_and_proposals_outrun_the_models_width(pair):
    """Sampled lookup+model decoding: each row's tokens alone equal its tokens batched (float32); proposals up to
    max_draft are verified with the uniforms drawn for the widest step; a lookup row's expected accepted length is
    the same under both rules (one-hot draft), a sign it reached the verifier as an exact one-hot row."""
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, rule="block", max_draft=2, lookup=PromptLookup(max_draft=8))
    assert decoder.max_draft == 8
    seeds = [11, 12, 13, 14, 15]
    scores = ExpectedScores()
    together = decoder.generate(PROMPTS, max_new_tokens=30, seed=seeds, on_step=scores)
    assert max(k for k, _ in lookup_steps(together)) > 2
    for b, prompt in enumerate(PROMPTS):
        assert decoder.generate([prompt], max_new_tokens=30, seed=[seeds[b]]).sequences[0] == together.sequences[b]
    # Given a one-hot block, P(tau >= i) is prod_{j <= i} target(x_j) under both rules (for a sampled draft, block
    # verification wins only on average over blocks); a smoothed row would break the equality.
    lookup = [u for s in together.stats for u in s.lookup]
    pairs = zip(lookup, scores.expected["token"], scores.expected["block"], strict=True)
    expected = [(t, b) for u, t, b in pairs if u]
    assert any(k > 1 for k, _ in lookup_steps(together))  # (one drafted token: the two rules coincide anyway)
    assert expected and all(b == pytest.approx(t, rel=1e-4, abs=1e-7) for t, b in expected)
    assert 0 < together.lookup_rate < 1


def test_a_proposal_must_beat_the_model_draft_it_replaces(pair):
    """Beside AdaptiveLength, k = 0 is worth the model's expected rate: a one-token match at the prior odds (at most
    2 tokens a step in 10 ms) no longer pays against a 4-token draft at acceptance 0.8 (3.36 tokens in 14 ms),
    while a long match still does. A policy that prices nothing leaves lookup comparing with a plain step."""
    target, _ = pair
    prompts = [[5, 6, 7, 5], [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3]]  # a match of 1 token, one of 9
    assert [PromptLookup().match(p, 8)[0] for p in prompts] == [1, 9]
    flat = PromptLookup(costs=table(*[10] * 34))  # every width costs 10 ms, as the profile's target
    first_steps = {}
    for name, policy in (
        ("priced", AdaptiveLength(profile([10] * 9, draft_ms=1), max_draft=4, prior=0.8)),
        ("fixed", None),
    ):
        decoder = SpeculativeDecoder(target, HFModel(target), max_draft=4, policy=policy, lookup=flat)
        result = decoder.generate(prompts, max_new_tokens=12, sampling=GREEDY, stop_on_eos=False)
        assert result.sequences == [reference_greedy(target, p, 12, eos=None) for p in prompts]
        first_steps[name] = (result.stats[0].lookup, result.stats[0].verified)
    assert first_steps["priced"] == ([False, True], [4, 6])  # the model drafts 4 where the short match cannot pay
    assert first_steps["fixed"] == ([True, True], [3, 6])  # against a plain step, the short match proposes all


class Observed(FixedLength):
    """Records what each step's ``observe`` is handed."""

    def __init__(self, max_draft: int):
        super().__init__(max_draft)
        self.seen: list[list[int]] = []

    def observe(self, rows, draft_tokens, draft_probs, target_probs, verified, accepted) -> None:
        self.seen.append(verified.tolist())


def test_the_policy_observes_the_model_rows_only(pair):
    """A length policy models its draft model: lookup rows reach its ``observe`` as verifying nothing."""
    target, draft = pair
    policy = Observed(2)
    result = SpeculativeDecoder(target, draft, policy=policy, lookup=PromptLookup()).generate(
        PROMPTS, max_new_tokens=20, seed=0
    )
    assert any(any(s.lookup) and not all(s.lookup) for s in result.stats)  # mixed steps happened
    assert policy.seen == [[0 if used else k for used, k in zip(s.lookup, s.verified)] for s in result.stats]


def test_without_lookup_nothing_is_recorded(pair):
    result = SpeculativeDecoder(*pair, max_draft=2).generate(PROMPTS[:2], max_new_tokens=5, seed=0)
    assert all(s.lookup is None for s in result.stats)
    assert result.lookup_rate != result.lookup_rate  # nan


def test_bad_decoder_arguments_get_clear_errors(pair):
    target, draft = pair
    sv = SVPolicy.__new__(SVPolicy)  # refused for its type: its settings do not matter
    sv.kind, sv.max_draft = "draft", 4
    with pytest.raises(ValueError, match="FixedLength and its subclasses .AdaptiveLength., not with SVPolicy"):
        SpeculativeDecoder(target, draft, policy=sv, lookup=PromptLookup())
    with pytest.raises(ValueError, match="FixedLength and its subclasses .AdaptiveLength., not with sv"):
        SpeculativeDecoder(target, draft, policy="sv", lookup=PromptLookup())
    with pytest.raises(TypeError, match="lacks some of the hooks of blockspec.policy.LengthPolicy"):
        SpeculativeDecoder(target, draft, policy=object())
    assert SpeculativeDecoder(target, draft, policy=FixedLength(3), lookup=PromptLookup()).max_draft == LOOKUP_MAX_DRAFT
    with pytest.raises(ValueError, match="a length policy needs a draft model"):
        SpeculativeDecoder(target, None, policy=FixedLength(3), lookup=PromptLookup())
    with pytest.raises(TypeError, match="lookup must be a PromptLookup"):
        SpeculativeDecoder(target, draft, lookup={"max_ngram": 3})
    with pytest.raises(ValueError, match="max_draft must be an int >= 1"):
        SpeculativeDecoder(target, draft, lookup=PromptLookup(max_draft=0))
    with pytest.raises(ValueError, match="is not below the target's context"):
        SpeculativeDecoder(target, None, lookup=PromptLookup(max_draft=256))


def test_a_step_is_priced_at_the_catch_up_of_the_rows_that_may_draft():
    """A row that may not draft (a lookup row, or one whose prompt filled the draft's context: its draft row is empty)
    is left out of the catch-up the length policy prices the step at; with no row left, the catch-up is 1."""
    contexts = [[5, 6, 7, 8], [5] * 9]
    assert behind(contexts, [3, 0], [2, 0]) == 1
    assert behind(contexts, [3, 0], [2, 1]) == 9
    assert behind(contexts, [3, 0], [0, 0]) == 1
