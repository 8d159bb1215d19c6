"""Exact-law tests of multi-path verification (blockspec/verify/multipath.py): enumerate every set of k paths of L
tokens the draft can draw (tests/kits/multipathkit.py), integrate over the verifier's randomness through its closed
form (``multipath_law``), and compare the law of the emitted tokens with the target's, to 1e-12 in float64.

Grid: k in {2, 3}, L in {1, 2, 3} (V = 4, and V = 3 for k = L = 3 in the fast lane; V = 4 there too in the full
suite), both drawing schemes (i.i.d. paths; first tokens without replacement), both tree rules, on random
context-dependent tables with exact zeros, dense ones, and ones shaped like a language-model pair.

Four plausible implementations are shown NOT to be lossless on the same harness, and the paired analytic gain over
block verification of one chain (of L tokens, and of the same k * L drafted tokens) is printed (pytest -s).
"""

from __future__ import annotations

import functools

import pytest
import torch
from kits import lawkit, multipathkit, treekit

from blockspec.verify import accepted_length_law, expected_accepted, final_distributions
from blockspec.verify.multipath import expected_accepted_multipath, multipath_law, paths_to_tree
from blockspec.verify.tree import expected_accepted_tree, tree_law

LOSSLESS = 1e-12
LOSSY = 1e-4  # a mistake must move some probability of the joint law by more than this (10^8 x LOSSLESS)
PATH_RULES = ("block", "token")  # the tree rules; "block" (Traversal Verification) is the multi-path rule shipped

GRID = [(paths, length) for paths in (2, 3) for length in (1, 2, 3)]
CASES = [(3 if grid == (3, 3) else 4, *grid) for grid in GRID]
SLOW_CASES = [(4, 3, 3)]
KINDS = ("zeros", "dense", "similar")


def case_id(case) -> str:
    vocab, paths, length = case
    return f"V{vocab}-k{paths}-L{length}"


@functools.cache
def tables_for(vocab: int, depth: int, kind: str, seed: int = 0) -> lawkit.Tables:
    """Random context-dependent tables: ~20 % exact zeros, none, or a peaked target with a draft that is a noisy
    copy of it (``multipathkit.similar_tables``)."""
    seed = 1000 * KINDS.index(kind) + 10 * vocab + depth + seed
    if kind == "similar":
        return multipathkit.similar_tables(vocab, depth, seed, spread=2.0, noise=1.0)
    return lawkit.random_tables(vocab, depth, seed=seed, zeros=kind == "zeros")


@functools.cache
def paths_for(vocab: int, paths: int, length: int, scheme: str, kind: str) -> multipathkit.Paths:
    return multipathkit.all_paths(tables_for(vocab, length, kind), paths, length, scheme)


# A step: (drawn paths) -> (trees, node_law [T, N+1], final [T, N+1, V]): the tree whose nodes the law is over.
def library_step(rule: str):
    def step(drawn: multipathkit.Paths):  # validation on: every enumerated set of paths is a valid input
        tree, law = multipath_law(*drawn.inputs, rule=rule, num_paths=drawn.num_paths)
        return multipathkit.as_trees(tree, drawn.prob), law.node_law, law.final

    return step


def law_error(tables: lawkit.Tables, drawn: multipathkit.Paths, step, length: int) -> float:
    trees, node_law, final = step(drawn)
    law = treekit.emission_law(tables, trees, lambda _: (node_law, final), length + 1)
    return lawkit.max_abs_error(law, lawkit.target_law(tables, length + 1))


# --- lossless --------------------------------------------------------------------------------------------------


def check_lossless(case, scheme, kind) -> None:
    vocab, paths, length = case
    tables, drawn = tables_for(vocab, length, kind), paths_for(vocab, paths, length, scheme, kind)
    for rule in PATH_RULES:
        error = law_error(tables, drawn, library_step(rule), length)
        assert error < LOSSLESS, f"{rule} {scheme} {case_id(case)} {kind}: joint-law error {error:.2e}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scheme", multipathkit.PATH_SCHEMES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_multipath_reproduces_the_target_joint_law(case, scheme, kind):
    check_lossless(case, scheme, kind)


@pytest.mark.slow  # 262,144 sets of i.i.d. paths per table
@pytest.mark.parametrize("scheme", multipathkit.PATH_SCHEMES)
@pytest.mark.parametrize("case", SLOW_CASES, ids=case_id)
def test_multipath_reproduces_the_target_joint_law_at_v4_k3_l3(case, scheme):
    check_lossless(case, scheme, "dense")


