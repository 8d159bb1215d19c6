"""Exact-law tests: enumerate every drafted block on tiny context-dependent models, integrate over the verifier's
randomness through its closed forms, and compare the law of the emitted tokens with the target's own law.

The library's closed forms (accepted_length_law, final_distributions) are what the real verifiers sample from;
they are checked here against a plain, loop-by-loop reference of docs/algorithms.md, and that reference, with one
deliberate mistake each, shows the three plausible-but-wrong block rules are NOT lossless on the same harness.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kits import lawkit

from blockspec.verify import SAMPLED_RULES, accepted_length_law, expected_accepted, final_distributions

# Every V in {2, 3, 4} with K in {1, 2, 3}, and K = 4 for V = 2.
CASES = [(v, k) for v in (2, 3, 4) for k in (1, 2, 3)] + [(2, 4)]
CASE_IDS = [f"V{v}K{k}" for v, k in CASES]
SEEDS = (0, 1)
LOSSLESS = 1e-12

pytest_plugins = ["pytester"]  # test_a_registered_rule_joins_the_law_check runs the law check in a session of its own


REFERENCE_RULES = ("token", "block")  # the rules ``reference_step`` transcribes


def library_step(rule: str) -> lawkit.StepLaw:
    def step(draft_tokens, draft_probs, target_probs):
        return (
            accepted_length_law(draft_tokens, draft_probs, target_probs, rule),
            final_distributions(draft_tokens, draft_probs, target_probs, rule),
        )

    return step


def reference_step(
    rule: str, *, stop_at_first_failure=False, unscaled_residual=False, cap_at_end=False
) -> lawkit.StepLaw:
    """docs/algorithms.md transcribed one block and one scalar at a time, with switches for the three known mistakes."""

    def one_block(x: list[int], draft: torch.Tensor, target: torch.Tensor):
        width, vocab = len(x), target.shape[-1]
        ratios = [float(target[i][x[i]] / draft[i][x[i]]) for i in range(width)]
        if rule == "token":
            accept = [min(1.0, r) for r in ratios]
            survival = [1.0] + list(itertools.accumulate(accept, lambda a, b: a * b))
            tau_law = [survival[i] - (survival[i + 1] if i < width else 0.0) for i in range(width + 1)]
            weights = [1.0] * (width + 1)
        else:
            weights, product = [1.0], 1.0
            for r in ratios:
                product *= r
                # Mistake 3 caps the cumulative product only at the end instead of at every step.
                weights.append(min(1.0, product) if cap_at_end else min(1.0, weights[-1] * r))
            h = [1.0]  # h[0] stands for "tau >= 0", which always holds
            for i in range(1, width):
                z = sum(max(weights[i] * float(target[i][v]) - float(draft[i][v]), 0.0) for v in range(vocab))
                denominator = z + 1.0 - weights[i]
                h.append(z / denominator if denominator > 0 else 1.0)
            h.append(weights[width])
            h.append(0.0)  # position K + 1 does not exist
            if stop_at_first_failure:  # mistake 1: tau = the first i whose test fails, minus one
                tau_law = [prod_(h[1 : i + 1]) * (1.0 - h[i + 1]) for i in range(width + 1)]
            else:  # tau = the LAST i with u_i < h_i
                tau_law = [h[i] * prod_(1.0 - hj for hj in h[i + 1 : width + 1]) for i in range(width + 1)]
        final = []
        for i in range(width + 1):
            if i == width:
                final.append(target[i])
                continue
            scale = 1.0 if unscaled_residual else weights[i]  # mistake 2: max(target - draft, 0) at tau
            residual = (scale * target[i] - draft[i]).clamp(min=0.0)
            final.append(residual / residual.sum() if residual.sum() > 0 else target[i])
        return torch.tensor(tau_law, dtype=torch.float64), torch.stack(final)

    def step(draft_tokens, draft_probs, target_probs):
        laws, finals = zip(*(one_block(x, d, t) for x, d, t in zip(draft_tokens.tolist(), draft_probs, target_probs)))
        return torch.stack(laws), torch.stack(finals)

    return step


def prod_(values) -> float:
    result = 1.0
    for v in values:
        result *= v
    return result


def law_error(tables: lawkit.Tables, width: int, step: lawkit.StepLaw) -> float:
    return lawkit.max_abs_error(lawkit.speculative_law(tables, width, step), lawkit.target_law(tables, width + 1))


@pytest.mark.parametrize(("vocab", "width"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize(("seed", "zeros"), [(0, True), (1, True), (2, False)])
def test_rule_reproduces_the_target_joint_law(sampled_rule, vocab, width, seed, zeros):
    tables = lawkit.random_tables(vocab, width, seed=100 * vocab + 10 * width + seed, zeros=zeros)
    error = law_error(tables, width, library_step(sampled_rule))
    assert error < LOSSLESS, f"{sampled_rule} V={vocab} K={width}: joint-law error {error:.2e}"


@pytest.mark.parametrize("rule", REFERENCE_RULES)
@pytest.mark.parametrize(("vocab", "width"), [(3, 3), (4, 2), (2, 4)])
def test_library_closed_forms_match_the_reference(rule, vocab, width):
    tables = lawkit.random_tables(vocab, width, seed=7)
    blocks = lawkit.all_blocks(vocab, width)
    draft_probs, target_probs = tables.block_inputs(blocks)
    possible = draft_probs.gather(-1, blocks[..., None]).squeeze(-1).prod(-1) > 0
    blocks, draft_probs, target_probs = blocks[possible], draft_probs[possible], target_probs[possible]
    tau_law, final = library_step(rule)(blocks, draft_probs, target_probs)
    ref_tau_law, ref_final = reference_step(rule)(blocks, draft_probs, target_probs)
    assert lawkit.max_abs_error(tau_law, ref_tau_law) < LOSSLESS
    reached = ref_tau_law > 0  # the emitted token's law only matters where tau can land
    assert lawkit.max_abs_error(final[reached], ref_final[reached]) < LOSSLESS


def test_reference_is_lossless_too():
    """The reference without mistakes passes the harness, so the failures below are the mistakes' own."""
    tables = lawkit.random_tables(3, 3, seed=11)
    for rule in REFERENCE_RULES:
        assert law_error(tables, 3, reference_step(rule)) < LOSSLESS


