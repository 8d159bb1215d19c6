"""Exact-law tests of tree verification: enumerate every tree a drafter can draw for a shape (tests/kits/treekit.py),
integrate over the verifier's randomness through its closed form (``tree_law``), and compare the law of the
emitted tokens with the target's own joint law, to 1e-12 in float64.

Shapes (children per node at each depth): at V = 4 (2), (3), (2, 2), (3, 2), (1, 2), (2, 1, 1), (1, 2, 1); at
V = 3 (2, 2, 1); chains of 2-4 tokens at V = 3 and 4; both drawing schemes; random context-dependent tables
with exact zeros, dense ones, and top-k truncated ones (k from 1 to V per row: distinct siblings run out of
support, so the trees of one shape come out ragged, and one-hot rows exercise the numerical guards).

The library's closed form (one pass in node order) is checked against a literal, one-tree-at-a-time transcription
of the traversal as the algorithm reference describes it (the leaf-first loop that deletes rejected leaves and
recomputes w), and that transcription with one deliberate mistake each shows the plausible-but-wrong variants are
NOT lossless on the same harness.
"""

from __future__ import annotations

import functools

import pytest
import torch
from kits import lawkit, treekit

from blockspec.verify import SAMPLED_RULES
from blockspec.verify.tree import expected_accepted_tree, node_depths, tree_law
from blockspec.verify.tree_inputs import SCHEMES

LOSSLESS = 1e-12
LOSSY = 1e-4  # a mistake must move some probability of the joint law by more than this (10^8 x LOSSLESS)

SHAPES_V4 = [(2,), (3,), (2, 2), (3, 2), (1, 2), (2, 1, 1), (1, 2, 1)]
CHAINS = [(vocab, (1,) * length) for vocab in (3, 4) for length in (2, 3, 4)]
CASES = [(4, shape) for shape in SHAPES_V4] + [(3, (2, 2, 1))] + CHAINS
KINDS = ("zeros", "dense", "topk")


def case_id(case) -> str:
    vocab, shape = case
    return f"V{vocab}-" + "x".join(map(str, shape))


@functools.cache
def tables_for(vocab: int, depth: int, kind: str, seed: int = 0) -> lawkit.Tables:
    """Random context-dependent tables: ~20 % exact zeros, none, or each row cut to its k likeliest tokens."""
    seed = 1000 * KINDS.index(kind) + 10 * vocab + depth + seed
    base = lawkit.random_tables(vocab, depth, seed=seed, zeros=kind == "zeros")
    if kind != "topk":
        return base
    generator = torch.Generator().manual_seed(seed)
    return lawkit.Tables(vocab, [top_k(t, generator) for t in base.target], [top_k(d, generator) for d in base.draft])


