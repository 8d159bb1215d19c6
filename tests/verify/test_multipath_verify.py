"""The batched multi-path verifier (``verify_multipath``) against the tree and chain verifiers, by Monte-Carlo, and
its input contract.

decisions   the prefix tree's verifier with the same randomness; with one path, verify_block's / verify_token's
prefix tree nodes numbered path by path, shared prefixes merged, padding paths absent
output      tokens [B, L+1]; accepted_path's first tau tokens are the accepted ones (the lowest such path)
layout      a row's output does not depend on the junk in its padding paths
law         joint chi-square of the real batched verifier against the target, with a lossy variant of computed power
validation  refusals name the argument

Laws are checked exactly, by enumerating every set of paths, in tests/verify/test_multipath_exact.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kits import lawkit, multipathkit

from blockspec.verify import Randomness, multipath_law, paths_to_tree, verify_block, verify_multipath, verify_token
from blockspec.verify.tree import tree_law, verify_tree_block, verify_tree_token

TREE_VERIFIERS = {"block": verify_tree_block, "token": verify_tree_token}
CHAIN_VERIFIERS = {"block": verify_block, "token": verify_token}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def sampled(vocab=5, paths=3, length=3, scheme="iid", count=2000, seed=0, dtype=torch.float64):
    tables = lawkit.random_tables(vocab, length, seed=seed)
    drawn = multipathkit.sample_paths(tables, paths, length, scheme, count, torch.Generator().manual_seed(seed))
    return drawn.tokens, drawn.draft_probs.to(dtype), drawn.target_probs.to(dtype), drawn.num_paths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path_rule", TREE_VERIFIERS)
@pytest.mark.parametrize("scheme", multipathkit.PATH_SCHEMES)
def test_multipath_makes_the_prefix_trees_decisions(scheme, path_rule, dtype):
    tokens, draft, target, num_paths = sampled(scheme=scheme, dtype=DTYPES[dtype])
    batch, paths, length = tokens.shape
    randomness = Randomness.draw(
        batch, paths * length, draft.shape[-1], dtype=DTYPES[dtype], generator=torch.Generator()
    )
    out = verify_multipath(tokens, draft, target, rule=path_rule, num_paths=num_paths, randomness=randomness)
    tree = paths_to_tree(tokens, draft, target, num_paths=num_paths)
    alone = TREE_VERIFIERS[path_rule](*tree.inputs, scheme="distinct", num_nodes=tree.num_nodes, randomness=randomness)
    assert out.tokens.shape == (batch, length + 1)
    assert torch.equal(out.num_accepted, alone.num_accepted)
    assert torch.equal(out.tokens[:, : alone.tokens.shape[1]], alone.tokens)
    rows = torch.arange(batch)
    tau = out.num_accepted
    for t in range(1, length + 1):  # the accepted prefix is accepted_path's, and no lower path has it
        at = tau == t
        kept = tokens[rows[at], out.accepted_path[at], :t]
        assert torch.equal(kept, out.tokens[at, :t])
        lower = torch.arange(paths) < out.accepted_path[at, None]  # [rows, k]
        same = (tokens[at, :, :t] == out.tokens[at, None, :t]).all(-1)
        assert not bool((lower & same).any())
    assert bool((out.accepted_path[tau == 0] == 0).all())
    assert 0 < float(tau.double().mean()) < length


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path_rule", CHAIN_VERIFIERS)
def test_one_path_makes_the_chain_rules_decisions(path_rule, dtype):
    """k = 1 is block (token) verification of the path, decision for decision with the same randomness."""
    tokens, draft, target, _ = sampled(paths=1, length=4, dtype=DTYPES[dtype])
    batch, _, length = tokens.shape
    randomness = Randomness.draw(batch, length, draft.shape[-1], dtype=DTYPES[dtype], generator=torch.Generator())
    out = verify_multipath(tokens, draft, target, rule=path_rule, randomness=randomness)
    chain = CHAIN_VERIFIERS[path_rule](tokens[:, 0], draft[:, 0], target[:, 0], randomness=randomness)
    assert torch.equal(out.num_accepted, chain.num_accepted)
    assert torch.equal(out.tokens, chain.tokens)


def test_the_prefix_tree_merges_shared_prefixes():
    """Paths (a, b), (a, c), (d, b), (a, b): nodes a, a b, a c, d, d b, numbered path by path; the fourth path
    adds nothing; each node reads the rows after its own prefix."""
    vocab = 5
    tokens = torch.tensor([[[0, 1], [0, 2], [3, 1], [0, 1]]])
    draft = torch.full((1, 4, 2, vocab), 1.0 / vocab, dtype=torch.float64)
    target = torch.rand(1, 4, 3, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    target /= target.sum(-1, keepdim=True)
    tree = paths_to_tree(tokens, draft, target)
    assert tree.num_nodes.tolist() == [5]
    assert tree.draft_tokens[0, :5].tolist() == [0, 1, 2, 3, 1]
    assert tree.parents[0, :5].tolist() == [0, 1, 1, 0, 4]
    assert tree.path_nodes[0].tolist() == [[1, 2], [1, 3], [4, 5], [1, 2]]
    for node, (path, position) in {0: (0, 0), 1: (0, 1), 2: (0, 2), 3: (1, 2), 4: (2, 1), 5: (2, 2)}.items():
        assert torch.equal(tree.target_probs[0, node], target[0, path, position])
    assert bool((tree.draft_tokens[0, 5:] == -1).all())


def test_padding_paths_are_ignored():
    """A row's output does not depend on what its padding paths hold (tokens, rows), nor its law."""
    tokens, draft, target, num_paths = sampled(scheme="distinct", vocab=3, count=500)
    assert int(num_paths.min()) < tokens.shape[1]  # the root's support runs out on some rows
    pad = (torch.arange(tokens.shape[1]) >= num_paths[:, None])[..., None]
    junk_tokens = torch.where(pad, 7, tokens)  # outside the vocabulary even
    junk_draft = torch.where(pad[..., None], float("nan"), draft)
    junk_target = torch.where(pad[..., None], float("nan"), target)
    junk_target[:, 0, 0] = target[:, 0, 0]  # the context's row is read from path 0 whatever num_paths is
    batch, paths, length = tokens.shape
    randomness = Randomness.draw(batch, paths * length, 3, dtype=torch.float64, generator=torch.Generator())
    clean = verify_multipath(tokens, draft, target, num_paths=num_paths, randomness=randomness)
    junk = verify_multipath(junk_tokens, junk_draft, junk_target, num_paths=num_paths, randomness=randomness)
    assert torch.equal(clean.tokens, junk.tokens) and torch.equal(clean.accepted_path, junk.accepted_path)


