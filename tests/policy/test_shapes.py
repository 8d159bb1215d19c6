"""The tree-or-chain prediction (``blockspec.policy.shapes``): expected accepted tokens and step costs by hand, the
same numbers as benchmarks/tree_plan.py, the choice on hand-made costs, and alpha_k learnt exactly (alpha_1) or
without bias (alpha_k, from candidates drawn by the estimator's own generator)."""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import pytest
import torch
from kits.svkit import AVX2_LLAMACPP, profile

from blockspec.policy import AdaptiveShape, LatencyTable
from blockspec.policy.latency import LatencyProfile
from blockspec.policy.shapes import (
    WIDTHS,
    best_shape,
    candidate_acceptance,
    expected_accepted,
    ranked_acceptance,
    star_acceptance,
    step_cost,
    tree_nodes,
    tree_shapes,
)
from blockspec.verify.tree import expected_accepted_tree

ALPHA = torch.tensor([0.6, 0.8, 0.9, 0.95], dtype=torch.float64)  # alpha_1..alpha_4, the same at every position


def target_ms(n: int) -> float:
    return 10.0 + 2.0 * n


def draft_ms(n: int) -> float:
    return 3.0 + n


# (shape, E by hand, step cost by hand: the target over N + 1 tokens, the draft over 1, then each level's parents)
BY_HAND = [
    ((1, 1), 0.6 + 0.6 * 0.6, target_ms(3) + draft_ms(1) + draft_ms(1)),
    ((2, 1), 0.8 + 0.8 * 0.6, target_ms(5) + draft_ms(1) + draft_ms(2)),
    ((3,), 0.9, target_ms(4) + draft_ms(1)),
    ((2, 2, 1), 0.8 + 0.8**2 + 0.8**2 * 0.6, target_ms(11) + draft_ms(1) + draft_ms(2) + draft_ms(4)),
]