def top_k(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Each row [.., V] keeps its k likeliest entries, k drawn from 1..V per row, renormalised."""
    k = torch.randint(1, rows.shape[-1] + 1, rows.shape[:-1], generator=generator)
    rank = rows.argsort(-1, descending=True).argsort(-1)  # 0 for the likeliest entry
    kept = torch.where(rank < k[..., None], rows, 0.0)
    return kept / kept.sum(-1, keepdim=True)


@functools.cache
def trees_for(vocab: int, shape: tuple[int, ...], scheme: str, kind: str) -> treekit.Trees:
    return treekit.all_trees(tables_for(vocab, len(shape), kind), shape, scheme)


def library_step(rule: str, scheme: str) -> treekit.TreeStep:
    def step(trees):  # validation on: every enumerated tree is a valid input, as a drafter's would be
        law = tree_law(*trees.inputs, rule=rule, scheme=scheme, num_nodes=trees.num_nodes)
        return law.node_law, law.final

    return step


def law_error(tables: lawkit.Tables, trees: treekit.Trees, step: treekit.TreeStep, depth: int) -> float:
    law = treekit.emission_law(tables, trees, step, depth + 1)
    return lawkit.max_abs_error(law, lawkit.target_law(tables, depth + 1))


# --- the library's rules are lossless ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tree_rules_reproduce_the_target_joint_law(case, scheme, kind):
    vocab, shape = case
    tables, trees = tables_for(vocab, len(shape), kind), trees_for(vocab, shape, scheme, kind)
    for rule in SAMPLED_RULES:
        error = law_error(tables, trees, library_step(rule, scheme), len(shape))
        assert error < LOSSLESS, f"{rule} {scheme} {case_id(case)} {kind}: joint-law error {error:.2e}"


def test_distinct_trees_stop_where_the_support_does():
    """Distinct siblings beyond the draft's support are not drawn: the harness does exercise ragged trees."""
    for case in [(4, (2, 2)), (4, (3, 2)), (4, (1, 2, 1))]:
        trees = trees_for(*case, "distinct", "topk")
        sizes = set(trees.num_nodes.tolist())
        assert len(sizes) > 1 and min(sizes) < trees.draft_tokens.shape[1], sizes


# --- a literal transcription of the rules, with the known mistakes as switches --------------------------------

MISTAKES = ("no_sibling_residual", "initial_sibling_w", "unscaled_residual", "capped_parent_update")


def _normalized(values: list[float]) -> list[float] | None:
    total = sum(values)
    return [v / total for v in values] if total > 0 else None


def _without(draft: list[float], token: int) -> list[float]:
    draft = list(draft)
    draft[token] = 0.0
    return _normalized(draft) or draft


def reference_tree(tokens, parents, draft, target, rule, scheme, mistake=None):
    """(P(accepted node = a), law of the token after a) for a = 0..n, one tree as plain lists.

    token: recursive rejection sampling, top-down. block: the traversal as written, leaves first: take the first
    leaf g, accept its path with probability w_g, else update its parent a (residual, w_a, Q_a for distinct
    siblings), delete g and recompute w below a. Mistakes (each a switch):
      no_sibling_residual   the next sibling is judged against the parent's untouched target (only the token
                            emitted at the parent comes from the residual)
      initial_sibling_w     w below a is not recomputed after a child's subtree is rejected
      unscaled_residual     the parent's residual is max(P - Q, 0) instead of max(w P - Q, 0)
      capped_parent_update  w_a <- min(Z / (1 - Q_a[x_g]), 1) instead of Z / (Z + 1 - w_a)
    """
    n, vocab = len(tokens), len(target[0])
    children = [[] for _ in range(n + 1)]
    for node, parent in enumerate(parents, start=1):
        children[parent].append(node)
    law, final = [0.0] * (n + 1), [list(row) for row in target]
    if rule == "token":

        def visit(a: int, reach: float) -> None:
            seen, drawn_from = list(target[a]), list(draft[a])
            for c in children[a]:
                x = tokens[c - 1]
                accept = min(1.0, seen[x] / drawn_from[x])
                visit(c, reach * accept)
                reach *= 1.0 - accept
                residual = _normalized([max(seen[v] - drawn_from[v], 0.0) for v in range(vocab)])
                if residual is not None:
                    final[a] = residual
                    if mistake != "no_sibling_residual":
                        seen = residual
                if scheme == "distinct":
                    drawn_from = _without(drawn_from, x)
            law[a] = reach

        visit(0, 1.0)
        return law, final

    P, Q, w = [list(row) for row in target], [list(row) for row in draft], [1.0] * (n + 1)
    remaining = [list(c) for c in children]

    def set_weights(a: int) -> None:  # w_c = min(1, w_a P_a[x_c] / Q_a[x_c]) for every remaining descendant
        for c in remaining[a]:
            w[c] = min(1.0, w[a] * P[a][tokens[c - 1]] / Q[a][tokens[c - 1]])
            set_weights(c)

    set_weights(0)
    survive = 1.0  # P(every leaf so far rejected)
    while True:
        g = 0
        while remaining[g]:
            g = remaining[g][0]
        if g == 0:
            law[0] = survive
            return law, final
        law[g] = survive * w[g]
        survive *= 1.0 - w[g]
        a, x = parents[g - 1], tokens[g - 1]
        scaled = [max(w[a] * P[a][v] - Q[a][v], 0.0) for v in range(vocab)]
        z = sum(scaled)
        if mistake == "unscaled_residual":
            scaled = [max(P[a][v] - Q[a][v], 0.0) for v in range(vocab)]
        residual = _normalized(scaled)
        if residual is not None:
            final[a] = residual
            if mistake != "no_sibling_residual":
                P[a] = residual
        if mistake == "capped_parent_update":
            w[a] = min(z / (1.0 - Q[a][x]), 1.0) if Q[a][x] < 1.0 else 1.0
        else:
            w[a] = z / (z + (1.0 - w[a])) if z + (1.0 - w[a]) > 0 else 1.0
        if scheme == "distinct":
            Q[a] = _without(Q[a], x)
        remaining[a].pop(0)
        if mistake != "initial_sibling_w":
            set_weights(a)


def reference_step(rule: str, scheme: str, mistake: str | None = None) -> treekit.TreeStep:
    def step(trees):
        count, nodes = trees.draft_tokens.shape
        law = torch.zeros(count, nodes + 1, dtype=torch.float64)
        final = torch.zeros(count, nodes + 1, trees.target_probs.shape[-1], dtype=torch.float64)
        rows = zip(
            trees.draft_tokens.tolist(),
            trees.parents.tolist(),
            trees.draft_probs.tolist(),
            trees.target_probs.tolist(),
            trees.num_nodes.tolist(),
        )
        for t, (tokens, parents, draft, target, n) in enumerate(rows):
            tree_law_, tree_final = reference_tree(
                tokens[:n], parents[:n], draft[: n + 1], target[: n + 1], rule, scheme, mistake
            )
            law[t, : n + 1] = torch.tensor(tree_law_, dtype=torch.float64)
            final[t, : n + 1] = torch.tensor(tree_final, dtype=torch.float64)
        return law, final

    return step


# Small enough for the plain-Python reference (at most ~2000 trees each).
REFERENCE_CASES = [
    (4, (2,)),
    (4, (3,)),
    (4, (2, 2)),
    (4, (1, 2)),
    (4, (2, 1, 1)),
    (4, (1, 2, 1)),
    (3, (1, 1, 1)),
    (4, (1, 1)),
]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=case_id)
def test_library_matches_the_literal_traversal(case, scheme):
    """The library's one pass in node order equals the leaf-first loop as written (law and emitted token), and
    its E[tau] is that law's mean depth: sum_t pi_t prod_{s<t} (1 - pi_s) d_t for the traversal."""
    vocab, shape = case
    trees = trees_for(vocab, shape, scheme, "zeros")
    depth = node_depths(trees.parents, trees.num_nodes).double()
    for rule in SAMPLED_RULES:
        ref_law, ref_final = reference_step(rule, scheme)(trees)
        law = tree_law(*trees.inputs, rule=rule, scheme=scheme, num_nodes=trees.num_nodes)
        assert lawkit.max_abs_error(law.node_law, ref_law) < LOSSLESS
        reached = ref_law > 0  # the emitted token's law only matters where the step can stop
        assert lawkit.max_abs_error(law.final[reached], ref_final[reached]) < LOSSLESS
        expected = expected_accepted_tree(*trees.inputs, rule=rule, scheme=scheme, num_nodes=trees.num_nodes)
        assert lawkit.max_abs_error(expected, (ref_law * depth).sum(-1)) < LOSSLESS


