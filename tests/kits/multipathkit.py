"""Exact-law toolkit for multi-path verification (blockspec/verify/multipath.py), on lawkit's tiny tables.

A step drafts k paths of L tokens, under a drawing scheme:
    "iid"       k independent paths from the draft;
    "distinct"  the first tokens without replacement (each from the root's draft renormalised without the earlier
                paths' first tokens; fewer paths when the draft's support runs out), then each path on its own.
With it:

- ``all_paths``      every set of k paths the draft can draw, with its probability (they sum to 1);
- ``sample_paths``   paths drawn at random the same way, for the real batched verifier;
- ``as_trees``       a prefix tree (``multipath.paths_to_tree``) with the paths' probabilities, for ``treekit``;
- ``separate_tree``  the k paths as k separate branches of the root (no merging), node (j, i) in column j * L + i;
- ``expected_emitted``  the exact E[tokens emitted per step] of multi-path verification, over every set of paths,
                     and ``chain_expected_emitted`` the same for block verification of one chain;
- ``similar_tables`` tables with a realistic shape: a peaked target and a draft that is a noisy copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.verify import expected_accepted
from blockspec.verify.multipath import PathTree, expected_accepted_multipath

from . import lawkit, treekit

PATH_SCHEMES = ("iid", "distinct")


@dataclass(frozen=True)
class Paths:
    """T sets of k paths as ``verify_multipath`` takes them, with the probability that the drafter draws each."""

    tokens: torch.Tensor  # [T, k, L] int64 (0 on padding paths)
    draft_probs: torch.Tensor  # [T, k, L, V] float64
    target_probs: torch.Tensor  # [T, k, L+1, V] float64
    num_paths: torch.Tensor  # [T] int64
    prob: torch.Tensor  # [T] float64 (1 for sampled paths)

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.tokens, self.draft_probs, self.target_probs

    def __len__(self) -> int:
        return len(self.prob)


def _draw(tables: lawkit.Tables, paths: int, length: int, scheme: str, choose, count: int) -> Paths:
    """Draws the tokens path by path, position by position, for ``count`` sets at once. ``choose(q, live)`` as in
    ``treekit._draw_slots``: (set [T'], token [T'], factor [T']) for the sets that go on."""
    assert scheme in PATH_SCHEMES
    tokens = torch.zeros(count, 0, dtype=torch.long)  # [T, j * L + i]: path-major
    live = torch.zeros(count, 0, dtype=torch.bool)  # [T, j]: path j is drawn
    prob = torch.ones(count, dtype=torch.float64)
    for j in range(paths):
        for i in range(length):
            q = tables.draft_at(tokens[:, j * length : j * length + i])  # [T, V]
            if i == 0 and scheme == "distinct":  # without the earlier paths' first tokens
                for earlier in range(j):
                    first = tokens[:, earlier * length : earlier * length + 1]
                    q = q.scatter(-1, first, 0.0).where(live[:, earlier : earlier + 1], q)
            mass = q.sum(-1)
            if i == 0:
                before = live[:, -1] if j else torch.ones(len(tokens), dtype=torch.bool)
                live = torch.cat([live, (before & (mass > 0))[:, None]], 1)
            chosen, token, factor = choose(q / mass.clamp(min=1e-300)[:, None], live[:, j])
            tokens = torch.cat([tokens[chosen], token[:, None]], 1)
            live, prob = live[chosen], prob[chosen] * factor
            possible = prob > 0
            tokens, live, prob = tokens[possible], live[possible], prob[possible]
    tokens = tokens.reshape(-1, paths, length)
    draft_probs, target_probs = tables.block_inputs(tokens.reshape(-1, length))
    vocab = tables.vocab
    return Paths(
        tokens,
        draft_probs.reshape(-1, paths, length, vocab),
        target_probs.reshape(-1, paths, length + 1, vocab),
        live.sum(1),
        prob,
    )


def all_paths(tables: lawkit.Tables, paths: int, length: int, scheme: str) -> Paths:
    """Every set of ``paths`` paths of ``length`` tokens the draft can draw under ``scheme``, with its probability."""
    drawn = _draw(tables, paths, length, scheme, treekit.every_token, 1)
    assert abs(float(drawn.prob.sum()) - 1.0) < 1e-12
    return drawn


def sample_paths(
    tables: lawkit.Tables, paths: int, length: int, scheme: str, count: int, generator: torch.Generator
) -> Paths:
    """``count`` sets of paths drawn from the draft as a drafter would (each with prob 1)."""
    return _draw(tables, paths, length, scheme, treekit.one_token(generator), count)


def as_trees(tree: PathTree, prob: torch.Tensor) -> treekit.Trees:
    return treekit.Trees(*tree.inputs, tree.num_nodes, prob)


def separate_tree(drawn: Paths) -> treekit.Trees:
    """The paths as separate branches of the root, duplicates kept: node (j, i) in column j * L + i, its parent the
    node before it on path j (the root for i = 0). Padding paths come last, so the live nodes are 1..num_paths * L."""
    count, paths, length = drawn.tokens.shape
    vocab = drawn.draft_probs.shape[-1]
    nodes = paths * length
    live = torch.arange(nodes) < (drawn.num_paths * length)[:, None]
    column = torch.arange(nodes)
    parents = torch.where(column % length == 0, 0, column).expand(count, nodes)  # node j * L + i has parent j * L + i
    draft_after = torch.nn.functional.pad(drawn.draft_probs[:, :, 1:], (0, 0, 0, 1)).reshape(count, nodes, vocab)
    target_after = drawn.target_probs[:, :, 1:].reshape(count, nodes, vocab)
    return treekit.Trees(
        torch.where(live, drawn.tokens.reshape(count, nodes), -1),
        torch.where(live, parents, -1),
        torch.cat([drawn.draft_probs[:, :1, 0], torch.where(live[..., None], draft_after, 0.0)], 1),
        torch.cat([drawn.target_probs[:, :1, 0], torch.where(live[..., None], target_after, 0.0)], 1),
        live.sum(1),
        drawn.prob,
    )


def expected_emitted(tables: lawkit.Tables, paths: int, length: int, scheme: str, rule: str = "block") -> float:
    """1 + E[tau] of multi-path verification, exactly: averaged over every set of paths under ``scheme``."""
    drawn = all_paths(tables, paths, length, scheme)
    tau = expected_accepted_multipath(*drawn.inputs, rule=rule, num_paths=drawn.num_paths)
    return 1.0 + float((drawn.prob * tau).sum())


def chain_expected_emitted(tables: lawkit.Tables, width: int, rule: str = "block") -> float:
    """1 + E[tau] of one chain of ``width`` tokens verified by ``rule``, exactly: averaged over every block."""
    blocks = lawkit.all_blocks(tables.vocab, width)
    draft_probs, target_probs = tables.block_inputs(blocks)
    prob = draft_probs.gather(-1, blocks[..., None]).squeeze(-1).prod(-1)
    possible = prob > 0
    tau = expected_accepted(blocks[possible], draft_probs[possible], target_probs[possible], rule)
    return 1.0 + float((prob[possible] * tau).sum())


def similar_tables(vocab: int, depth: int, seed: int, *, spread: float, noise: float) -> lawkit.Tables:
    """Context-dependent tables shaped like a language model pair: the target's logits are N(0, spread^2) (a large
    spread gives a peaked, Zipf-like row), the draft's are the same logits plus N(0, noise^2) (a smaller model that
    mostly agrees with the target)."""
    generator = torch.Generator().manual_seed(seed)
    target, draft = [], []
    for length in range(depth + 1):
        logits = spread * torch.randn(vocab**length, vocab, generator=generator, dtype=torch.float64)
        target.append(logits.softmax(-1))
        draft.append((logits + noise * torch.randn(logits.shape, generator=generator, dtype=torch.float64)).softmax(-1))
    return lawkit.Tables(vocab, target, draft)