def tree_plan():
    """benchmarks/tree_plan.py as a module (the benchmarks are scripts, not a package)."""
    path = Path(__file__).parents[2] / "benchmarks" / "tree_plan.py"
    spec = importlib.util.spec_from_file_location("tree_plan", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_expected_accepted_tokens_and_step_costs_are_the_hand_computed_ones():
    for shape, accepted, cost in BY_HAND:
        assert float(expected_accepted(ALPHA.expand(len(shape), -1), shape)) == pytest.approx(accepted)
        assert step_cost(shape, target_ms, draft_ms) == pytest.approx(cost)
    assert float(expected_accepted(ALPHA.expand(0, -1), ())) == 0 and step_cost((), target_ms, draft_ms) == target_ms(1)
    # alpha per position: a step of (2, 1) from position t reads alpha_2 at t, alpha_1 at t + 1
    rows = torch.tensor([[0.5, 0.7, 0.8, 0.9], [0.4, 0.6, 0.7, 0.8]], dtype=torch.float64)
    assert float(expected_accepted(rows, (2, 1))) == pytest.approx(0.7 + 0.7 * 0.4)
    # the draft catches up on 2 tokens after a whole path was accepted
    assert step_cost((2, 1), target_ms, draft_ms, catch_up=2) == pytest.approx(BY_HAND[1][2] + 1)


def test_the_prediction_is_tree_plans_on_a_hand_made_case():
    """tree_plan.predict over sequences of constant alpha gives BE = 1 + E and speed = BE * t_T(1) / cost (without
    its overhead): the library's numbers, which the engine's choice compares."""
    plan = tree_plan()
    shapes = [shape for shape, _, _ in BY_HAND]
    sequences = [{"alpha": ALPHA.expand(20, -1).tolist()} for _ in range(3)]
    prediction = plan.predict(sequences, shapes, target_ms, draft_ms, dict.fromkeys(shapes, 0.0), resamples=10)
    for row, (shape, accepted, cost) in zip(prediction["shapes"], BY_HAND):
        assert tuple(row["shape"]) == shape and row["nodes"] == tree_nodes(shape)
        assert row["be"] == pytest.approx(1 + accepted, abs=1e-4)
        assert row["forward_ms"] == pytest.approx(cost, abs=0.05)
        assert row["free"]["speedup"] == pytest.approx((1 + accepted) * target_ms(1) / cost, abs=1e-4)
    assert plan.tree_shapes is tree_shapes  # one home: the script imports the library's


def test_candidate_shapes_are_every_chain_and_tree_within_the_node_budget():
    shapes = tree_shapes(4, 4)
    assert {s for s in shapes if max(s) == 1} == {(1,) * n for n in range(1, 5)}
    assert (2, 1) in shapes and (4,) in shapes and (2, 2) not in shapes  # 6 nodes
    assert all(tree_nodes(s) <= 4 and list(s) == sorted(s, reverse=True) and max(s) <= WIDTHS for s in shapes)
    assert AdaptiveShape(profile([100] * 9, draft_ms=5), max_draft=4).shapes == [(), *shapes]


STEEP_TREES = profile([100 + 30 * n for n in range(9)], draft_ms=5)  # every scored token costs, drafting is cheap
DEAR_DRAFT = profile([100 + n for n in range(9)], draft_ms=60)  # width almost free, every draft forward dear


@pytest.mark.parametrize(
    "latency, alpha, is_tree",
    [
        (STEEP_TREES, (0.8, 0.9, 0.93, 0.95), False),
        (DEAR_DRAFT, (0.97, 0.98, 0.99, 0.99), False),  # a draft nearly always accepted: width adds little
        (DEAR_DRAFT, (0.3, 0.9, 0.95, 0.98), True),  # one wide level beats a deep chain
    ],
)
def test_the_choice_is_a_tree_only_where_it_beats_every_chain(latency, alpha, is_tree):
    policy = AdaptiveShape(latency, max_draft=8, prior=alpha)
    shape = policy.choose(1)
    assert shape and (max(shape) > 1) == is_tree, shape

    def goodput(s: tuple[int, ...]) -> float:  # drafted step after step: 2 tokens to read after a whole path accepted
        whole = math.prod(policy.alpha[k - 1] for k in s)
        forwards = [step_cost(s, lambda n: latency.target(1, n), lambda n: latency.draft(1, n), c) for c in (1, 2)]
        return (1 + float(expected_accepted(policy.alpha.expand(len(s), -1), s))) / (
            (1 - whole) * forwards[0] + whole * forwards[1]
        )

    assert goodput(shape) == pytest.approx(max(map(goodput, policy.shapes)), rel=1e-12)


def test_on_a_tie_the_chain_stays():
    alpha = torch.tensor([0.5, 0.5, 0.5, 0.5])  # (2,) accepts no more than (1,) and costs the same here
    assert best_shape(alpha, [(2,), (1,)], lambda n: 1.0, lambda n: 0.1) == (1,)


def test_where_nothing_pays_a_step_drafts_nothing_and_alpha_drifts_to_the_prior():
    hopeless = AdaptiveShape(profile([100 * n for n in range(1, 10)], draft_ms=2), prior=(0.8, 0.9, 0.93, 0.95))
    hopeless.alpha = torch.full((WIDTHS,), 0.1, dtype=torch.float64)
    assert hopeless.choose(1) == ()
    assert hopeless.alpha.tolist() == pytest.approx([0.9 * 0.1 + 0.1 * p for p in (0.8, 0.9, 0.93, 0.95)])


def test_one_rejected_step_does_not_end_drafting():
    """The costs of tests/policy/test_auto.py's test of the same name (llama.cpp, the q4_0 draft, a loaded machine),
    from alpha_1 = 0.8: drafting step after step pays there, a step whose draft first reads 2 tokens does not. Priced
    at its own catch-up (2 after a plain step), the policy never drafted again in a call once rejected drafts had made
    it decode alone, since the drift back to the prior never passes it; priced as drafting goes on, it drafts again."""
    seconds = (0.0963, 0.1539, 0.2071, 0.1659, 0.2203, 0.2749, 0.3297, 0.3251, 0.3659)
    costs = LatencyProfile(
        LatencyTable((1,), tuple(range(1, 10)), (seconds,)),
        LatencyTable((1,), (1, 2, 4), ((0.0329, 0.0538, 0.0479),)),
        None,
        meta={},
    )
    policy = AdaptiveShape(costs, max_draft=8, prior=(0.8, 0.86, 0.87, 0.88), memory=0.9)
    assert policy.choose(1)
    policy.alpha = policy.alpha * 0.8  # a step whose drafts were rejected
    idle = 0
    while not policy.choose(1):
        idle += 1
        assert idle < 30, policy.alpha
    assert idle > 0


def test_a_draft_that_pays_by_a_hair_is_not_drafted_with_once_it_is_behind():
    """The bundled pair's costs on llama.cpp's AVX2 kernels: at the prior a one-token chain pays by 0.2 % step after
    step; with 20 tokens to read first, the shape policy takes a plain step, as the chain policy does
    (tests/policy/test_auto.py); blind to the catch-up, it drafts the chain."""
    costs = AVX2_LLAMACPP
    policy = AdaptiveShape(costs, max_draft=8, prior=(0.85, 0.86, 0.87, 0.88))
    assert policy.choose(1, catch_up=1) == policy.choose(1, catch_up=2) == (1,)
    assert policy.choose(1, catch_up=21) == ()
    assert AdaptiveShape(costs, max_draft=8, prior=(0.85, 0.86, 0.87, 0.88), horizon=math.inf).choose(1, 21) == (1,)


def accepted_given(target: torch.Tensor, draft: torch.Tensor, candidates: tuple[int, ...]) -> float:
    """The chance that recursive rejection sampling accepts one of ``candidates`` (distinct children drawn from
    ``draft`` in this order; docs/algorithms.md, token-level tree verification), one candidate at a time."""
    p, q, rejected = target.clone(), draft.clone(), 1.0
    accepted = 0.0
    for c in candidates:
        chance = min(1.0, float(p[c] / q[c])) if q[c] > 0 else 0.0
        accepted += rejected * chance
        rejected *= 1 - chance
        p = (p - q).clamp(min=0)
        p = p / p.sum() if p.sum() > 0 else p
        q[c] = 0
        q = q / q.sum() if q.sum() > 0 else q
    return accepted


def star_alpha(target: torch.Tensor, draft: torch.Tensor, k: int) -> float:
    """alpha_k by enumeration: every ordered set of k candidates drawn from ``draft`` without replacement, each
    verified by recursive rejection sampling."""
    total = 0.0
    for candidates in itertools.permutations(range(len(draft)), k):
        drawn, left = 1.0, draft.clone()
        for c in candidates:
            drawn *= float(left[c] / left.sum())
            left[c] = 0
        if drawn:
            total += drawn * accepted_given(target, draft, candidates)
    return total


def test_star_acceptance_is_exact_given_the_candidates():
    """Every ordered set of 4 candidates at V = 6, against the rule one candidate at a time and against the tree
    verifier's own exact acceptance on that one-level tree; a draft with fewer than 4 tokens in its support too."""
    generator = torch.Generator().manual_seed(5)
    target = torch.rand(3, 6, generator=generator, dtype=torch.float64) ** 3
    draft = torch.rand(3, 6, generator=generator, dtype=torch.float64) ** 3
    draft[2, 3:] = 0  # three tokens: a fourth candidate is never accepted
    target, draft = target / target.sum(-1, keepdim=True), draft / draft.sum(-1, keepdim=True)
    sets = torch.tensor(list(itertools.permutations(range(6), WIDTHS)))  # [R, 4]
    got = star_acceptance(target, draft, sets.expand(3, -1, -1))  # [3, R, 4]
    rows = len(sets)
    for t in range(3):
        for r, candidates in enumerate(sets.tolist()):
            drawable = [c for c in candidates if draft[t, c] > 0]
            for k in range(1, WIDTHS + 1):
                want = accepted_given(target[t], draft[t], tuple(candidates[:k]))
                assert float(got[t, r, k - 1]) == pytest.approx(want, abs=1e-12)
            if len(drawable) == WIDTHS:  # the verifier takes candidates from the draft's support only
                tokens = torch.tensor([candidates])
                num = torch.tensor([WIDTHS])
                laws = [x[t].expand(1, WIDTHS + 1, -1) for x in (draft, target)]
                exact = expected_accepted_tree(
                    tokens, torch.zeros_like(tokens), *laws, rule="token", scheme="distinct", num_nodes=num
                )
                assert float(got[t, r, -1]) == pytest.approx(float(exact), abs=1e-12)
    assert rows == 360 and bool((got[..., -1] > got[..., 0] + 0.05).any())  # more candidates can accept more


def test_alpha_1_is_exact_and_alpha_k_unbiased_from_drawn_candidates():
    generator = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0], [0.1, 0.2, 0.3, 0.4, 0.0]], dtype=torch.float64)
    draft = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15], [0.4, 0.3, 0.1, 0.1, 0.1]], dtype=torch.float64)
    alpha, left = candidate_acceptance(target, draft, draws=20000, rest=0.0, generator=generator)
    assert torch.equal(left, torch.zeros_like(left))
    for t in range(2):
        assert float(alpha[t, 0]) == pytest.approx(float(torch.minimum(target[t], draft[t]).sum()), abs=1e-12)
        for k in range(2, WIDTHS + 1):  # the mean of 20000 draws of a quantity in [0, 1]: standard error < 0.004
            assert float(alpha[t, k - 1]) == pytest.approx(star_alpha(target[t], draft[t], k), abs=0.015)
    assert bool((alpha[:, 1:] > alpha[:, :1] + 0.05).all())  # more candidates, more accepted: the test can tell