# Where each mistake can act: siblings (all but the first two), a non-root internal node (the last three).
MISTAKE_CASES = [(4, (2, 2)), (4, (1, 2)), (4, (2, 1, 1)), (3, (1, 1)), (4, (1, 1, 1))]


@pytest.mark.parametrize("mistake", MISTAKES)
def test_plausible_tree_mistakes_are_not_lossless(mistake):
    """Each mistake breaks the joint law on some enumerated case, while the same transcription without it is exact
    on every one of them (so the failure is the mistake's own)."""
    rules = SAMPLED_RULES if mistake == "no_sibling_residual" else ("block",)  # the others are the traversal's own
    errors = {}
    for vocab, shape in MISTAKE_CASES:
        for scheme in SCHEMES:
            tables, trees = tables_for(vocab, len(shape), "zeros"), trees_for(vocab, shape, scheme, "zeros")
            for rule in rules:
                assert law_error(tables, trees, reference_step(rule, scheme), len(shape)) < LOSSLESS
                errors[f"{rule} {scheme} {case_id((vocab, shape))}"] = law_error(
                    tables, trees, reference_step(rule, scheme, mistake), len(shape)
                )
    summary = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    print(f"{mistake}: {summary}")  # visible with pytest -s
    assert max(errors.values()) > LOSSY, f"{mistake} looks lossless: {summary}"


@pytest.mark.parametrize(
    ("mistake", "case"),
    [
        ("no_sibling_residual", (4, (1, 1, 1))),  # no siblings
        ("initial_sibling_w", (4, (1, 1, 1))),
        ("unscaled_residual", (4, (3,))),  # rejections at the root only, where w = 1
    ],
)
def test_mistakes_coincide_with_the_rule_where_they_cannot_act(mistake, case):
    """Why the cases above need siblings, or an internal node below the root."""
    vocab, shape = case
    tables = tables_for(vocab, len(shape), "zeros")
    for scheme in SCHEMES:
        for rule in SAMPLED_RULES if mistake == "no_sibling_residual" else ("block",):
            step = reference_step(rule, scheme, mistake)
            assert law_error(tables, trees_for(vocab, shape, scheme, "zeros"), step, len(shape)) < LOSSLESS