def test_iid_paths_do_share_prefixes_and_distinct_ones_run_out_of_support():
    """The harness exercises what it must: merged prefixes (fewer nodes than k * L) and rows with fewer paths."""
    iid = paths_for(4, 3, 2, "iid", "zeros")
    assert int(paths_to_tree(*iid.inputs).num_nodes.min()) < 3 * 2
    distinct = paths_for(3, 3, 3, "distinct", "zeros")  # the root's draft has 2 tokens: 2 paths
    assert set(distinct.num_paths.tolist()) == {2}


@pytest.mark.parametrize("path_rule", PATH_RULES)
def test_one_path_is_the_chain_rule(path_rule):
    """k = 1: the law of tau, the token after it and E[tau] are block (token) verification's of that path."""
    tables = tables_for(4, 3, "zeros")
    drawn = multipathkit.all_paths(tables, 1, 3, "iid")
    tokens, draft, target = drawn.tokens[:, 0], drawn.draft_probs[:, 0], drawn.target_probs[:, 0]
    tree, law = multipath_law(*drawn.inputs, rule=path_rule)
    # one path: node i holds its first i tokens, so node law = law of tau
    assert lawkit.max_abs_error(law.node_law, accepted_length_law(tokens, draft, target, path_rule)) < LOSSLESS
    reached = law.node_law > 0
    chain_final = final_distributions(tokens, draft, target, path_rule)
    assert lawkit.max_abs_error(law.final[reached], chain_final[reached]) < LOSSLESS
    expected = expected_accepted_multipath(*drawn.inputs, rule=path_rule)
    assert lawkit.max_abs_error(expected, expected_accepted(tokens, draft, target, path_rule)) < LOSSLESS


def test_dropping_a_path_whose_first_token_repeats_stays_exact():
    """A drafter may discard an i.i.d. path whose first token an earlier path already has (the survivors have
    distinct first tokens, in order of first appearance): still a drawing the tree rules are exact for."""
    for vocab, paths, length in [(4, 2, 2), (4, 3, 2), (3, 3, 3)]:
        tables = tables_for(vocab, length, "zeros")
        drawn = drop_repeated_starts(paths_for(vocab, paths, length, "iid", "zeros"))
        assert int(drawn.num_paths.min()) < paths  # some were dropped
        for rule in PATH_RULES:
            assert law_error(tables, drawn, library_step(rule), length) < LOSSLESS


def drop_repeated_starts(drawn: multipathkit.Paths) -> multipathkit.Paths:
    count, paths, _ = drawn.tokens.shape
    starts = drawn.tokens[:, :, 0]
    earlier = torch.ones(paths, paths, dtype=torch.bool).tril(-1)  # [j, j']: j' < j
    keep = ~((starts[:, :, None] == starts[:, None, :]) & earlier).any(-1)  # [T, k]
    order = torch.sort((~keep).long(), dim=1, stable=True).indices  # kept paths first, in order

    def gather(values: torch.Tensor) -> torch.Tensor:
        index = order.reshape(count, paths, *[1] * (values.dim() - 2)).expand_as(values)
        return values.gather(1, index)

    return multipathkit.Paths(
        gather(drawn.tokens), gather(drawn.draft_probs), gather(drawn.target_probs), keep.sum(1), drawn.prob
    )


# --- plausible mistakes --------------------------------------------------------------------------------------


def merged_as_iid(drawn: multipathkit.Paths):
    """The prefix tree verified as if its siblings were drawn i.i.d.: the draft is not renormalised after a
    rejected sibling, forgetting that merged (or distinct) first tokens are a drawing without replacement."""
    trees = multipathkit.as_trees(paths_to_tree(*drawn.inputs, num_paths=drawn.num_paths), drawn.prob)
    law = tree_law(*trees.inputs, rule="block", scheme="iid", num_nodes=trees.num_nodes)
    return trees, law.node_law, law.final


def best_of_k(drawn: multipathkit.Paths):
    """Each path block-verified on its own (independent randomness); the longest accepted prefix wins (the lowest
    path on ties), followed by its own correction or bonus token."""
    count, paths, length = drawn.tokens.shape
    vocab = drawn.draft_probs.shape[-1]
    tokens = drawn.tokens.reshape(-1, length)
    draft, target = drawn.draft_probs.reshape(-1, length, vocab), drawn.target_probs.reshape(-1, length + 1, vocab)
    tau_law = accepted_length_law(tokens, draft, target, "block", validate=False).reshape(count, paths, length + 1)
    final = final_distributions(tokens, draft, target, "block", validate=False).reshape(count, paths, length + 1, -1)
    live = torch.arange(paths) < drawn.num_paths[:, None]
    no_path = torch.nn.functional.one_hot(torch.tensor(0), length + 1).double()  # an absent path accepts nothing
    tau_law = torch.where(live[..., None], tau_law, no_path)
    at_most = tau_law.cumsum(-1)  # P(tau_j <= t)
    node_law = torch.zeros(count, paths * length + 1, dtype=torch.float64)  # node (j, t): column j * L + t
    node_final = torch.zeros(count, paths * length + 1, vocab, dtype=torch.float64)
    node_law[:, 0], node_final[:, 0] = tau_law[:, :, 0].prod(1), final[:, 0, 0]
    for j in range(paths):
        for t in range(1, length + 1):
            wins = tau_law[:, j, t] * at_most[:, :j, t - 1].prod(1) * at_most[:, j + 1 :, t].prod(1)
            node_law[:, j * length + t], node_final[:, j * length + t] = wins, final[:, j, t]
    return multipathkit.separate_tree(drawn), node_law, node_final