def test_a_capped_support_keeps_alpha_1_exact_and_says_what_it_left_out():
    """The online estimate's top-k support: the most likely tokens under P + Q, the rest reported as left out."""
    target = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]], dtype=torch.float64)
    draft = torch.tensor([[0.1, 0.2, 0.3, 0.25, 0.15]], dtype=torch.float64)
    whole, _ = candidate_acceptance(target, draft, draws=4, rest=0.0, generator=torch.Generator().manual_seed(0))
    capped, left = candidate_acceptance(
        target, draft, draws=4, rest=0.0, generator=torch.Generator().manual_seed(0), support=3
    )
    assert float(capped[0, 0]) == pytest.approx(float(torch.minimum(target, draft).sum()), abs=1e-12)
    assert left[0].tolist() == pytest.approx([0.05, 0.4])  # tokens 3 and 4 (P + Q 0.30 and 0.15) left out
    full, _ = candidate_acceptance(
        target, draft, draws=4, rest=0.0, generator=torch.Generator().manual_seed(0), support=5
    )
    assert torch.equal(full, whole)  # a cap of the whole vocabulary changes nothing


def test_greedy_alpha_k_says_whether_the_targets_best_token_is_among_the_drafts_k_best():
    target = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0]])
    draft = torch.tensor([[0.4, 0.1, 0.3, 0.15, 0.05]])  # token 1 ranks fourth
    assert ranked_acceptance(target, draft).tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_alpha_follows_the_roots_observed_with_its_memory_from_the_prior():
    policy = AdaptiveShape(profile([100] * 9, draft_ms=5), prior=(0.5, 0.6, 0.7, 0.8), memory=0.75)
    same = torch.tensor([[0.25, 0.25, 0.5, 0.0]])
    policy.observe(same, same, greedy=False)  # the draft is the target: every alpha_k is 1
    assert policy.alpha.tolist() == pytest.approx([0.75 * a + 0.25 for a in (0.5, 0.6, 0.7, 0.8)])
    policy.observe(torch.zeros(0, 4), torch.zeros(0, 4), greedy=False)  # no root verified: nothing learnt
    assert policy.alpha.tolist() == pytest.approx([0.75 * a + 0.25 for a in (0.5, 0.6, 0.7, 0.8)])
    policy.reset()
    assert policy.alpha.tolist() == [0.5, 0.6, 0.7, 0.8]


def test_the_estimate_is_the_same_for_the_same_seed_and_leaves_the_global_generator_alone():
    target = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3)
    draft = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 3)
    learnt = []
    for _ in range(2):
        policy = AdaptiveShape(profile([100] * 9, draft_ms=5), draws=1, seed=3)
        state = torch.get_rng_state()
        policy.observe(target, draft, greedy=False)
        assert torch.equal(torch.get_rng_state(), state)
        learnt.append(policy.alpha)
    assert torch.equal(*learnt)


def test_the_policy_refuses_what_it_cannot_learn_from():
    latency = LatencyProfile(LatencyTable((1,), (1,), ((1.0,),)), LatencyTable((1,), (1,), ((0.1,),)), None, meta={})
    for kwargs in ({"max_draft": 0}, {"memory": 1.0}, {"draws": 0}, {"prior": (0.5, 0.6)}, {"prior": (0, 1, 1, 1)}):
        with pytest.raises(ValueError):
            AdaptiveShape(latency, **kwargs)
