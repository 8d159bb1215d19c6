"""Tree verification against the chain rules, by brute force, and its input contract.

chain       a chain-shaped tree makes verify_block's / verify_token's decisions with the same randomness (ragged
            rows, float64 and float32), and its closed-form E[tau] is expected_accepted
greedy      the deepest node whose path follows the target's argmax, found by brute force
numbering   any drawing order (parents before children, siblings in order) gives the same law and output
layout      a row's output does not depend on its batch neighbours, nor on the junk in its padding, nor on how the
            vocabulary passes are split into row chunks
format      the tokens are the accepted path's, then one more; accepted_nodes walk down from the root
validation  refusals name the argument: distinct duplicates, parents drawn after a child, shapes, zero mass

Laws are checked exactly in tests/verify/test_tree_exact.py, and by Monte-Carlo in
tests/verify/test_tree_statistical.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kits import lawkit, treekit

from blockspec.verify import RULES, SAMPLED_RULES, Randomness, expected_accepted, rules, verify_greedy
from blockspec.verify import tree as tree_module
from blockspec.verify.tree import (
    accepted_node_law,
    expected_accepted_tree,
    tree_acceptance,
    tree_law,
    verify_tree_block,
    verify_tree_greedy,
    verify_tree_token,
)
from blockspec.verify.tree_inputs import SCHEMES

TREE_VERIFIERS = {"token": verify_tree_token, "block": verify_tree_block}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def random_rows(shape, generator, dtype=torch.float64, zeros=0.2) -> torch.Tensor:
    """Random probability rows [.., V] with some exact zeros (never the row's mode)."""
    probs = (2.0 * torch.randn(shape, generator=generator, dtype=torch.float64)).softmax(-1)
    kill = torch.rand(shape, generator=generator, dtype=torch.float64) < zeros
    kill.scatter_(-1, probs.argmax(-1, keepdim=True), False)
    probs = probs.masked_fill(kill, 0.0)
    return (probs / probs.sum(-1, keepdim=True)).to(dtype)


def random_chains(batch: int, width: int, vocab: int, seed: int, dtype=torch.float64):
    """Chains as trees: (draft_tokens [B, K], parents [B, K], draft_probs [B, K+1, V], target_probs, num_nodes);
    row 0 is full, the others have 0..K nodes."""
    generator = torch.Generator().manual_seed(seed)
    draft = random_rows((batch, width + 1, vocab), generator, dtype)
    target = random_rows((batch, width + 1, vocab), generator, dtype)
    tokens = torch.multinomial(draft[:, :width].reshape(-1, vocab).double(), 1, generator=generator)
    parents = torch.arange(width).expand(batch, width).clone()
    num_nodes = torch.randint(0, width + 1, (batch,), generator=generator)
    num_nodes[0] = width
    return tokens.reshape(batch, width), parents, draft, target, num_nodes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rule", SAMPLED_RULES)
def test_a_chain_makes_the_chain_rules_decisions(rule, dtype):
    """Same uniforms and exponentials: the same tau and tokens, row by row, as verify_block / verify_token on each
    row's own block (for the block rule: uniforms consumed deepest first, the traversal's w is Sun et al.'s h)."""
    batch, width, vocab = 3000, 4, 5
    tokens, parents, draft, target, num_nodes = random_chains(batch, width, vocab, seed=1, dtype=DTYPES[dtype])
    randomness = Randomness.draw(batch, width, vocab, dtype=DTYPES[dtype], generator=torch.Generator().manual_seed(2))
    tree = TREE_VERIFIERS[rule](
        tokens, parents, draft, target, scheme="iid", num_nodes=num_nodes, randomness=randomness
    )
    assert tree.tokens.shape == (batch, width + 1)
    for n in range(width + 1):
        rows = num_nodes == n
        alone = Randomness(randomness.uniforms[rows, :n], randomness.exponentials[rows])
        chain = RULES[rule].verify(tokens[rows, :n], draft[rows, :n], target[rows, : n + 1], randomness=alone)
        assert torch.equal(tree.num_accepted[rows], chain.num_accepted)
        assert torch.equal(tree.tokens[rows, : n + 1], chain.tokens)
        assert bool((tree.tokens[rows, n + 1 :] == -1).all())
    assert 0 < float(tree.num_accepted.double().mean()) < width  # both acceptances and rejections happened


@pytest.mark.parametrize("rule", SAMPLED_RULES)
def test_a_chains_expected_depth_is_expected_accepted(rule):
    tokens, parents, draft, target, num_nodes = random_chains(500, 4, 5, seed=3)
    tree = expected_accepted_tree(tokens, parents, draft, target, rule=rule, scheme="distinct", num_nodes=num_nodes)
    full = num_nodes == 4
    chain = expected_accepted(tokens[full], draft[full, :4], target[full], rule)
    assert lawkit.max_abs_error(tree[full], chain) < 1e-12
    for n in range(4):
        rows = num_nodes == n
        chain = expected_accepted(tokens[rows, :n], draft[rows, :n], target[rows, : n + 1], rule)
        assert lawkit.max_abs_error(tree[rows], chain) < 1e-12


# --- greedy ---------------------------------------------------------------------------------------------------


def random_trees(batch: int, nodes: int, vocab: int, seed: int, *, follow_argmax: float = 0.0):
    """Trees with random parents (any drawing order) and i.i.d. tokens: (draft_tokens, parents, draft_probs,
    target_probs, num_nodes). With ``follow_argmax`` that share of the tokens is the target's argmax after the
    parent, so greedy paths grow long."""
    generator = torch.Generator().manual_seed(seed)
    parents = (torch.rand(batch, nodes, generator=generator) * torch.arange(1, nodes + 1)).long()  # in [0, a)
    draft = random_rows((batch, nodes + 1, vocab), generator)
    target = random_rows((batch, nodes + 1, vocab), generator)
    target[:, :, :2] = target[:, :, :2].amax(-1, keepdim=True)  # some argmax ties, to the lowest id
    target = target / target.sum(-1, keepdim=True)
    drawn_from = draft.gather(1, parents[..., None].expand(-1, -1, vocab))  # [B, N, V]: the parent's draft
    tokens = torch.multinomial(drawn_from.reshape(-1, vocab), 1, generator=generator).reshape(batch, nodes)
    greedy = target.gather(1, parents[..., None].expand(-1, -1, vocab)).argmax(-1)
    follow = torch.rand(batch, nodes, generator=generator) < follow_argmax
    tokens = torch.where(follow, greedy, tokens)
    num_nodes = torch.randint(0, nodes + 1, (batch,), generator=generator)
    return tokens, parents, draft, target, num_nodes


def brute_force_greedy(tokens: list[int], parents: list[int], target: torch.Tensor, n: int) -> int:
    """The deepest node (the first in node order among the deepest) whose every token is the target's argmax."""
    best, best_depth = 0, 0
    for node in range(1, n + 1):
        depth, current, matches = 0, node, True
        while current:
            parent = parents[current - 1]
            matches &= tokens[current - 1] == int(target[parent].argmax())
            current, depth = parent, depth + 1
        if matches and depth > best_depth:
            best, best_depth = node, depth
    return best


def test_greedy_is_the_deepest_argmax_path():
    tokens, parents, draft, target, num_nodes = random_trees(400, 12, 4, seed=5, follow_argmax=0.7)
    out = verify_tree_greedy(tokens, parents, None, target, num_nodes=num_nodes)
    assert int(out.num_accepted.max()) >= 3  # long paths were exercised
    for b in range(len(tokens)):
        best = brute_force_greedy(tokens[b].tolist(), parents[b].tolist(), target[b], int(num_nodes[b]))
        tau = int(out.num_accepted[b])
        path = out.accepted_nodes[b, :tau].tolist()
        assert path[-1:] == ([best] if best else [])
        assert out.tokens[b, tau] == target[b, best].argmax()
        assert out.tokens[b, :tau].tolist() == [int(tokens[b, node - 1]) for node in path]


def test_greedy_on_a_chain_is_verify_greedy():
    tokens, parents, draft, target, num_nodes = random_chains(500, 4, 3, seed=6)
    tokens = torch.where(
        torch.rand(tokens.shape, generator=torch.Generator().manual_seed(0)) < 0.7, target[:, :4].argmax(-1), tokens
    )  # long matches
    tree = verify_tree_greedy(tokens, parents, None, target)
    chain = verify_greedy(tokens, None, target)
    assert torch.equal(tree.tokens, chain.tokens) and torch.equal(tree.num_accepted, chain.num_accepted)


# --- numbering, layout, format -------------------------------------------------------------------------------


def depth_first(trees: treekit.Trees) -> tuple[treekit.Trees, torch.Tensor]:
    """The same trees numbered depth first (a drafter that grows one branch at a time), and the new number of every
    old node [T, N+1]. Siblings keep their order."""
    count, nodes = trees.draft_tokens.shape
    new_of = torch.zeros(count, nodes + 1, dtype=torch.long)
    for t in range(count):
        n = int(trees.num_nodes[t])
        children = [[] for _ in range(n + 1)]
        for node, parent in enumerate(trees.parents[t, :n].tolist(), start=1):
            children[parent].append(node)
        order, stack = [], list(reversed(children[0]))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(children[node]))
        new_of[t, torch.tensor(order, dtype=torch.long)] = torch.arange(1, n + 1)
        new_of[t, n + 1 :] = torch.arange(n + 1, nodes + 1)
    old_of = new_of.argsort(1)  # [T, N+1]: the old node at each new number
    rows = torch.arange(count)[:, None]
    parents = torch.nn.functional.pad(trees.parents, (1, 0))[rows, old_of][:, 1:]
    parents = torch.where(parents >= 0, new_of.gather(1, parents.clamp(min=0)), -1)
    tokens = torch.nn.functional.pad(trees.draft_tokens, (1, 0))[rows, old_of][:, 1:]
    renumbered = treekit.Trees(
        tokens, parents, trees.draft_probs[rows, old_of], trees.target_probs[rows, old_of], trees.num_nodes, trees.prob
    )
    return renumbered, new_of