def test_capped_parent_update_is_lossy_on_a_two_token_chain():
    """min(Z / (1 - Q_a[x_g]), 1), found in public code, is not Sun et al.'s h even on a chain."""
    tables = tables_for(3, 2, "dense")
    trees = trees_for(3, (1, 1), "iid", "dense")
    assert law_error(tables, trees, reference_step("block", "iid", "capped_parent_update"), 2) > LOSSY


@pytest.mark.parametrize("rule", SAMPLED_RULES)
def test_the_other_schemes_update_is_not_lossless(rule):
    """Distinct siblings verified as i.i.d. ones (Q_a not renormalised after a rejection): valid inputs, wrong law.
    It can be exact on a table (when the residual after the first rejection is one-hot, see below)."""
    errors = {}
    for vocab, shape in [(4, (2, 2)), (4, (2, 1, 1)), (4, (1, 2, 1))]:
        tables, trees = tables_for(vocab, len(shape), "zeros"), trees_for(vocab, shape, "distinct", "zeros")
        errors[case_id((vocab, shape))] = law_error(tables, trees, library_step(rule, "iid"), len(shape))
    print(f"distinct trees verified as iid ({rule}): {errors}")
    assert max(errors.values()) > LOSSY, errors


def test_scheme_mismatch_is_exact_only_when_the_first_residual_is_one_hot():
    """V = 3, branching at the root only: the mismatch is exact exactly on the tables where at most one token has
    target > draft at the root. Then the residual after the first rejection is one-hot, and the next sibling is
    accepted (it is that token) or rejected (any other) whatever Q_a is. Elsewhere it is not, so a test of the Q
    update must not rely on such cases alone."""
    outcomes = []
    for seed in range(12):
        tables = tables_for(3, 1, "dense", seed)
        trees = treekit.all_trees(tables, (2,), "distinct")
        error = law_error(tables, trees, library_step("block", "iid"), 1)
        one_hot = int((tables.target[0][0] > tables.draft[0][0]).sum()) <= 1
        assert (error < LOSSLESS) == one_hot, f"seed {seed}: error {error:.1e}, one-hot residual {one_hot}"
        outcomes.append(one_hot)
    assert 0 < sum(outcomes) < len(outcomes)  # both kinds of tables occur


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dropping_a_drawn_child_for_its_own_value_is_not_lossless(scheme):
    """A drafter that drops drawn nodes whose draft probability is below 1/V (with their subtrees) biases the
    output; the same decision taken before drawing a node's children (no children below 1/V) is a stopping rule
    and stays exact."""
    for vocab, shape in [(4, (2,)), (4, (2, 2)), (4, (1, 2, 1))]:
        tables = tables_for(vocab, len(shape), "zeros")
        pruned = treekit.all_trees(tables, shape, scheme, prune=lambda q, vocab=vocab: q < 1 / vocab)
        stopped = treekit.all_trees(tables, shape, scheme, stop=lambda q, vocab=vocab: q < 1 / vocab)
        for rule in SAMPLED_RULES:
            error = law_error(tables, pruned, library_step(rule, scheme), len(shape))
            print(f"pruned {rule} {scheme} {case_id((vocab, shape))}: {error:.1e}")
            assert error > LOSSY
            assert law_error(tables, stopped, library_step(rule, scheme), len(shape)) < LOSSLESS


# --- expected accepted depth --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_sequence_level_is_never_worse_on_average_over_trees(case, kind):
    """The tree-weighted mean E[tau] of the block rule is at least the token rule's, for both schemes (and equal
    with branching at the root only); per tree it can be lower, the printed fraction says how often."""
    vocab, shape = case
    for scheme in SCHEMES:
        trees = trees_for(vocab, shape, scheme, kind)
        per_tree = {
            rule: expected_accepted_tree(*trees.inputs, rule=rule, scheme=scheme, num_nodes=trees.num_nodes)
            for rule in SAMPLED_RULES
        }
        means = {rule: float((trees.prob * e).sum()) for rule, e in per_tree.items()}
        lower = float(trees.prob[per_tree["block"] < per_tree["token"] - 1e-12].sum())
        share = float((per_tree["block"] < per_tree["token"] - 1e-12).double().mean())
        print(
            f"{case_id(case)} {scheme} {kind}: E[tau] token {means['token']:.4f} block {means['block']:.4f}; "
            f"block lower on {share:.0%} of the trees ({lower:.0%} of the mass)"
        )
        assert means["block"] >= means["token"] - 1e-12, means
        if len(shape) == 1:
            assert means["block"] == pytest.approx(means["token"], abs=1e-12)
