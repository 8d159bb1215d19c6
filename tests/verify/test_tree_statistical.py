"""Statistical tests: Monte-Carlo of the REAL batched tree verifiers against the target's exact joint law.

Each test draws a batch of trees of six shapes at once, (), (2), (1, 1), (3, 1), (2, 2), (1, 2) (0 to 6 nodes,
depth 0 to 2, rows shuffled: ragged trees in one call), from a toy context-dependent draft (tests/kits/lawkit.py,
V = 4), verifies them in ONE call of the real verifier with a seeded generator, completes every emission to 3
tokens with exact target samples, and compares the counts of the JOINT 3-token outcome with the target's exact law
by Pearson's chi-square at alpha = 1e-4, outcomes expected fewer than 5 times pooled (lawkit.sparse_cell_groups).

Negative controls, with the same tables, trees and N: distinct trees verified as i.i.d. ones (both rules), and the
traversal whose parent residual is max(P - Q, 0) instead of max(w P - Q, 0), its mass Z included
(``residual_coefficients`` swapped). Each must fail the test; their exact laws (tests/kits/treekit.py) give the
test's power against them, asserted >= 0.99 before sampling, and their samples must pass against their own exact
law (so the failure is the predicted one).
"""

from __future__ import annotations

import functools

import pytest
import torch
from kits import lawkit, treekit

from blockspec.verify import tree
from blockspec.verify.tree import tree_law, verify_tree_block, verify_tree_token
from blockspec.verify.tree_inputs import SCHEMES

ALPHA = 1e-4  # false-alarm probability of every chi-square test here
MIN_POWER = 0.99  # required power against each negative control
# V = 4, tables seed 3 (of 0..7, the one where the unscaled residual errs most), peaked 0.5: the smallest
# possible-outcome probability is 3.5e-4 (8.4 expected at N); joint-law errors (max abs) 1.6e-2 for distinct trees
# verified as iid, 3.6e-2 to 3.8e-2 for the unscaled residual: the test rejects them with probability 0.99 from
# N = 6.1e3 to 7.1e3, and 2e3 (pooled as here), and ~1 at this N.
VOCAB, DEPTH, TABLES_SEED, PEAKED = 4, 2, 3, 0.5
SHAPES = [(), (2,), (1, 1), (3, 1), (2, 2), (1, 2)]
PER_SHAPE = 4_000
SAMPLES = PER_SHAPE * len(SHAPES)
LENGTH = DEPTH + 1
TREE_VERIFIERS = {"token": verify_tree_token, "block": verify_tree_block}


@functools.cache
def tables() -> lawkit.Tables:
    return lawkit.random_tables(VOCAB, DEPTH, TABLES_SEED, peaked=PEAKED)


def ragged_batch(scheme: str, seed: int) -> treekit.Trees:
    """PER_SHAPE trees of every shape, drawn by the draft, padded to one node count and shuffled."""
    generator = torch.Generator().manual_seed(seed)
    trees = treekit.concat([treekit.sample_trees(tables(), shape, scheme, PER_SHAPE, generator) for shape in SHAPES])
    order = torch.randperm(len(trees), generator=generator)
    return treekit.Trees(*(getattr(trees, name)[order] for name in treekit.Trees.__dataclass_fields__))


def mixture_law(rule: str, drawn: str, verified: str) -> torch.Tensor:
    """The exact joint law of a ``ragged_batch(drawn)`` (every shape in equal share) verified as ``verified``."""

    def step(trees):
        law = tree_law(*trees.inputs, rule=rule, scheme=verified, num_nodes=trees.num_nodes)
        return law.node_law, law.final

    laws = [treekit.emission_law(tables(), treekit.all_trees(tables(), shape, drawn), step, LENGTH) for shape in SHAPES]
    return torch.stack(laws).mean(0)


def pooled_test(counts: torch.Tensor, law: torch.Tensor, groups: torch.Tensor) -> lawkit.ChiSquare:
    return lawkit.chi_square(lawkit.pool_cells(counts, groups), lawkit.pool_cells(law, groups), ALPHA)