def test_rule_with_its_residual_ignored_is_not_lossless(sampled_rule):
    """The negative control every registered rule gets: its own law of tau, but the token after a rejection drawn
    from the target instead of the rule's residual. The harness must see the difference."""

    def step(draft_tokens, draft_probs, target_probs):
        return accepted_length_law(draft_tokens, draft_probs, target_probs, sampled_rule), target_probs

    errors = [law_error(lawkit.random_tables(3, 2, seed=seed), 2, step) for seed in range(4)]
    assert max(errors) > 1e-4, f"{sampled_rule} with the target in place of its residual: law errors {errors}"


def test_a_registered_rule_joins_the_law_check(pytester, monkeypatch):
    """The harness reads the registry: a rule registered in ``RULES`` is collected by the law check with no test
    edited, and fails it when it is not lossless, while the real rules pass. The rule registered here is block
    verification with the token rule's residual (the unscaled-residual mistake), lossy on every V4K3 table below."""
    from kits.broken import verify_block_unscaled_residual

    from blockspec.verify import rules
    from blockspec.verify.block import block_gains, block_survival
    from blockspec.verify.token import token_final_log_weight

    broken = rules.Rule(
        "unscaled_residual", verify_block_unscaled_residual, True, block_survival, token_final_log_weight, block_gains
    )
    monkeypatch.setitem(rules.RULES, broken.name, broken)
    monkeypatch.setattr(rules, "SAMPLED_RULES", (*rules.SAMPLED_RULES, broken.name))
    law_check = "test_rule_reproduces_the_target_joint_law and V4K3"
    result = pytester.runpytest_inprocess(__file__, "-p", "no:cacheprovider", "-q", "-k", law_check)
    per_rule = 3  # the seeds of the law check
    result.assert_outcomes(passed=per_rule * (len(rules.SAMPLED_RULES) - 1), failed=per_rule)
    failed = [line for line in result.outlines if line.startswith("FAILED")]
    assert len(failed) == per_rule and all(f"[{broken.name}-" in line for line in failed), failed


MISTAKES = ["stop_at_first_failure", "unscaled_residual", "cap_at_end"]