@pytest.mark.parametrize("scheme", SCHEMES)
def test_any_drawing_order_gives_the_same_law_and_output(scheme):
    """Breadth first (the enumerations) or depth first: only 'parents first, siblings in order' matters."""
    tables = lawkit.random_tables(4, 3, seed=8)
    trees = treekit.sample_trees(tables, (2, 2, 1), scheme, 300, torch.Generator().manual_seed(0))
    other, new_of = depth_first(trees)
    assert not torch.equal(other.parents, trees.parents)
    randomness = Randomness.draw(
        len(trees), trees.parents.shape[1], 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    moved = Randomness(
        randomness.uniforms.scatter(1, new_of[:, 1:] - 1, randomness.uniforms), randomness.exponentials
    )  # node a's uniform follows it to its new number
    for rule in SAMPLED_RULES:
        law = tree_law(*trees.inputs, rule=rule, scheme=scheme, num_nodes=trees.num_nodes)
        law_other = tree_law(*other.inputs, rule=rule, scheme=scheme, num_nodes=other.num_nodes)
        assert lawkit.max_abs_error(law_other.node_law.gather(1, new_of), law.node_law) < 1e-15
        out = TREE_VERIFIERS[rule](*trees.inputs, scheme=scheme, num_nodes=trees.num_nodes, randomness=randomness)
        out_other = TREE_VERIFIERS[rule](*other.inputs, scheme=scheme, num_nodes=other.num_nodes, randomness=moved)
        assert torch.equal(out.tokens, out_other.tokens)


def padded_junk(trees: treekit.Trees) -> treekit.Trees:
    """Padding filled with junk a verifier must not read: ids out of range, parents after their node, 7.0 rows."""
    count, nodes = trees.draft_tokens.shape
    pad = torch.arange(1, nodes + 1) > trees.num_nodes[:, None]  # [T, N]
    rows = torch.nn.functional.pad(pad, (1, 0))[..., None]
    return treekit.Trees(
        trees.draft_tokens.masked_fill(pad, 99),
        trees.parents.masked_fill(pad, 77),
        trees.draft_probs.masked_fill(rows, 7.0),
        trees.target_probs.masked_fill(rows, 7.0),
        trees.num_nodes,
        trees.prob,
    )


@pytest.mark.parametrize("rule", SAMPLED_RULES)
def test_rows_do_not_depend_on_their_neighbours_or_their_padding(rule):
    tables = lawkit.random_tables(3, 3, seed=9)
    generator = torch.Generator().manual_seed(3)
    parts = [treekit.sample_trees(tables, shape, "distinct", 40, generator) for shape in [(), (1,), (2, 1), (2, 2, 1)]]
    trees = padded_junk(treekit.concat(parts))
    randomness = Randomness.draw(len(trees), trees.parents.shape[1], 3, dtype=torch.float64, generator=generator)
    out = TREE_VERIFIERS[rule](*trees.inputs, scheme="distinct", num_nodes=trees.num_nodes, randomness=randomness)
    for b in range(0, len(trees), 7):
        n = int(trees.num_nodes[b])
        alone = TREE_VERIFIERS[rule](
            trees.draft_tokens[b : b + 1, :n],
            trees.parents[b : b + 1, :n],
            trees.draft_probs[b : b + 1, : n + 1],
            trees.target_probs[b : b + 1, : n + 1],
            scheme="distinct",
            randomness=Randomness(randomness.uniforms[b : b + 1, :n], randomness.exponentials[b : b + 1]),
        )
        width = alone.tokens.shape[1]
        assert torch.equal(out.tokens[b, :width], alone.tokens[0]) and bool((out.tokens[b, width:] == -1).all())


@pytest.mark.parametrize("rule", SAMPLED_RULES)
def test_output_is_an_accepted_path_then_one_token(rule):
    tokens, parents, draft, target, num_nodes = random_trees(500, 10, 4, seed=10)
    out = TREE_VERIFIERS[rule](
        tokens, parents, draft, target, scheme="iid", num_nodes=num_nodes, generator=torch.Generator().manual_seed(4)
    )
    again = TREE_VERIFIERS[rule](
        tokens, parents, draft, target, scheme="iid", num_nodes=num_nodes, generator=torch.Generator().manual_seed(4)
    )
    assert torch.equal(out.tokens, again.tokens)  # same seed, same output
    width = out.tokens.shape[1]
    assert out.accepted_nodes.shape == (500, width - 1) and torch.equal(out.num_emitted, out.num_accepted + 1)
    for b in range(500):
        tau = int(out.num_accepted[b])
        path = out.accepted_nodes[b].tolist()
        assert all(node == -1 for node in path[tau:]) and all(out.tokens[b, tau + 1 :] == -1)
        above = 0
        for depth, node in enumerate(path[:tau]):
            assert 1 <= node <= num_nodes[b] and parents[b, node - 1] == above
            assert out.tokens[b, depth] == tokens[b, node - 1]
            above = node
        assert target[b, above, out.tokens[b, tau]] > 0  # the residual's support is within the target's


SPLITS = {  # how the passes over the vocabulary may be split: rows in chunks of 2, or one row at a time in place
    "chunks": ("row_chunks", lambda rows, vocab: [slice(s, min(s + 2, rows)) for s in range(0, rows, 2)]),
    "in_place": ("IN_PLACE_VOCAB", 0),
}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_vocabulary_passes_give_the_same_results_however_split(scheme, split, monkeypatch):
    """At a real V the passes over the vocabulary run a few rows at a time (``row_chunks``), each row read where it
    lies (``IN_PLACE_VOCAB``); small tables are gathered in one chunk. Forced here on small tables: same law, same
    outputs, bit for bit."""
    tables = lawkit.random_tables(4, 3, seed=11)
    generator = torch.Generator().manual_seed(5)
    parts = [treekit.sample_trees(tables, shape, scheme, 15, generator) for shape in [(), (3,), (2, 2), (1, 2, 1)]]
    trees = padded_junk(treekit.concat(parts))
    randomness = Randomness.draw(len(trees), trees.parents.shape[1], 4, dtype=torch.float64, generator=generator)
    live = torch.nn.functional.pad(
        torch.arange(1, trees.parents.shape[1] + 1) <= trees.num_nodes[:, None], (1, 0), value=True
    )

    def run():
        results = []
        for rule in SAMPLED_RULES:
            law = tree_law(*trees.inputs, rule=rule, scheme=scheme, num_nodes=trees.num_nodes)
            out = TREE_VERIFIERS[rule](*trees.inputs, scheme=scheme, num_nodes=trees.num_nodes, randomness=randomness)
            results += [law.node_law, law.final[live], out.tokens]
        return results

    whole = run()
    monkeypatch.setattr(tree_module, *SPLITS[split])
    for one, other in zip(whole, run()):
        assert torch.equal(one, other)


def test_an_empty_tree_is_a_plain_target_step():
    target = random_rows((6, 1, 5), torch.Generator().manual_seed(0))
    empty = torch.zeros(6, 0, dtype=torch.long)
    randomness = Randomness.draw(6, 0, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = verify_tree_block(empty, empty, target, target, scheme="distinct", randomness=randomness)
    assert out.tokens.shape == (6, 1) and out.accepted_nodes.shape == (6, 0)
    assert torch.equal(out.tokens[:, 0], (target[:, 0] / randomness.exponentials).argmax(-1))


# --- validation -----------------------------------------------------------------------------------------------


def one_tree():
    """Root with children 1, 2 (tokens 0, 1); node 3 (token 2) under node 1: valid under both schemes."""
    tokens = torch.tensor([[0, 1, 2]])
    parents = torch.tensor([[0, 0, 1]])
    probs = torch.full((1, 4, 3), 1 / 3, dtype=torch.float64)
    return tokens, parents, probs, probs.clone()


@pytest.mark.parametrize("verifier", [verify_tree_token, verify_tree_block])
def test_duplicate_siblings_are_refused_under_distinct_only(verifier):
    tokens, parents, draft, target = one_tree()
    tokens[0, 1] = 0  # node 2 repeats node 1's token
    with pytest.raises(ValueError, match=r"scheme='distinct' but nodes 1 and 2 of row 0 are siblings"):
        verifier(tokens, parents, draft, target, scheme="distinct")
    verifier(tokens, parents, draft, target, scheme="iid")
    tokens[0, 1], tokens[0, 2] = 1, 0  # cousins may share a token
    verifier(tokens, parents, draft, target, scheme="distinct")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t, p, d, g: (t, p.index_fill(1, torch.tensor([1]), 2), d, g), r"parents\[0, 1\] = 2 \(node 2\)"),
        (lambda t, p, d, g: (t, p.index_fill(1, torch.tensor([0]), 1), d, g), r"parents\[0, 0\] = 1 \(node 1\)"),
        (lambda t, p, d, g: (t, p - 1, d, g), r"parents\[0, 0\] = -1"),
        (lambda t, p, d, g: (t.index_fill(1, torch.tensor([2]), 3), p, d, g), r"draft_tokens\[0, 2\] = 3"),
        (lambda t, p, d, g: (t[0], p, d, g), r"draft_tokens must be a \[B, N\] int64"),
        (lambda t, p, d, g: (t, p[:, :2], d, g), r"parents must be a \[B, N\] = \[1, 3\]"),
        (lambda t, p, d, g: (t, p.int(), d, g), r"parents must be a \[B, N\] = \[1, 3\] int64"),
        (lambda t, p, d, g: (t, p, d, g[:, :3]), r"target_probs must be a \[B, N\+1, V\] = \[1, 4, V\]"),
        (lambda t, p, d, g: (t, p, d[..., :2], g), r"draft_probs must be a \[B, N\+1, V\] = \[1, 4, 3\]"),
        (lambda t, p, d, g: (t, p, d.float(), g), r"draft_probs is torch.float32 but target_probs is torch.float64"),
        (
            lambda t, p, d, g: (t, p, d.index_fill(1, torch.tensor([1]), 0.5), g),
            r"draft_probs\[0, 1\] does not sum to 1",
        ),
        (lambda t, p, d, g: (t, p, d, g.index_fill(1, torch.tensor([3]), 0.5)), r"target_probs\[0, 3\] does not sum"),
        (lambda t, p, d, g: (t, p, torch.tensor([[[1.0, 0, 0]] * 4], dtype=torch.float64), g), r"zero probability"),
    ],
)
def test_bad_input_is_refused_with_a_message_naming_it(change, message):
    tokens, parents, draft, target = change(*one_tree())
    with pytest.raises(ValueError, match=message):
        verify_tree_block(tokens, parents, draft, target, scheme="iid")