def test_no_path_is_a_plain_target_step():
    tokens, draft, target, _ = sampled(count=4)
    out = verify_multipath(tokens, draft, target, num_paths=torch.zeros(4, dtype=torch.long))
    assert out.num_accepted.tolist() == [0] * 4 and bool((out.tokens[:, 1:] == -1).all())


# --- the law of the real batched verifier ---------------------------------------------------------------------


@pytest.mark.parametrize("scheme", multipathkit.PATH_SCHEMES)
def test_multipath_chi_square_with_a_negative_control(scheme):
    """V = 4, k = 3, L = 2: the joint law of 3 tokens from one batched call (each emission completed by exact target
    sampling) against the target's, at alpha = 1e-4, outcomes expected fewer than 5 times pooled; the prefix tree
    verified as i.i.d. siblings fails the same test, with a power computed from its exact law."""
    vocab, paths, length, samples = 4, 3, 2, 40_000
    tables = lawkit.random_tables(vocab, length, seed=21, zeros=False)
    exact = lawkit.target_law(tables, length + 1)
    groups = lawkit.sparse_cell_groups(exact, samples)
    exact_cells = lawkit.pool_cells(exact, groups)
    power = lawkit.detection_power(
        exact_cells, lawkit.pool_cells(wrong_law(tables, paths, length, scheme), groups), samples
    )
    assert power > 0.99, f"the control is undetectable at N = {samples}: power {power:.3f}"
    generator = torch.Generator().manual_seed(5)
    drawn = multipathkit.sample_paths(tables, paths, length, scheme, samples, generator)
    right = verify_multipath(*drawn.inputs, num_paths=drawn.num_paths, generator=generator)
    result = lawkit.chi_square(lawkit.pool_cells(complete(tables, right, length + 1, generator), groups), exact_cells)
    tree = paths_to_tree(*drawn.inputs, num_paths=drawn.num_paths)
    broken = verify_tree_block(*tree.inputs, scheme="iid", num_nodes=tree.num_nodes, generator=generator)
    control = lawkit.chi_square(lawkit.pool_cells(complete(tables, broken, length + 1, generator), groups), exact_cells)
    print(
        f"{scheme}: statistic {result.statistic:.1f}, control {control.statistic:.1f}, threshold "
        f"{result.threshold:.1f} ({result.dof} dof); control power {power:.3f}"
    )
    assert result.passed, result
    assert not control.passed, control