def inclusion_law(drawn: multipathkit.Paths):
    """The prefix tree verified with each node's draft replaced by the chance that a token shows up among the m
    draws through it, normalize(1 - (1 - Q_a)^m): the law of the node set, not of the drawing order."""
    tree = paths_to_tree(*drawn.inputs, num_paths=drawn.num_paths)
    count, nodes = tree.draft_tokens.shape
    through = torch.zeros(count, nodes + 1, dtype=torch.float64)  # m_a: paths through node a
    flat = tree.path_nodes.reshape(count, -1)
    through.scatter_add_(1, flat.clamp(min=0), (flat >= 0).double())
    through[:, 0] = drawn.num_paths.double()
    shown = 1.0 - (1.0 - tree.draft_probs) ** through[..., None]
    mass = shown.sum(-1, keepdim=True)
    draft = torch.where(mass > 0, shown / mass.clamp(min=1e-300), tree.draft_probs)
    trees = treekit.Trees(tree.draft_tokens, tree.parents, draft, tree.target_probs, tree.num_nodes, drawn.prob)
    law = tree_law(*trees.inputs, rule="block", scheme="distinct", num_nodes=trees.num_nodes)
    return multipathkit.as_trees(tree, drawn.prob), law.node_law, law.final


def likeliest_first(drawn: multipathkit.Paths):
    """The prefix tree with every node's children reordered by their draft probability, likeliest first (try the
    best guess first), then verified: a reranking of drawn nodes by their own value."""
    tree = paths_to_tree(*drawn.inputs, num_paths=drawn.num_paths)
    tokens, parents = tree.draft_tokens.clone(), tree.parents.clone()
    draft, target = tree.draft_probs.clone(), tree.target_probs.clone()
    for t in range(len(tokens)):
        count, token_of, parent_of = int(tree.num_nodes[t]), tree.draft_tokens[t].tolist(), tree.parents[t].tolist()
        children = [[] for _ in range(count + 1)]
        for node in range(1, count + 1):
            children[parent_of[node - 1]].append(node)
        order, queue = [], [0]  # breadth first: parents before children, siblings likeliest first
        while queue:
            node = queue.pop(0)
            ranked = sorted(children[node], key=lambda c, node=node: -float(tree.draft_probs[t, node, token_of[c - 1]]))
            order += ranked
            queue += ranked
        renumber = {0: 0, **{old: new for new, old in enumerate(order, start=1)}}
        for new, old in enumerate(order, start=1):
            tokens[t, new - 1], parents[t, new - 1] = token_of[old - 1], renumber[parent_of[old - 1]]
            draft[t, new], target[t, new] = tree.draft_probs[t, old], tree.target_probs[t, old]
    trees = treekit.Trees(tokens, parents, draft, target, tree.num_nodes, drawn.prob)
    law = tree_law(*trees.inputs, rule="block", scheme="distinct", num_nodes=trees.num_nodes)
    return trees, law.node_law, law.final


MISTAKES = {
    "merged_as_iid": merged_as_iid,
    "best_of_k": best_of_k,
    "inclusion_law": inclusion_law,
    "likeliest_first": likeliest_first,
}
MISTAKE_CASES = [(3, 2, 2), (4, 2, 2), (4, 3, 2), (4, 2, 3)]


@pytest.mark.parametrize("mistake", MISTAKES)
def test_plausible_multipath_mistakes_are_not_lossless(mistake):
    """Each mistake breaks the joint law on the enumerated cases, under both drawing schemes, where the library's
    rule is exact (so the failure is the mistake's own). ``merged_as_iid`` under distinct first tokens is exact
    on some V = 3 tables (a one-hot residual after the first rejection, as for trees), hence the max over cases."""
    errors = {}
    for vocab, paths, length in MISTAKE_CASES:
        tables = tables_for(vocab, length, "zeros")
        for scheme in multipathkit.PATH_SCHEMES:
            drawn = paths_for(vocab, paths, length, scheme, "zeros")
            assert law_error(tables, drawn, library_step("block"), length) < LOSSLESS
            errors[f"{scheme} {case_id((vocab, paths, length))}"] = law_error(tables, drawn, MISTAKES[mistake], length)
    summary = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    print(f"{mistake}: {summary}")  # visible with pytest -s
    for scheme in multipathkit.PATH_SCHEMES:
        assert max(e for name, e in errors.items() if name.startswith(scheme)) > LOSSY, f"{mistake}: {summary}"