def test_other_arguments_are_checked_too():
    tokens, parents, draft, target = one_tree()
    with pytest.raises(TypeError, match="scheme"):  # required: distinct siblings fit both schemes
        verify_tree_block(tokens, parents, draft, target)  # pyright: ignore[reportCallIssue]  (the missing scheme is the test)
    with pytest.raises(ValueError, match=r"scheme must be one of \('iid', 'distinct'\), got 'unique'"):
        verify_tree_token(tokens, parents, draft, target, scheme="unique")
    with pytest.raises(ValueError, match="draft_probs is required"):
        verify_tree_block(tokens, parents, None, target, scheme="iid")  # pyright: ignore[reportArgumentType]  (the None is the test)
    with pytest.raises(ValueError, match=r"num_nodes must lie in \[0, N\] = \[0, 3\]"):
        verify_tree_block(tokens, parents, draft, target, scheme="iid", num_nodes=torch.tensor([4]))
    with pytest.raises(ValueError, match=r"num_nodes must be a \[B\] = \[1\] int64"):
        verify_tree_block(tokens, parents, draft, target, scheme="iid", num_nodes=torch.tensor([3.0]))
    with pytest.raises(ValueError, match=r"randomness.uniforms must have shape \[1, 3\]"):
        verify_tree_block(
            tokens, parents, draft, target, scheme="iid", randomness=Randomness.draw(1, 2, 3, dtype=torch.float64)
        )
    with pytest.raises(ValueError, match=r"rule must be one of \('block', 'token'\)"):
        expected_accepted_tree(tokens, parents, draft, target, rule="tree", scheme="iid")