def wrong_law(tables: lawkit.Tables, paths: int, length: int, scheme: str) -> torch.Tensor:
    """The exact law of the control: the prefix tree verified with the tree scheme "iid"."""
    from kits import treekit

    drawn = multipathkit.all_paths(tables, paths, length, scheme)
    tree, _ = multipath_law(*drawn.inputs, rule="block", num_paths=drawn.num_paths)
    law = tree_law(*tree.inputs, rule="block", scheme="iid", num_nodes=tree.num_nodes)
    return treekit.emission_law(
        tables, multipathkit.as_trees(tree, drawn.prob), lambda _: (law.node_law, law.final), length + 1
    )


def complete(tables: lawkit.Tables, out, length: int, generator: torch.Generator) -> torch.Tensor:
    sequences = out.tokens[:, :length].clone()
    for position in range(length):
        missing = position > out.num_accepted
        if bool(missing.any()):
            sequences[missing, position] = torch.multinomial(
                tables.target_at(sequences[missing, :position]), 1, generator=generator
            ).squeeze(1)
    return lawkit.joint_counts(sequences, tables.vocab)


# --- validation ------------------------------------------------------------------------------------------------


def valid(**change) -> dict[str, Any]:
    tokens, draft, target, num_paths = sampled(count=3, vocab=4)
    arguments: dict[str, Any] = {
        "path_tokens": tokens,
        "path_draft_probs": draft,
        "path_target_probs": target,
        "num_paths": num_paths,
    }
    arguments.update(change)
    return arguments


def call(**change):
    arguments = valid(**change)
    return verify_multipath(
        arguments["path_tokens"],
        arguments["path_draft_probs"],
        arguments["path_target_probs"],
        num_paths=arguments["num_paths"],
        rule=arguments.get("rule", "block"),
        randomness=arguments.get("randomness"),
    )


def test_valid_inputs_pass():
    call()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {"path_tokens": a["path_tokens"][:, :, 0]}, r"path_tokens must be a \[B, k, L\] int64"),
        (lambda a: {"path_tokens": a["path_tokens"][:, :, :0]}, "at least one path of at least one token"),
        (lambda a: {"path_target_probs": a["path_target_probs"][:, :, :-1]}, r"path_target_probs must have shape"),
        (lambda a: {"path_draft_probs": a["path_draft_probs"][..., :-1]}, r"path_draft_probs must be a \[B, k, L, V\]"),
        (lambda a: {"path_draft_probs": a["path_draft_probs"].float()}, "path_draft_probs is torch.float32"),
        (lambda a: {"num_paths": a["num_paths"] + 1}, r"num_paths must lie in \[0, k\]"),
        (lambda a: {"num_paths": a["num_paths"].int()}, r"num_paths must be a \[B\] = \[3\] int64"),
        (lambda a: {"path_tokens": a["path_tokens"].index_fill(2, torch.tensor([1]), 4)}, r"= 4 is outside the vocab"),
        (
            lambda a: {"path_target_probs": a["path_target_probs"] * 2},
            r"path_target_probs\[:, 0\]\[0, 0\] does not sum",
        ),
        (lambda a: {"rule": "greedy"}, "rule must be one of"),
        (
            lambda a: {"randomness": Randomness.draw(3, 3, 4, dtype=torch.float64)},
            r"randomness.uniforms must have shape \[3, 9\]",
        ),
    ],
)
def test_bad_input_is_refused_with_a_message_naming_it(change, message):
    with pytest.raises(ValueError, match=message):
        call(**change(valid()))


def test_a_token_the_draft_cannot_have_drawn_is_refused():
    arguments = valid()
    draft = arguments["path_draft_probs"].clone()
    token = int(arguments["path_tokens"][1, 2, 1])
    draft[1, 2, 1] = torch.nn.functional.one_hot(torch.tensor((token + 1) % 4), 4).double()
    with pytest.raises(ValueError, match=r"path_tokens\[1, 2, 1\] = .* has zero probability under path_draft_probs"):
        call(path_draft_probs=draft)