@pytest.mark.parametrize("mistake", MISTAKES)
@pytest.mark.parametrize(("vocab", "width"), [(3, 2), (3, 3), (4, 2), (4, 3)])
def test_plausible_block_mistakes_are_not_lossless(mistake, vocab, width):
    """Each mistake breaks the law on every V >= 3, K >= 2 case of the grid (on some table: a mistake can be
    exact on a given table, e.g. the unscaled residual on about half the V = 3 tables, see docs/algorithms.md)."""
    errors = []
    for seed in range(4):
        tables = lawkit.random_tables(vocab, width, seed=100 * vocab + 10 * width + seed)
        errors.append(law_error(tables, width, reference_step("block", **{mistake: True})))
    assert max(errors) > 1e-4, f"{mistake} V={vocab} K={width}: law errors {errors} look lossless"


@pytest.mark.parametrize("mistake", MISTAKES)
def test_mistakes_coincide_with_the_rule_when_one_token_is_drafted(mistake):
    """K = 1 cannot tell the mistakes apart from Algorithm 2 (they differ only in how tokens interact)."""
    tables = lawkit.random_tables(4, 1, seed=5)
    assert law_error(tables, 1, reference_step("block", **{mistake: True})) < LOSSLESS


def test_unscaled_residual_is_exactly_lossless_with_two_tokens():
    """Why V >= 3 is needed to catch mistake 2: with V = 2 the residual has one nonzero entry either way."""
    tables = lawkit.random_tables(2, 4, seed=3)
    assert law_error(tables, 4, reference_step("block", unscaled_residual=True)) < LOSSLESS


# --- expected accepted length ------------------------------------------------------------------------------


def draft_weighted_means(tables: lawkit.Tables, width: int, draft_probs_override=None):
    blocks = lawkit.all_blocks(tables.vocab, width)
    draft_probs, target_probs = tables.block_inputs(blocks)
    weight = draft_probs.gather(-1, blocks[..., None]).squeeze(-1).prod(-1)
    blocks, draft_probs, target_probs, weight = (
        blocks[weight > 0],
        draft_probs[weight > 0],
        target_probs[weight > 0],
        weight[weight > 0],
    )
    per_block = {rule: expected_accepted(blocks, draft_probs, target_probs, rule) for rule in SAMPLED_RULES}
    return {rule: float((weight * e).sum()) for rule, e in per_block.items()}, per_block


def test_toy_example_expected_accepted():
    """docs/algorithms.md: V = {a, b}, target (1/3, 2/3), draft (2/3, 1/3), K = 2: 10/9 tokens (token), 11/9 (block)."""
    target = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    draft = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    context_free = lawkit.Tables(
        2, [target.expand(2**L, 2) for L in range(3)], [draft.expand(2**L, 2) for L in range(3)]
    )
    means, _ = draft_weighted_means(context_free, 2)
    assert means["token"] == pytest.approx(10 / 9, abs=1e-15)
    assert means["block"] == pytest.approx(11 / 9, abs=1e-15)


@pytest.mark.parametrize(("vocab", "width"), CASES)
def test_block_is_never_worse_than_token_on_average_over_drafts(vocab, width):
    for seed in SEEDS:
        tables = lawkit.random_tables(vocab, width, seed=100 * vocab + 10 * width + seed)
        means, _ = draft_weighted_means(tables, width)
        assert means["block"] >= means["token"] - 1e-12, f"V={vocab} K={width} seed={seed}: {means}"
        if width == 1:
            assert means["block"] == pytest.approx(means["token"], abs=1e-12)


def test_block_can_be_worse_than_token_for_a_given_draft():
    """The optimality is over drafts, not per drafted block (docs/algorithms.md): such blocks exist and are common."""
    tables = lawkit.random_tables(3, 3, seed=21)
    _, per_block = draft_weighted_means(tables, 3)
    worse = (per_block["block"] < per_block["token"] - 1e-9).float().mean()
    assert 0.05 < worse < 0.95


def test_expected_accepted_is_the_mean_of_the_accepted_length_law(sampled_rule):
    tables = lawkit.random_tables(4, 3, seed=9)
    blocks = lawkit.all_blocks(4, 3)[:40]
    draft_probs, target_probs = tables.block_inputs(blocks)
    keep = draft_probs.gather(-1, blocks[..., None]).squeeze(-1).prod(-1) > 0
    args = (blocks[keep], draft_probs[keep], target_probs[keep])
    law = accepted_length_law(*args, sampled_rule)
    mean = (law * torch.arange(4, dtype=torch.float64)).sum(-1)
    assert lawkit.max_abs_error(mean, expected_accepted(*args, sampled_rule)) < LOSSLESS