def test_a_rule_the_tree_code_does_not_implement_is_refused(monkeypatch):
    """The tree's closed forms take the rules they implement, token and block, and refuse any other name rather
    than run it as one of them: greedy (its tree form is ``verify_tree_greedy``), a typo, and a sampled rule
    registered for chains alone (here block verification under another name)."""
    chain_only = dataclasses.replace(rules.RULES["block"], name="chain_only")
    monkeypatch.setitem(rules.RULES, chain_only.name, chain_only)
    monkeypatch.setattr(rules, "SAMPLED_RULES", (*rules.SAMPLED_RULES, chain_only.name))
    tokens, parents, draft, target = one_tree()
    num_nodes = torch.tensor([3])
    accept, _ = tree_acceptance(tokens, parents, draft, target, num_nodes, "block", "iid")
    for name in ("greedy", "blocks", chain_only.name):
        refused = rf"rule must be one of \('block', 'token'\), got '{name}'"
        with pytest.raises(ValueError, match=refused):
            tree_law(tokens, parents, draft, target, rule=name, scheme="iid")
        with pytest.raises(ValueError, match=refused):
            accepted_node_law(parents, accept, num_nodes, name)


def test_a_leafs_draft_row_is_not_read():
    """Only the rows children were drawn from must be distributions: a drafter need not compute a leaf's."""
    tokens, parents, draft, target = one_tree()
    draft[0, 2:] = float("nan")  # nodes 2 and 3 are leaves
    for verifier in (verify_tree_token, verify_tree_block):
        verifier(tokens, parents, draft, target, scheme="distinct")