def describe(label: str, result: lawkit.ChiSquare, extra: str = "") -> str:
    line = (
        f"{label}: chi2 = {result.statistic:.1f}, threshold {result.threshold:.1f} (dof {result.dof}, alpha "
        f"{ALPHA:g}, N {SAMPLES}), {result.impossible} samples on zero-probability outcomes"
    )
    line = f"{line}; {extra}" if extra else line
    print(line)  # visible with pytest -s
    return line


def sample(verifier, scheme: str, verified: str, dtype=torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    verify = functools.partial(verifier, scheme=verified)
    counts = treekit.sample_emissions(tables(), ragged_batch(scheme, seed=0), verify, LENGTH, generator, dtype=dtype)
    assert int(counts.sum()) == SAMPLES
    return counts


# --- the real verifiers pass ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "dtype"),
    [
        pytest.param("token", torch.float64, id="token-float64"),
        pytest.param("block", torch.float64, id="block-float64"),
        pytest.param("block", torch.float32, id="block-float32"),
    ],
)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_ragged_tree_batches_match_the_target_law(scheme, rule, dtype):
    law = lawkit.target_law(tables(), LENGTH)
    assert lawkit.max_abs_error(mixture_law(rule, scheme, scheme), law) < 1e-12  # the exact law it should follow
    groups = lawkit.sparse_cell_groups(law, SAMPLES)
    result = pooled_test(sample(TREE_VERIFIERS[rule], scheme, scheme, dtype), law, groups)
    assert result.passed, describe(f"{rule} {scheme} {dtype}", result)
    describe(f"{rule} {scheme} {dtype}", result)


# --- negative controls: the same test at the same N must reject a broken verifier -----------------------------


def unscaled_residual(weight, scale, shift, inverse_rest):
    """BROKEN: a rejection leaves the parent max(P - Q, 0), without w_a (and w_a is updated with that mass)."""
    return ORIGINAL_COEFFICIENTS(torch.ones_like(weight), scale, shift, inverse_rest)


ORIGINAL_COEFFICIENTS = tree.residual_coefficients
BROKEN = {  # name -> (rule, scheme drawn, scheme the verifier is told, swapped residual or None)
    "distinct trees verified as iid, token": ("token", "distinct", "iid", None),
    "distinct trees verified as iid, block": ("block", "distinct", "iid", None),
    "block unscaled residual, iid": ("block", "iid", "iid", unscaled_residual),
    "block unscaled residual, distinct": ("block", "distinct", "distinct", unscaled_residual),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_variant_fails_the_same_test(name, monkeypatch):
    rule, drawn, verified, residual = BROKEN[name]
    if residual is not None:
        monkeypatch.setattr(tree, "residual_coefficients", residual)
    law = lawkit.target_law(tables(), LENGTH)
    groups = lawkit.sparse_cell_groups(law, SAMPLES)
    wrong_law = mixture_law(rule, drawn, verified)
    power = lawkit.detection_power(lawkit.pool_cells(law, groups), lawkit.pool_cells(wrong_law, groups), SAMPLES, ALPHA)
    error = lawkit.max_abs_error(law, wrong_law)
    assert power >= MIN_POWER, f"{name}: power {power:.3g} < {MIN_POWER} at N {SAMPLES} (law error {error:.2g})"

    counts = sample(TREE_VERIFIERS[rule], drawn, verified)
    result = pooled_test(counts, law, groups)
    message = describe(f"NEGATIVE CONTROL {name}", result, f"power {power:.6f}, max joint-law error {error:.3g}")
    assert not result.passed, "the broken verifier PASSED the test that should catch it: " + message

    # Its samples follow its own exact law: the power above is the power against what it actually does.
    own = pooled_test(counts, wrong_law, lawkit.sparse_cell_groups(wrong_law, SAMPLES))
    assert own.passed, describe(f"{name} against its own exact law", own)