@pytest.mark.parametrize("which", ["one-hot target", "one-hot draft"])
def test_token_and_block_coincide_with_a_one_hot_target_or_draft(which):
    tables = lawkit.random_tables(3, 3, seed=4)
    if which == "one-hot target":
        one_hot = [torch.nn.functional.one_hot(t.argmax(-1), 3).double() for t in tables.target]
        tables = lawkit.Tables(3, one_hot, tables.draft)
    else:
        one_hot = [torch.nn.functional.one_hot(d.argmax(-1), 3).double() for d in tables.draft]
        tables = lawkit.Tables(3, tables.target, one_hot)
    blocks = lawkit.all_blocks(3, 3)
    draft_probs, target_probs = tables.block_inputs(blocks)
    keep = draft_probs.gather(-1, blocks[..., None]).squeeze(-1).prod(-1) > 0
    blocks, draft_probs, target_probs = blocks[keep], draft_probs[keep], target_probs[keep]
    if which == "one-hot draft":
        draft_probs = None  # the verifiers' own one-hot path, no [B, K, V] table at all
    token = library_step("token")(blocks, draft_probs, target_probs)
    block = library_step("block")(blocks, draft_probs, target_probs)
    assert lawkit.max_abs_error(token[0], block[0]) < LOSSLESS
    reached = token[0] > 0
    assert lawkit.max_abs_error(token[1][reached], block[1][reached]) < LOSSLESS


def test_one_hot_draft_path_is_lossless(sampled_rule):
    """draft_probs=None (greedy or n-gram drafter) through the harness."""
    tables = lawkit.random_tables(3, 3, seed=8)
    one_hot = [torch.nn.functional.one_hot(d.argmax(-1), 3).double() for d in tables.draft]
    tables = lawkit.Tables(3, tables.target, one_hot)

    def step(x, d, t):
        return library_step(sampled_rule)(x, None, t)

    assert law_error(tables, 3, step) < LOSSLESS


# --- ragged rows ---------------------------------------------------------------------------------------------


def test_ragged_rows_have_the_law_of_each_row_alone(sampled_rule):
    """A row with num_verified = n inside a K-wide batch has the law of that row verified alone with K = n."""
    vocab, width = 3, 4
    tables = lawkit.random_tables(vocab, width, seed=13)
    gen = torch.Generator().manual_seed(0)
    blocks = torch.stack([torch.multinomial(tables.draft[0][0], 1, generator=gen) for _ in range(width)], 1)
    for i in range(1, width):  # draft a real block from the tables so every drafted token has mass
        blocks[:, i] = torch.multinomial(tables.draft_at(blocks[:, :i]), 1, generator=gen).squeeze(1)
    blocks = blocks.expand(width + 1, width).clone()  # the same block, cut at n = 0..K
    num_verified = torch.arange(width + 1)
    draft_probs, target_probs = tables.block_inputs(blocks)
    for b, n in enumerate(num_verified.tolist()):  # padding holds junk the verifier must ignore
        blocks[b, n:] = -1
        draft_probs[b, n:] = 0.0
        target_probs[b, n + 1 :] = 7.0
    law = accepted_length_law(blocks, draft_probs, target_probs, sampled_rule, num_verified)
    final = final_distributions(blocks, draft_probs, target_probs, sampled_rule, num_verified)
    for b, n in enumerate(num_verified.tolist()):
        alone = (blocks[b : b + 1, :n], draft_probs[b : b + 1, :n], target_probs[b : b + 1, : n + 1])
        alone_law = accepted_length_law(*alone, sampled_rule)
        alone_final = final_distributions(*alone, sampled_rule)
        assert lawkit.max_abs_error(law[b, : n + 1], alone_law[0]) < LOSSLESS
        assert float(law[b, n + 1 :].abs().sum()) == 0.0  # tau never exceeds the row's own draft
        assert lawkit.max_abs_error(final[b, : n + 1], alone_final[0]) < LOSSLESS
