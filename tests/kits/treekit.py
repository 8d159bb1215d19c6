"""Exact-law toolkit for tree verification, on lawkit's tiny context-dependent models (``lawkit.Tables``).

A tree *shape* (k_1, .., k_D) gives each node at depth i - 1 up to k_i children: slots numbered breadth first,
which is the order a drafter draws them in (a parent before its children, siblings in order). With it:

- ``all_trees``        every tree the draft can draw for a shape under a scheme, with its drawing probability;
                       under "distinct" a node gets fewer children when its draft's support runs out, so the
                       trees of one shape are ragged (padded to the same node count, ``num_nodes`` per tree);
- ``sample_trees``     trees drawn at random the same way (``torch.Generator``), for the real batched verifiers;
- ``emission_law``     the exact joint law over L tokens of one tree step (law of the accepted node and of the
                       emitted token given each tree, from a ``TreeStep``), completed by exact target sampling;
                       lossless means it equals ``lawkit.target_law``;
- ``sample_emissions`` Monte-Carlo of a real verifier over a batch of trees of several shapes, completed the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from blockspec.drafting.tree import tree_slots
from blockspec.verify.tree_inputs import SCHEMES

from . import lawkit


@dataclass(frozen=True)
class Trees:
    """A batch of T trees as the tree verifiers take them (blockspec/verify/tree_inputs.py), with their probability."""

    draft_tokens: torch.Tensor  # [T, N] int64; -1 on padding
    parents: torch.Tensor  # [T, N] int64; -1 on padding
    draft_probs: torch.Tensor  # [T, N+1, V] float64; 0 on padding
    target_probs: torch.Tensor  # [T, N+1, V] float64; 0 on padding
    num_nodes: torch.Tensor  # [T] int64
    prob: torch.Tensor  # [T] float64: the probability that the drafter draws this tree (1 for sampled trees)

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.draft_tokens, self.parents, self.draft_probs, self.target_probs

    def __len__(self) -> int:
        return len(self.prob)


# (trees) -> (node_law [T, N+1], final [T, N+1, V]): P(accepted node = a | tree) and the law of the token after it.
TreeStep = Callable[[Trees], tuple[torch.Tensor, torch.Tensor]]


def slot_paths(parents: list[int]) -> list[list[int]]:
    """The slots on the path root..s, root excluded, for s = 0..S."""
    paths = [[]]
    for slot, parent in enumerate(parents, start=1):
        paths.append(paths[parent] + [slot])
    return paths


def _draw_slots(tables: lawkit.Tables, shape, scheme: str, choose, count: int, prune=None, stop=None) -> Trees:
    """Draws the slots in order for ``count`` trees at once. ``choose(q, live)`` picks the token of every tree
    from the distribution q [T, V] it is drawn from (``live``: the slot is drawn at all) and returns
    (tree [T'], token [T'], factor [T']) for the trees that go on: several per tree when enumerating, each with
    the probability of its token. Two drafter policies act on a drawn node through its probability under its
    parent's draft, q_at [T'] -> bool: ``stop`` gives it no children (decided before they are drawn: a stopping
    rule), ``prune`` drops it and its subtree from what the verifier sees (after it was drawn: lossy)."""
    assert scheme in SCHEMES
    parents = tree_slots(shape)
    paths = slot_paths(parents)
    tokens = torch.zeros(count, 0, dtype=torch.long)
    drawn = torch.zeros(count, 0, dtype=torch.bool)  # the drafter drew the slot
    kept = torch.zeros(count, 0, dtype=torch.bool)  # ... and shows it to the verifier
    grows = torch.zeros(count, 0, dtype=torch.bool)  # ... and draws its children
    prob = torch.ones(count, dtype=torch.float64)
    for slot, parent in enumerate(parents, start=1):
        parent_grows = grows[:, parent - 1] if parent else torch.ones(len(tokens), dtype=torch.bool)
        first = tables.draft_at(tokens[:, [s - 1 for s in paths[parent]]])  # [T, V]: the parent's draft
        q = first
        if scheme == "distinct":  # without the siblings drawn before (kept or not: they were drawn)
            for sibling in range(slot - 1, 0, -1):
                if parents[sibling - 1] != parent:
                    break
                q = q.scatter(-1, tokens[:, sibling - 1 : sibling], 0.0).where(drawn[:, sibling - 1 : sibling], q)
        mass = q.sum(-1)
        live = parent_grows & (mass > 0)  # a node gets no more children once its draft's support is used up
        tree, token, factor = choose(q / mass.clamp(min=1e-300)[:, None], live)
        live = live[tree]
        q_at = first[tree].gather(-1, token[:, None]).squeeze(-1)
        keep = live if prune is None else live & ~prune(q_at)
        tokens = torch.cat([tokens[tree], token[:, None]], 1)
        drawn = torch.cat([drawn[tree], live[:, None]], 1)
        kept = torch.cat([kept[tree], keep[:, None]], 1)
        grows = torch.cat([grows[tree], (keep if stop is None else keep & ~stop(q_at))[:, None]], 1)
        prob = prob[tree] * factor
        possible = prob > 0
        tokens, drawn, kept, grows, prob = (t[possible] for t in (tokens, drawn, kept, grows, prob))
    return _compact(tables, parents, paths, tokens, kept, prob)


def _compact(tables, parents, paths, tokens, kept, prob) -> Trees:
    """The kept slots renumbered 1..n in slot order (parents first, siblings in order), padded with -1 / 0."""
    count, slots = tokens.shape
    vocab = tables.vocab
    rows_of = [tables.draft_at, tables.target_at]
    slot_rows = [
        torch.stack([at(tokens[:, [s - 1 for s in paths[slot]]]) for slot in range(slots + 1)], 1) for at in rows_of
    ]  # [T, S+1, V]: after each slot's path
    order = torch.sort((~kept).long(), dim=1, stable=True).indices  # kept slots first, in slot order
    new_id = kept.long().cumsum(1) * kept  # [T, S]: 1..n for kept slots
    parent_slot = torch.tensor(parents, dtype=torch.long).expand(count, slots)
    new_parent = torch.where(parent_slot > 0, new_id.gather(1, (parent_slot - 1).clamp(min=0)), 0)
    num_nodes = kept.sum(1)
    live = torch.arange(slots) < num_nodes[:, None]  # [T, S]
    node_tokens = torch.where(live, tokens.gather(1, order), -1)
    node_parents = torch.where(live, new_parent.gather(1, order), -1)
    row_order = torch.cat([torch.zeros(count, 1, dtype=torch.long), order + 1], 1)[..., None].expand(-1, -1, vocab)
    row_live = torch.nn.functional.pad(live, (1, 0), value=True)[..., None]
    draft_probs, target_probs = (torch.where(row_live, rows.gather(1, row_order), 0.0) for rows in slot_rows)
    return Trees(node_tokens, node_parents, draft_probs, target_probs, num_nodes, prob)


def every_token(q, live):
    """A ``choose`` (``_draw_slots``) that enumerates: every draft q [T, V] continues with each token, weighted by
    its probability; a slot not drawn (``live`` [T] False) continues as one copy (token 0) of mass 1."""
    count, vocab = q.shape
    drawn = torch.arange(count).repeat_interleave(vocab)
    token = torch.arange(vocab).repeat(count)
    factor = torch.where(live[drawn], q.flatten(), (token == 0).double())
    return drawn, token, factor


def one_token(generator: torch.Generator):
    """A ``choose`` (``_draw_slots``) that samples one token per draft q [T, V], as a drafter would (weight 1); a
    slot not drawn takes any token and stays absent."""

    def choose(q, live):
        q = torch.where(live[:, None], q, 1.0)
        token = torch.multinomial(q, 1, generator=generator).squeeze(1)
        return torch.arange(len(q)), token, torch.ones(len(q), dtype=torch.float64)

    return choose


def all_trees(tables: lawkit.Tables, shape: tuple[int, ...], scheme: str, *, prune=None, stop=None) -> Trees:
    """Every tree of ``shape`` the draft can draw under ``scheme``, with its probability (they sum to 1); ``prune``
    and ``stop`` as in ``_draw_slots``."""
    trees = _draw_slots(tables, shape, scheme, every_token, 1, prune, stop)
    assert abs(float(trees.prob.sum()) - 1.0) < 1e-12
    return trees


def sample_trees(
    tables: lawkit.Tables, shape: tuple[int, ...], scheme: str, count: int, generator: torch.Generator
) -> Trees:
    """``count`` trees drawn from the draft as a drafter would (each with prob 1)."""
    return _draw_slots(tables, shape, scheme, one_token(generator), count)


def pad_nodes(trees: Trees, nodes: int) -> Trees:
    """The same trees padded to ``nodes`` columns (ragged batches of several shapes)."""
    extra = nodes - trees.draft_tokens.shape[1]
    return Trees(
        torch.nn.functional.pad(trees.draft_tokens, (0, extra), value=-1),
        torch.nn.functional.pad(trees.parents, (0, extra), value=-1),
        torch.nn.functional.pad(trees.draft_probs, (0, 0, 0, extra)),
        torch.nn.functional.pad(trees.target_probs, (0, 0, 0, extra)),
        trees.num_nodes,
        trees.prob,
    )


def concat(parts: list[Trees]) -> Trees:
    nodes = max(part.draft_tokens.shape[1] for part in parts)
    padded = [pad_nodes(part, nodes) for part in parts]
    return Trees(*(torch.cat([getattr(p, name) for p in padded]) for name in Trees.__dataclass_fields__))


def node_codes(trees: Trees, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth [T, N+1], code [T, N+1]): each node's path tokens as a base-V number (first token most significant)."""
    count, nodes = trees.draft_tokens.shape
    depth = torch.zeros(count, nodes + 1, dtype=torch.long)
    code = torch.zeros(count, nodes + 1, dtype=torch.long)
    for node in range(1, nodes + 1):
        live = node <= trees.num_nodes
        parent = trees.parents[:, node - 1].clamp(min=0)
        depth[:, node] = torch.where(live, depth.gather(1, parent[:, None]).squeeze(1) + 1, 0)
        code[:, node] = torch.where(
            live, code.gather(1, parent[:, None]).squeeze(1) * vocab + trees.draft_tokens[:, node - 1], 0
        )
    return depth, code


def emission_law(tables: lawkit.Tables, trees: Trees, step: TreeStep, length: int) -> torch.Tensor:
    """Exact joint law [V] * length of one tree step (every tree weighted by its probability) followed by exact
    target sampling: the path of the accepted node, the token after it, then the target's own continuation."""
    vocab = tables.vocab
    node_law, final = step(trees)
    live = torch.nn.functional.pad(torch.arange(1, node_law.shape[1]) <= trees.num_nodes[:, None], (1, 0), value=True)
    assert float(node_law[~live].abs().sum()) == 0.0, "the step accepts a padding node"
    assert torch.allclose(node_law.sum(-1), torch.ones(len(trees), dtype=torch.float64), atol=1e-12, rtol=0)
    mass = torch.where(live[..., None], trees.prob[:, None, None] * node_law[..., None] * final, 0.0)  # [T, N+1, V]
    depth, code = node_codes(trees, vocab)
    emitted = code[..., None] * vocab + torch.arange(vocab)  # [T, N+1, V]: the prefix (path, y) in base V
    law = torch.zeros([vocab] * length, dtype=torch.float64)
    for tau in range(length):
        at = depth == tau
        prefix = torch.zeros(vocab ** (tau + 1), dtype=torch.float64)
        prefix.index_add_(0, emitted[at].flatten(), mass[at].flatten())
        law += complete(tables, prefix, tau + 1, length)
    return law


def complete(tables: lawkit.Tables, prefix: torch.Tensor, known: int, length: int) -> torch.Tensor:
    """A law over the first ``known`` tokens ([V**known], base V) extended to ``length`` tokens by the target."""
    vocab = tables.vocab
    law = prefix.reshape([vocab] * known)
    for position in range(known, length):  # times target(s_position | s_<position)
        law = law.unsqueeze(-1) * tables.target[position].reshape([vocab] * (position + 1))
    return law


def sample_emissions(
    tables: lawkit.Tables,
    trees: Trees,
    verifier: Callable,
    length: int,
    generator: torch.Generator,
    *,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Counts [V] * length of one batched call ``verifier(*trees.inputs, num_nodes=, generator=)`` on ``trees``,
    each emission completed with exact target samples."""
    draft_tokens, parents, draft_probs, target_probs = trees.inputs
    out = verifier(
        draft_tokens,
        parents,
        draft_probs.to(dtype),
        target_probs.to(dtype),
        num_nodes=trees.num_nodes,
        generator=generator,
    )
    sequences = torch.nn.functional.pad(out.tokens, (0, max(0, length - out.tokens.shape[1])), value=-1)[:, :length]
    for position in range(length):
        missing = position > out.num_accepted
        if bool(missing.any()):
            context = sequences[missing, :position]
            sequences[missing, position] = torch.multinomial(tables.target_at(context), 1, generator=generator).squeeze(
                1
            )
    return lawkit.joint_counts(sequences, tables.vocab)