# --- expected accepted length, and the gain over one chain -------------------------------------------------------


def test_expected_accepted_multipath_is_the_laws_mean_depth():
    for scheme in multipathkit.PATH_SCHEMES:
        drawn = paths_for(4, 3, 2, scheme, "zeros")
        for rule in PATH_RULES:
            tree, law = multipath_law(*drawn.inputs, rule=rule, num_paths=drawn.num_paths)
            depth = torch.zeros_like(law.node_law)
            for node in range(1, depth.shape[1]):  # parents come first
                live = node <= tree.num_nodes
                depth[:, node] = torch.where(
                    live, depth.gather(1, tree.parents[:, node - 1 : node].clamp(min=0))[:, 0] + 1, 0
                )
            expected = expected_accepted_multipath(*drawn.inputs, rule=rule, num_paths=drawn.num_paths)
            assert lawkit.max_abs_error(expected, (law.node_law * depth).sum(-1)) < LOSSLESS


GAIN_TABLES = {  # name: (tables of depth 9 over V = 4, shared by every k and L)
    "random": lambda: lawkit.random_tables(4, 9, seed=11, zeros=False),
    "similar (spread 2, noise 1)": lambda: multipathkit.similar_tables(4, 9, 5, spread=2.0, noise=1.0),
    "similar (spread 3, noise 0.5)": lambda: multipathkit.similar_tables(4, 9, 5, spread=3.0, noise=0.5),
}


def gain_rows(tables: lawkit.Tables, grid) -> list[dict[str, float]]:
    """Exact E[tokens emitted per step] for each (k, L): multi-path Traversal Verification (i.i.d. paths merged;
    distinct first tokens), k i.i.d. paths kept as separate branches, and block verification of one chain of L
    and of k * L tokens, all on the same tables."""
    rows = []
    for paths, length in grid:
        drawn = multipathkit.all_paths(tables, paths, length, "iid")
        separate = multipathkit.separate_tree(drawn)
        separate_tau = expected_accepted_tree(
            *separate.inputs, rule="block", scheme="iid", num_nodes=separate.num_nodes
        )
        rows.append(
            {
                "k": paths,
                "L": length,
                "iid": multipathkit.expected_emitted(tables, paths, length, "iid"),
                "nodes": float((drawn.prob * paths_to_tree(*drawn.inputs).num_nodes).sum()),
                "separate": 1.0 + float((drawn.prob * separate_tau).sum()),
                "distinct": multipathkit.expected_emitted(tables, paths, length, "distinct"),
                "chain L": multipathkit.chain_expected_emitted(tables, length),
                "chain kL": multipathkit.chain_expected_emitted(tables, paths * length),
            }
        )
    return rows


def print_gains(name: str, rows) -> None:
    print(f"\n{name}: E[tokens emitted per step] (= 1 + E[tau]), V = 4, exact")
    print("k L | iid merged (nodes) | iid separate | distinct | chain L | chain kL | distinct vs L | vs kL")
    for r in rows:
        print(
            f"{r['k']} {r['L']} | {r['iid']:.4f} ({r['nodes']:.2f}) | {r['separate']:.4f} | {r['distinct']:.4f} | "
            f"{r['chain L']:.4f} | {r['chain kL']:.4f} | {r['distinct'] / r['chain L'] - 1:+.1%} | "
            f"{r['distinct'] / r['chain kL'] - 1:+.1%}"
        )


def check_gains(rows) -> None:
    for r in rows:
        assert r["nodes"] < r["k"] * r["L"]  # merging saves nodes
        for scheme in ("iid", "distinct"):  # more candidates never lost on these tables
            assert r[scheme] >= r["chain L"] - 1e-12, r


@pytest.mark.parametrize("name", GAIN_TABLES)
def test_multipath_gain_over_one_chain(name):
    """The paired analytic gain (same tables, exact expectations): k paths of L tokens against one chain of L (the
    same verification depth) and one chain of k * L (the same number of drafted tokens). Printed with -s."""
    rows = gain_rows(GAIN_TABLES[name](), [(2, 1), (2, 2), (3, 1), (3, 2)])
    print_gains(name, rows)
    check_gains(rows)


@pytest.mark.slow  # up to 262,144 sets of paths and chains per row
@pytest.mark.parametrize("name", GAIN_TABLES)
def test_multipath_gain_over_one_chain_full_grid(name):
    rows = gain_rows(GAIN_TABLES[name](), GRID)
    print_gains(name, rows)
    check_gains(rows)
