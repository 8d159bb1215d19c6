"""Tree (multi-draft) verification: a step drafts a tree of tokens and one target forward scores every node. The
tensors and their checks are in tree_inputs.py; tau is the depth of the accepted node, and a step emits its path,
then one more token (tau + 1 tokens).

The sampled rules (``TREE_RULES``), each lossless for either scheme (the emitted tokens follow the target's law):
    "token"  recursive rejection sampling, node by node (Miao et al., SpecInfer, arXiv 2305.09781; without
             replacement: Jeon et al. 2024, Recursive Speculative Decoding); on a chain it is ``verify_token``
    "block"  Traversal Verification (Weng et al., arXiv 2505.12398): leaves first, each judged with its whole
             path; on a chain it is Sun et al.'s Algorithm 2, ``verify_block``
Each is a deterministic part (``tree_acceptance``: per-node acceptance probabilities and final distributions)
plus a thin random part (one uniform per node, one exponential race for the last token); ``tree_law`` integrates
over the random part exactly.

Cost. The rules rewrite a node's target row each time one of its children is rejected. Here rows are rarely copied:
every update has the form P_a <- normalize(max(w P_a - Q_a, 0)), and a positive part of a positive part is one
positive part, so a node's row stays ``scale * max(P - shift * Q, 0)`` over its own input rows P, Q (or a row
written out, see Rounding; ``residual_coefficients``). A rejection then costs one reduction over V (its mass;
with distinct siblings a second one, the draft mass left), batched over every node judged at the same step, and
the verifiers build the final row of the accepted node only.

Rounding. The closed form is the same function as the node-by-node update, not the same float arithmetic. Two
numerical guards keep float32 as close to the float64 law as the node-by-node update: the draft mass left after
rejected distinct siblings is summed over the tokens kept (``_draft_left``; never 1 - the mass removed, which is 0
when a peaked float32 row holds 1.0f), and a node whose scale passes ``RESCALE_LIMIT`` has its row written out
normalised and starts its closed form afresh from it (``_materialise``; P - shift Q cancels as scale grows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Randomness, VerifyOutput, argmax, draw_uniforms, race_rows, row_chunks
from .tree_inputs import SCHEMES, check_choice, node_mask, prepare_tree, require_draft

# The sampled rules with a tree form here. Every function taking a rule checks it against these: the branches below
# tell "token" from "block" only, so any other name, a sampled rule registered for chains included, is refused.
TREE_RULES = ("block", "token")


@dataclass(frozen=True)
class TreeVerifyOutput(VerifyOutput):
    """tokens [B, D+1] (the accepted path's tokens, then the extra token; -1 after), num_accepted [B] = tau, and
    the accepted path's nodes, D = the deepest node of the batch."""

    accepted_nodes: torch.Tensor  # [B, D] int64: the node at depth 1..tau of the accepted path; -1 after


@dataclass(frozen=True)
class TreeLaw:
    """The exact law of one tree verification given the tree: which node is accepted, then which token follows."""

    node_law: torch.Tensor  # [B, N+1] float: P(accepted node = a | tree); each row sums to 1, 0 on padding
    final: torch.Tensor  # [B, N+1, V] float: the law of the token emitted after stopping at a (each row sums to 1)


# --- the tree's layout -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Where every node sits. Column a of the [B, N+1] tensors is node a, column 0 the root; padding nodes are
    childless and belong to no parent."""

    real: torch.Tensor  # [B, N+1] bool: the root and nodes 1..num_nodes
    parent: torch.Tensor  # [B, N+1] int64: parent(a); 0 for the root and padding
    rank: torch.Tensor  # [B, N+1] int64: the number of a's siblings drawn before it; 0 for the root and padding
    earlier: torch.Tensor  # [B, N, N] bool: [b, c - 1, s - 1] = s is a sibling of c drawn before it
    children: torch.Tensor  # [B, N+1, J] int64: a's children in drawing order, 0 after its last (J >= 1)
    num_children: torch.Tensor  # [B, N+1] int64
    depth: torch.Tensor  # [B, N+1] int64: 0 for the root and padding
    max_depth: int  # depth.max(): every "level by level" loop below runs this many rounds


def node_depths(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """[B, N+1] int64: the depth of every node (root 0; padding 0), level by level: after k rounds every node
    within k steps of the root has its depth."""
    batch, nodes = parents.shape
    live = node_mask(num_nodes, nodes)
    parent = F.pad(parents.where(live, 0), (1, 0))  # [B, N+1]
    child = F.pad(live, (1, 0))  # [B, N+1]: a real node other than the root
    depth = torch.zeros_like(parent)
    for _ in range(nodes):
        deeper = torch.where(child, depth.gather(1, parent) + 1, 0)
        if torch.equal(deeper, depth):
            break
        depth = deeper
    return depth


def _layout(parents: torch.Tensor, num_nodes: torch.Tensor) -> _Layout:
    batch, nodes = parents.shape
    live = node_mask(num_nodes, nodes)  # [B, N]
    parent = F.pad(parents.where(live, 0), (1, 0))  # [B, N+1]
    siblings = (parent[:, 1:, None] == parent[:, None, 1:]) & live[:, :, None] & live[:, None, :]  # [B, N, N]
    earlier = siblings.tril(-1)  # [b, c, s]: s < c
    rank = F.pad(earlier.sum(-1), (1, 0))  # [B, N+1]
    num_children = torch.zeros_like(parent).scatter_add_(1, parent[:, 1:], live.long())
    width = max(int(num_children.max()), 1) if batch else 1
    # Node c goes to slot rank(c) of its parent's row; padding to one spare slot at the end, dropped.
    slot = torch.where(live, parent[:, 1:] * width + rank[:, 1:], (nodes + 1) * width)  # [B, N]
    node_ids = torch.arange(1, nodes + 1, device=parents.device).expand(batch, nodes)
    children = torch.zeros(batch, (nodes + 1) * width + 1, dtype=torch.long, device=parents.device)
    children = children.scatter_(1, slot, node_ids)[:, :-1].view(batch, nodes + 1, width)
    depth = node_depths(parents, num_nodes)
    return _Layout(
        F.pad(live, (1, 0), value=True),
        parent,
        rank,
        earlier,
        children,
        num_children,
        depth,
        int(depth.max()) if depth.numel() else 0,
    )


# --- one rejection, in closed form over a node's own rows ---------------------------------------------------------


def child_log_weight(parent_log_weight: torch.Tensor, target_at: torch.Tensor, draft_at: torch.Tensor):
    """log w_c = min(0, log w_a + log P_a[x_c] - log Q_a[x_c]), elementwise: the sequence-level weight of child c.

    In log space like ``block_weights`` (the same expression, so a chain gives Sun et al.'s w bit for bit).
    """
    return (parent_log_weight + (target_at.log() - draft_at.log())).clamp(max=0.0)


def residual_coefficients(weight: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, inverse_rest: torch.Tensor):
    """(lift, drop), elementwise: a rejection's residual max(w P_a - Q_a, 0) is max(lift P - drop Q, 0).

    Here P_a = scale * max(P - shift Q, 0) is node a's current target row over its input rows P, Q, and
    Q_a = inverse_rest * Q its current draft row (distinct siblings: Q without the tokens of a's rejected children,
    renormalised; both only on the tokens still in Q_a's support, where the formula holds). Since
    max(l max(y, 0) - d, 0) = max(l y - d, 0) for l, d >= 0: lift = w scale and drop = lift shift + inverse_rest.
    A node never rejected (scale 1, shift 0) gives (w, inverse_rest) exactly: Sun et al.'s max(w P - Q, 0) on a chain.
    """
    lift = weight * scale
    return lift, lift * shift + inverse_rest


def weight_after_rejection(weight: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """w_a <- Z / (Z + 1 - w_a), elementwise: a node's weight once a child's subtree is rejected (Sun et al.'s h on a
    chain).

    1 - w first, as in ``block_acceptance``, so the result stays <= 1 after rounding. Guard: the denominator is 0
    only if w_a = 1 and Z = 0, i.e. P_a = Q_a: then every child's w is 1, none is ever rejected, and any value is
    exact (1).
    """
    denominator = mass + (1.0 - weight)
    return torch.where(denominator > 0, mass / denominator.clamp(min=torch.finfo(weight.dtype).tiny), 1.0)


class _Targets:
    """Every node's target row P as the closed form reads it: target_probs' row, or the row ``_materialise`` wrote
    for the node. Written rows go to a buffer allocated uninitialised on the first write (not a copy of
    target_probs: only the rows written are ever touched)."""

    def __init__(self, probs: torch.Tensor):  # [B, N+1, V]
        self.probs = probs
        self.own: torch.Tensor | None = None  # [B, N+1, V]; read only where ``written``
        self.written = torch.zeros(probs.shape[:2], dtype=torch.bool, device=probs.device)  # [B, N+1]
        self.pairs: set[tuple[int, int]] = set()  # the written (b, a), for ``row`` without a device sync

    def row(self, b: int, a: int) -> torch.Tensor:  # [V], a view
        return self.own[b, a] if self.own is not None and (b, a) in self.pairs else self.probs[b, a]

    def gather(self, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:  # [M, V], a copy
        out = self.probs[rows, nodes]
        if self.own is not None:
            mine = self.written[rows, nodes].nonzero().squeeze(1)
            out[mine] = self.own[rows[mine], nodes[mine]]
        return out

    def at(self, rows: torch.Tensor, nodes: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # P[x], broadcast
        value = self.probs[rows, nodes, tokens]
        if self.own is None:
            return value
        return torch.where(self.written[rows, nodes], self.own[rows, nodes, tokens], value)

    def write(self, rows: torch.Tensor, nodes: torch.Tensor, values: torch.Tensor):  # values [M, V]
        if self.own is None:
            self.own = torch.empty_like(self.probs)
        self.own[rows, nodes] = values
        self.written[rows, nodes] = True
        self.pairs.update(zip(rows.tolist(), nodes.tolist()))


# Rows of at least this many entries are read where they lie, one (row, node) at a time: gathering them first would be
# one more pass over each. Smaller rows are gathered [M, V] at once (many small rows: the tests' enumerations).
IN_PLACE_VOCAB = 1 << 14


def _residual(target: _Targets, draft_probs, rows, nodes, lift, drop, removed=None, plain=None) -> torch.Tensor:
    """max(lift * P - drop * Q, 0) [M, V] over the rows P, Q of node ``nodes`` [M] in batch row ``rows`` [M] (lift,
    drop [M]); P itself where ``plain`` [M] is True (a leaf: its draft row is not read).

    ``removed`` = (tokens, values, valid), each [M, J]: distinct siblings rejected before, out of Q's support, where
    the row holds ``values`` instead (the entries with valid False point at a token the row keeps as it is).
    """
    count, vocab = len(rows), draft_probs.shape[-1]
    if vocab >= IN_PLACE_VOCAB:
        residual = torch.empty(count, vocab, dtype=draft_probs.dtype, device=draft_probs.device)
        as_is = [False] * count if plain is None else plain.tolist()
        for i, (b, a) in enumerate(zip(rows.tolist(), nodes.tolist())):
            if as_is[i]:
                residual[i] = target.row(b, a)
            else:
                torch.mul(target.row(b, a), lift[i], out=residual[i])
                residual[i].addcmul_(draft_probs[b, a], drop[i], value=-1.0)
    else:
        probs = target.gather(rows, nodes)  # [M, V], a copy
        residual = probs.mul(lift[:, None])
        residual.addcmul_(draft_probs[rows, nodes], drop[:, None], value=-1.0)
        if plain is not None:
            residual = torch.where(plain[:, None], probs, residual)
    if removed is not None:
        tokens, values, valid = removed
        residual.scatter_(1, tokens, torch.where(valid, values, residual.gather(1, tokens)))
    return residual.clamp_(min=0.0)


def _siblings_before(layout: _Layout, child_tokens, excess, rows, nodes, count, keep_token, factor):
    """``_residual``'s ``removed`` for M nodes: their first ``count`` [M] children, at ``factor`` [M] times their
    frozen excess; the other slots point at ``keep_token`` [M], a token not removed. None for i.i.d. siblings."""
    if excess is None:
        return None
    children = layout.children[rows, nodes]  # [M, J]
    valid = torch.arange(children.shape[1], device=rows.device) < count[:, None]
    tokens = torch.where(valid, child_tokens[rows, nodes], keep_token[:, None])
    return tokens, factor[:, None] * excess[rows[:, None], children], valid


def _masses(target: _Targets, draft_probs, rows, nodes, lift, drop, removed) -> torch.Tensor:
    """The sums [M] of ``_residual``'s rows, row chunk by row chunk (see ``row_chunks``)."""
    mass = torch.empty_like(lift)
    for part in row_chunks(len(rows), draft_probs.shape[-1]):
        some = None if removed is None else tuple(t[part] for t in removed)
        mass[part] = _residual(target, draft_probs, rows[part], nodes[part], lift[part], drop[part], some).sum(-1)
    return mass


def _draft_left(draft_probs, rows, nodes, tokens) -> torch.Tensor:
    """The draft mass [M] left on the row Q of node ``nodes`` [M] in batch row ``rows`` [M] once ``tokens`` [M, J]
    are out of its support: a sum over the tokens kept, never 1 - the sum over the tokens removed. Numerical guard:
    in float32 a peaked row can hold 1.0f at its top token while the others stay > 0, and need not sum to 1 at all
    (validation allows a tolerance); the difference would be 0 or off by that tolerance, and the next sibling's law
    with it."""
    left = torch.empty(len(rows), dtype=draft_probs.dtype, device=draft_probs.device)
    vocab = draft_probs.shape[-1]
    if vocab >= IN_PLACE_VOCAB:  # one row at a time, as ``_residual``
        for i, (b, a) in enumerate(zip(rows.tolist(), nodes.tolist())):
            left[i] = draft_probs[b, a].index_fill(0, tokens[i], 0.0).sum()
    else:
        for part in row_chunks(len(rows), vocab):
            left[part] = draft_probs[rows[part], nodes[part]].scatter_(1, tokens[part], 0.0).sum(-1)
    return left


def _materialise(
    target: _Targets, draft_probs, layout: _Layout, child_tokens, excess, rows, nodes, rank, lift, drop, gone
):
    """Write node a's new target row normalize(max(lift P - drop Q, 0)) (``gone`` as in ``_residual``) as its row
    P in ``target``, for the M nodes ``nodes`` [M] in batch rows ``rows`` [M]: from then on its closed form starts
    afresh from that row (scale 1, shift 0). Distinct siblings: the frozen excess of its children rejected so far
    (ranks 0..``rank`` [M]) becomes the new row's value at their tokens."""
    for part in row_chunks(len(rows), draft_probs.shape[-1]):
        some = None if gone is None else tuple(t[part] for t in gone)
        residual = _residual(target, draft_probs, rows[part], nodes[part], lift[part], drop[part], some)
        target.write(rows[part], nodes[part], residual / residual.sum(-1, keepdim=True))
    if excess is not None:
        children = layout.children[rows, nodes]  # [M, J]
        done = torch.arange(children.shape[1], device=rows.device) <= rank[:, None]
        values = target.at(rows[:, None], nodes[:, None], child_tokens[rows, nodes])  # [M, J]
        excess[rows[:, None], children] = torch.where(done, values, excess[rows[:, None], children])


# --- the deterministic part ------------------------------------------------------------------------------------

# A node's state, columns of ``_Rows.state``: its target row is scale * max(P - shift Q, 0) (P: its input row, or the
# row ``_materialise`` wrote), its draft row Q / rest (rest = the draft mass left on Q's tokens other than its rejected
# distinct children's, summed), w = exp(log_weight); and the coefficients of its last child's rejection,
# max(lift P - drop Q, 0), not applied to scale and shift (``_final_rows`` builds that row).
SCALE, SHIFT, REST, LOG_WEIGHT, LIFT, DROP = range(6)

# ``_sweep`` writes a node's row out once its scale passes this (see the numerical guard there). Measured at
# V = 151,936 in float32 (12 seeded ragged trees, test_tree_float32.py's construction), the final rows' L1 error vs
# float64 stays within 1.6x of the node-by-node update's at 16 (2.8x at 32, 30x at 1000 on one case); it costs about
# 3 written rows per call at B = 8 on the 4x3 tree of verify_speed, none at B = 1.
RESCALE_LIMIT = 16.0


@dataclass(frozen=True)
class _Rows:
    """Every node's final row (its target row once all its children are rejected; a leaf's: P), in closed form: the
    last rejection's residual max(lift P - drop Q, 0), or, where that residual is empty, the row before it."""

    layout: _Layout
    child_tokens: torch.Tensor  # [B, N+1, J] int64: the token of a's j-th child (0 after its last)
    state: torch.Tensor  # [B, N+1, 6]: columns SCALE .. DROP
    excess: torch.Tensor | None  # [B, N+1], distinct siblings: max(P_a - shift Q_a, 0) at x_c for each node c, frozen
    # when its parent a rejected it: x_c is out of Q_a's support then, and P_a[x_c] = scale * excess from then on
    target: _Targets  # the rows P: target_probs', or the ones ``_materialise`` wrote


def _schedule(layout: _Layout, rule: str, token, draft_probs):
    """The judgements, step by step: per step, for the M (row, node a) judging a child c at that step,
    (row, node, rank of c, x_c, c is a's last child, Q[x_c] of the input row, k) each [M], the first k of them
    needing the mass of their rejection (the rest: the last child of a node whose final row ``_final_rows`` builds).

    Node a judges its j-th child at step start(a) + j. A child needs its parent's state after the siblings before it
    were rejected; under the block rule also its parent's own w, known once the grandparent judged the parent. The
    token rule's nodes all start at step 0.
    """
    start = torch.zeros_like(layout.parent)
    if rule == "block":
        for _ in range(layout.max_depth):  # level by level from the root
            start = torch.where(layout.depth > 0, start.gather(1, layout.parent) + layout.rank + 1, 0)
    steps = int(torch.where(layout.num_children > 0, start + layout.num_children, 0).max()) if start.numel() else 0
    judged = torch.arange(steps, device=start.device)[:, None, None] - start  # [T, B, N+1]: the rank a judges
    step, row, node = (layout.real & (judged >= 0) & (judged < layout.num_children)).nonzero(as_tuple=True)  # [E]
    rank = judged[step, row, node]
    last = rank == layout.num_children[row, node] - 1
    # A rejection's mass Z is needed where a later sibling is judged against its result, and for the last child
    # under the block rule (w_a <- Z / (Z + 1 - w_a) is a's acceptance; the root's w stays 1).
    needed = ~last if rule == "token" else ~last | (node > 0)
    order = torch.argsort(2 * step + (~needed).long(), stable=True)  # in each step, the needed ones first
    step, row, node, rank, last, needed = (t[order] for t in (step, row, node, rank, last, needed))
    x = token[row, layout.children[row, node, rank]]
    per_step = torch.bincount(step, minlength=steps).tolist()
    needed_per_step = torch.bincount(step[needed], minlength=steps).tolist()
    events = (row, node, rank, x, last, draft_probs[row, node, x])
    return list(zip(*(torch.split(t, per_step) for t in events), needed_per_step))


def _sweep(draft_tokens, parents, draft_probs, target_probs, num_nodes, rule, scheme) -> tuple[torch.Tensor, _Rows]:
    """accept [B, N] (0 on padding) and the closed form of every node's final row; see ``tree_acceptance``."""
    layout = _layout(parents, num_nodes)
    batch, nodes = draft_tokens.shape
    columns = nodes + 1
    token = F.pad(draft_tokens.clamp(0, target_probs.shape[-1] - 1), (1, 0))  # [B, N+1]: x_c in column c
    width = layout.children.shape[-1]
    child_tokens = token.gather(1, layout.children.view(batch, columns * width)).view(batch, columns, width)
    state = torch.zeros(batch * columns, 6, dtype=target_probs.dtype, device=target_probs.device)
    state[:, SCALE] = state[:, REST] = 1.0  # P_a, Q_a as given; w_root = 1 (log 0)
    excess = torch.zeros(batch, columns, dtype=state.dtype, device=state.device) if scheme == "distinct" else None
    accept = torch.zeros(batch, columns, dtype=state.dtype, device=state.device)  # token
    target = _Targets(target_probs)  # the rows P of the closed forms; ``_materialise`` writes some
    for row, node, rank, x, last, draft_x, first in _schedule(
        layout, rule, token, draft_probs
    ):  # one step, [M] each: the nodes differ, so do the children
        here = row * columns + node  # flat index of node a
        kid = row * columns + layout.children[row, node, rank]
        scale, shift, rest, log_weight = state[here, :LIFT].unbind(1)
        inverse_rest = torch.where(rest > 0, 1.0 / rest, 0.0)  # guard: no draft mass left, no sibling follows
        # Node a's current rows at x_c (x_c is in Q_a's support: distinct siblings differ).
        target_x = target.at(row, node, x)  # P[x_c]: the input row's, or the row ``_materialise`` wrote
        target_now = scale * (target_x - shift * draft_x).clamp(min=0.0)
        draft_now = draft_x * inverse_rest
        if rule == "token":
            accept.view(-1)[kid] = (target_now / draft_now).clamp(max=1.0)
            weight = torch.ones_like(scale)  # the token rule starts afresh at every node: w = 1
        else:
            weight = log_weight.exp()
            state[kid, LOG_WEIGHT] = child_log_weight(log_weight, target_now, draft_now)
        # Reject x_c: P_a <- normalize(max(w P_a - Q_a, 0)), Z its mass (for the first ``first`` only).
        lift, drop = residual_coefficients(weight, scale, shift, inverse_rest)
        mass = torch.zeros_like(lift)
        some = slice(0, first)
        gone = _siblings_before(layout, child_tokens, excess, row[some], node[some], rank[some], x[some], lift[some])
        mass[some] = _masses(target, draft_probs, row[some], node[some], lift[some], drop[some], gone)
        grew = ~last & (mass > 0)  # guard: Z = 0 keeps P_a (under the block rule w_a becomes 0 then)
        scale = torch.where(grew, lift / mass, scale)
        shift = torch.where(grew, drop / lift, shift)
        if rule == "block":
            needed = torch.arange(len(mass), device=mass.device) < first
            log_weight = torch.where(needed, weight_after_rejection(weight, mass).log(), log_weight)
        # Numerical guard: scale * max(P - shift Q, 0) loses about log2(scale) bits to the cancellation in
        # P - shift Q (float32: eps * scale relative), and scale grows as 1 / (the product of the masses). Past
        # RESCALE_LIMIT the node's row is written out normalised and the closed form starts afresh from it, which
        # keeps the error near the node-by-node update's.
        big = (grew & (scale > RESCALE_LIMIT))[:first].nonzero().squeeze(1)
        if len(big):
            gone_big = None if gone is None else tuple(t[big] for t in gone)
            _materialise(
                target,
                draft_probs,
                layout,
                child_tokens,
                excess,
                row[big],
                node[big],
                rank[big],
                lift[big],
                drop[big],
                gone_big,
            )
            scale[big], shift[big] = 1.0, 0.0
        if excess is not None:  # Q_a[x_c] <- 0, renormalised, after P_a's update; P_a[x_c] only scales from now on
            fresh = (target_x - shift * draft_x).clamp(min=0.0)
            if len(big):  # P_a[x_c] is the written row's entry: scale 1
                fresh[big] = target.at(row[big], node[big], x[big])
            excess.view(-1)[kid] = fresh
            # Q_a's mass left without its rejected children's tokens, summed (``_draft_left``); the last child's
            # rest is never read.
            more = (~last).nonzero().squeeze(1)  # all among the first ``first``
            if len(more):
                done = torch.arange(width, device=row.device) <= rank[more, None]
                removed = torch.where(done, child_tokens[row[more], node[more]], x[more, None])  # [M', J]
                rest[more] = _draft_left(draft_probs, row[more], node[more], removed)
        state[here] = torch.stack([scale, shift, rest, log_weight, lift, drop], 1)
    state = state.view(batch, columns, 6)
    real = layout.real[:, 1:]
    accept = state[:, 1:, LOG_WEIGHT].exp() if rule == "block" else accept[:, 1:]  # block: the final w of each node
    return torch.where(real, accept, 0.0), _Rows(layout, child_tokens, state, excess, target)


def _final_rows(draft_probs, closed: _Rows, rows, nodes, normalize: bool) -> torch.Tensor:
    """[M, V]: the final row of node ``nodes`` [M] in batch row ``rows`` [M], normalised or not (for a race)."""
    layout, child_tokens, excess, target = closed.layout, closed.child_tokens, closed.excess, closed.target
    count = layout.num_children[rows, nodes]  # [M]
    leaf = count == 0
    scale, shift, _, _, lift, drop = closed.state[rows, nodes].unbind(1)
    last_token = child_tokens[rows, nodes].gather(1, (count - 1).clamp(min=0)[:, None]).squeeze(1)
    gone = _siblings_before(layout, child_tokens, excess, rows, nodes, count - 1, last_token, lift)
    final = _residual(target, draft_probs, rows, nodes, lift, drop, gone, plain=leaf)
    mass = final.sum(-1)  # [M]
    if normalize:  # a leaf's row is P as given
        final = torch.where(leaf[:, None], final, final / mass.clamp(min=torch.finfo(mass.dtype).tiny)[:, None])
    # Guard: an empty last residual keeps the row before it (a distribution, so normalised already).
    kept = (~leaf & ~(mass > 0)).nonzero().squeeze(1)
    if len(kept):
        rows, nodes, count, last_token = rows[kept], nodes[kept], count[kept], last_token[kept]
        scale, shift = scale[kept], shift[kept]
        gone = _siblings_before(layout, child_tokens, excess, rows, nodes, count - 1, last_token, scale)
        final[kept] = _residual(target, draft_probs, rows, nodes, scale, scale * shift, gone)
    return final


def tree_acceptance(
    draft_tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64
    draft_probs: torch.Tensor,  # [B, N+1, V]
    target_probs: torch.Tensor,  # [B, N+1, V]
    num_nodes: torch.Tensor,  # [B] int64
    rule: str,
    scheme: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic part of a rule: (accept [B, N], final [B, N+1, V]); 0 and junk on padding.

    Every node a holds (P_a, Q_a, w_a), starting from (target_probs[a], draft_probs[a], w from its parent).
    Children are taken in drawing order; each is judged against its parent's state after the siblings before
    it were rejected, then rejected in turn (if it is accepted, the parent's state is never used again):
        token:  accept_c = min(1, P_a[x_c] / Q_a[x_c]);                P_a <- normalize(max(P_a - Q_a, 0))
        block:  w_c = min(1, w_a P_a[x_c] / Q_a[x_c]);  with Z = sum max(w_a P_a - Q_a, 0),
                P_a <- normalize(max(w_a P_a - Q_a, 0)),  w_a <- Z / (Z + 1 - w_a)
        distinct siblings, both rules, after P_a's update:  Q_a[x_c] <- 0, renormalised
    A parent's update depends on its child's token only, never on the child's subtree, so one pass that judges a
    node's children after the node itself gives Traversal Verification's leaf-first states: the final (w_a, P_a) of
    a node is the one it has when the traversal reaches it with all its children rejected. Hence, per node:
        token: accept = the probability of accepting the node once its parent is reached and its earlier siblings
               rejected;  block: accept = the final w_a, the probability of accepting the path to a when the
               traversal reaches a.   final = P_a after all of a's children were rejected (the token emitted
               after stopping at a; the target's own distribution for a leaf).
    The nodes that do not wait on each other are judged at the same step (the j-th child of every node, under the
    block rule once the node's own w is known), with P_a in closed form (``residual_coefficients``).
    """
    check_choice("rule", rule, TREE_RULES)
    check_choice("scheme", scheme, SCHEMES)
    accept, closed = _sweep(draft_tokens, parents, draft_probs, target_probs, num_nodes, rule, scheme)
    batch, columns, vocab = target_probs.shape
    final = torch.empty(target_probs.shape, dtype=target_probs.dtype, device=target_probs.device)
    flat = final.view(-1, vocab)  # [B * (N+1), V]: pair i is node i % (N+1) of row i // (N+1)
    every = torch.arange(batch * columns, device=target_probs.device)
    for part in row_chunks(batch * columns, vocab):
        pair = every[part]
        flat[part] = _final_rows(draft_probs, closed, pair // columns, pair % columns, normalize=True)
    return accept, final


# --- the law given the tree, and the random part ------------------------------------------------------------


def accepted_node_law(parents: torch.Tensor, accept: torch.Tensor, num_nodes: torch.Tensor, rule: str):
    """P(accepted node = a | tree), [B, N+1], from ``tree_acceptance``'s ``accept`` [B, N].

    token: top-down. reached(c) = reached(a) * prod_{earlier siblings s} (1 - accept_s) * accept_c, and a is the
           accepted node when it is reached and all its children rejected.
    block: the traversal visits the nodes in post-order (children in drawing order, then the node) and stops at
           the first u < accept. With fail(c) = prod over c's subtree of (1 - accept): entry(c) = entry(a) *
           prod_{earlier siblings s} fail(s), and P(stop at a) = entry(a) * prod_{children c} fail(c) * accept_a.
    """
    check_choice("rule", rule, TREE_RULES)
    batch, nodes = parents.shape
    live = node_mask(num_nodes, nodes)
    rows = torch.arange(batch, device=parents.device)
    accept = F.pad(accept.where(live, 0.0), (1, 0), value=1.0)  # [B, N+1]; the root: 1
    parent_of = F.pad(parents.where(live, 0), (1, 0))  # [B, N+1]; padding -> the root
    if rule == "block":
        fail = 1.0 - accept  # becomes fail(c), subtree by subtree: children (higher index) first
        for child in range(nodes, 0, -1):
            fail[rows, parent_of[:, child]] *= torch.where(live[:, child - 1], fail[:, child], 1.0)
    # run[a]: P(a is reached and every child of a seen so far is rejected); block: with its subtree
    run = torch.zeros_like(accept)
    run[:, 0] = 1.0
    for child in range(1, nodes + 1):
        parent, real = parent_of[:, child], live[:, child - 1]
        passed = fail[:, child] if rule == "block" else 1.0 - accept[:, child]
        reached = run[rows, parent] * (accept[:, child] if rule == "token" else 1.0)
        run[:, child] = torch.where(real, reached, 0.0)
        run[rows, parent] *= torch.where(real, passed, 1.0)
    return run * accept if rule == "block" else run


def _subtree_hits(layout: _Layout, hits: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: some node of c's subtree (c included) has a hit [B, N]; the leaf-first traversal enters c's
    subtree to stop there. Level by level, each round passing a hit one step up."""
    found = F.pad(hits & layout.real[:, 1:], (1, 0))  # [B, N+1]; column 0 (the root) is not read
    for _ in range(layout.max_depth - 1):
        up = torch.zeros_like(layout.parent).scatter_add_(1, layout.parent[:, 1:], found[:, 1:].long())
        found = found | (up > 0)
    return found[:, 1:]


def _walk(layout: _Layout, move: torch.Tensor) -> torch.Tensor:
    """The accepted path as a mask [B, N+1] (the root included): from the root, repeatedly go to the FIRST child c
    (drawing order) with move[c] [B, N]. A node is on it when it moves, no sibling before it does, and its parent
    is on it."""
    move = move & layout.real[:, 1:]
    first = move & ~(layout.earlier & move[:, None, :]).any(-1)  # [B, N]
    on_path = F.pad(first, (1, 0), value=True)
    for _ in range(layout.max_depth - 1):  # level by level from the root
        on_path = on_path & on_path.gather(1, layout.parent)
    return on_path


def _path_to(layout: _Layout, node: torch.Tensor) -> torch.Tensor:
    """The path root..node [B] as a mask [B, N+1], level by level up from the node."""
    on_path = torch.arange(layout.parent.shape[1], device=node.device) == node[:, None]
    for _ in range(layout.max_depth):
        up = torch.zeros_like(layout.parent).scatter_add_(1, layout.parent[:, 1:], on_path[:, 1:].long())
        on_path = on_path | (up > 0)
    return on_path


def _emit_tree(draft_tokens: torch.Tensor, layout: _Layout, on_path: torch.Tensor, last: torch.Tensor):
    """The path (``on_path`` [B, N+1], from ``_walk`` or ``_path_to``), its tokens, then ``last`` [B]; -1 padding."""
    batch = draft_tokens.shape[0]
    max_depth = layout.max_depth
    tau = on_path.sum(-1) - 1  # [B]: the root is on every path
    nodes = torch.arange(on_path.shape[1], device=draft_tokens.device).expand(batch, -1)
    slot = torch.where(on_path & (layout.depth > 0), layout.depth - 1, max_depth)  # the rest: a spare column
    path = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=draft_tokens.device)
    path = path.scatter_(1, slot, nodes)[:, :max_depth]
    node_tokens = F.pad(draft_tokens, (1, 0), value=-1)  # [B, N+1]: node a's token in column a
    tokens = torch.where(path >= 0, node_tokens.gather(1, path.clamp(min=0)), -1)
    tokens = F.pad(tokens, (0, 1), value=-1).scatter(1, tau[:, None], last[:, None])
    return TreeVerifyOutput(tokens=tokens, num_accepted=tau, accepted_nodes=path)


# --- the verifiers ------------------------------------------------------------------------------------------


def verify_tree_token(
    draft_tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64, parent(a) < a
    draft_probs: torch.Tensor,  # [B, N+1, V] float32/64
    target_probs: torch.Tensor,  # [B, N+1, V] same dtype
    *,
    scheme: str,  # "iid" or "distinct": how the siblings were drawn
    num_nodes: torch.Tensor | None = None,  # [B] int64 in [0, N]; default N
    generator: torch.Generator | None = None,
    randomness: Randomness | None = None,  # uniforms [B, N] (one per node), exponentials [B, V]
    validate: bool = True,
) -> TreeVerifyOutput:
    """Recursive rejection sampling: from the root, try the children in drawing order, accept child c with
    probability min(1, P[x_c] / Q[x_c]) and move to it; on a rejection P <- normalize(max(P - Q, 0)) (and, for
    distinct siblings, Q[x_c] <- 0, renormalised). When every child of the current node is rejected, or it has
    none, emit y ~ P. Lossless for either scheme; on a chain, ``verify_token`` with the same randomness.
    """
    return _verify_sampled(
        "token", draft_tokens, parents, draft_probs, target_probs, scheme, num_nodes, generator, randomness, validate
    )


def verify_tree_block(
    draft_tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64, parent(a) < a
    draft_probs: torch.Tensor,  # [B, N+1, V] float32/64
    target_probs: torch.Tensor,  # [B, N+1, V] same dtype
    *,
    scheme: str,  # "iid" or "distinct": how the siblings were drawn
    num_nodes: torch.Tensor | None = None,  # [B] int64 in [0, N]; default N
    generator: torch.Generator | None = None,
    randomness: Randomness | None = None,  # uniforms [B, N] (one per node), exponentials [B, V]
    validate: bool = True,
) -> TreeVerifyOutput:
    """Traversal Verification (Weng et al., arXiv 2505.12398): visit the nodes leaves first (post-order, children
    in drawing order); at node g accept the whole path root..g if u_g < w_g, else reject g, update its parent
    (``tree_acceptance``) and go on; the root is accepted last. Then emit y ~ P at the accepted node.

    Lossless for either scheme, and a sequence-level rule: on a chain it is Sun et al.'s Algorithm 2 and makes
    ``verify_block``'s decisions with the same randomness (the uniforms are consumed deepest first; the last
    token shares the exponentials). Its expected accepted depth is at least the token rule's on average over
    trees (not for every tree).
    """
    return _verify_sampled(
        "block", draft_tokens, parents, draft_probs, target_probs, scheme, num_nodes, generator, randomness, validate
    )


def _verify_sampled(
    rule, draft_tokens, parents, draft_probs, target_probs, scheme, num_nodes, generator, randomness, validate
) -> TreeVerifyOutput:
    require_draft(draft_probs)
    num_nodes = prepare_tree(draft_tokens, parents, draft_probs, target_probs, num_nodes, scheme, randomness, validate)
    check_choice("scheme", scheme, SCHEMES)
    uniforms = draw_uniforms(randomness, generator, target_probs, draft_tokens.shape[1])  # [B, N]
    accept, closed = _sweep(draft_tokens, parents, draft_probs, target_probs, num_nodes, rule, scheme)
    hits = uniforms < accept  # P(u < a) = a for u ~ U[0, 1); a = 0 (padding) never hits
    layout = closed.layout
    on_path = _walk(layout, hits if rule == "token" else _subtree_hits(layout, hits))  # [B, N+1]
    node = torch.where(on_path, layout.depth, -1).argmax(-1)  # [B]: the path's deepest node
    # The last token, from the accepted node's final row only, row chunk by row chunk (see ``row_chunks``).
    batch, _, vocab = target_probs.shape
    last = torch.empty_like(node)
    every = torch.arange(batch, device=node.device)
    for part in row_chunks(batch, vocab):
        final = _final_rows(draft_probs, closed, every[part], node[part], normalize=False)
        last[part] = race_rows(final, part, randomness, generator)
    return _emit_tree(draft_tokens, layout, on_path, last)


def verify_tree_greedy(
    draft_tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64, parent(a) < a
    draft_probs: torch.Tensor | None,  # [B, N+1, V] or None: not needed by this rule
    target_probs: torch.Tensor,  # [B, N+1, V]
    *,
    scheme: str | None = None,  # checked when given (distinct siblings); the rule does not need it
    num_nodes: torch.Tensor | None = None,  # [B] int64 in [0, N]; default N
    generator: torch.Generator | None = None,  # unused: the rule is deterministic
    randomness: Randomness | None = None,  # unused
    validate: bool = True,
) -> TreeVerifyOutput:
    """Temperature 0: accept the deepest node whose whole path matches the target's argmax (the first in drawing
    order among equally deep ones: duplicate i.i.d. siblings), then emit argmax P at it.

    The emitted tokens equal plain greedy decoding of the target; argmax ties go to the lowest id.
    """
    num_nodes = prepare_tree(draft_tokens, parents, draft_probs, target_probs, num_nodes, scheme, randomness, validate)
    layout = _layout(parents, num_nodes)
    choice = argmax(target_probs)  # [B, N+1]
    agrees = F.pad(draft_tokens == choice.gather(1, layout.parent[:, 1:]), (1, 0), value=True)  # the root agrees
    matched = agrees & layout.real
    for _ in range(layout.max_depth - 1):  # level by level from the root: the whole path agrees
        matched = matched & matched.gather(1, layout.parent)
    node = torch.where(matched, layout.depth, -1).argmax(-1)  # the first maximum: lowest index among the deepest
    last = choice.gather(1, node[:, None]).squeeze(1)
    return _emit_tree(draft_tokens, layout, _path_to(layout, node), last)


# --- closed forms given a tree ------------------------------------------------------------------------------


def tree_law(
    draft_tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64
    draft_probs: torch.Tensor,  # [B, N+1, V]
    target_probs: torch.Tensor,  # [B, N+1, V]
    *,
    rule: str,  # "token" or "block"
    scheme: str,  # "iid" or "distinct"
    num_nodes: torch.Tensor | None = None,  # [B] int64
    validate: bool = True,
) -> TreeLaw:
    """The exact law of ``verify_tree_token`` / ``verify_tree_block`` given the tree (integrated over the uniforms
    and the exponentials): which node is accepted, and the token emitted after it."""
    require_draft(draft_probs)
    num_nodes = prepare_tree(draft_tokens, parents, draft_probs, target_probs, num_nodes, scheme, None, validate)
    accept, final = tree_acceptance(draft_tokens, parents, draft_probs, target_probs, num_nodes, rule, scheme)
    return TreeLaw(accepted_node_law(parents, accept, num_nodes, rule), final)


def expected_accepted_tree(
    draft_tokens: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64
    draft_probs: torch.Tensor,  # [B, N+1, V]
    target_probs: torch.Tensor,  # [B, N+1, V]
    *,
    rule: str,  # "token" or "block"
    scheme: str,  # "iid" or "distinct"
    num_nodes: torch.Tensor | None = None,  # [B] int64
    validate: bool = True,
) -> torch.Tensor:
    """E[tau | tree] [B] float, exactly, in O(N V) per row: sum_a P(accepted node = a) * depth(a)."""
    require_draft(draft_probs)
    num_nodes = prepare_tree(draft_tokens, parents, draft_probs, target_probs, num_nodes, scheme, None, validate)
    check_choice("rule", rule, TREE_RULES)
    check_choice("scheme", scheme, SCHEMES)
    accept, closed = _sweep(draft_tokens, parents, draft_probs, target_probs, num_nodes, rule, scheme)
    return (accepted_node_law(parents, accept, num_nodes, rule) * closed.layout.depth).sum(-1)
