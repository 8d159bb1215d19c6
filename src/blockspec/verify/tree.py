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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Randomness, VerifyOutput, draw_exponentials, draw_uniforms, race
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


# --- the steps of the deterministic part, one node at a time (each [B] or [B, V]) ------------------------------


def child_log_weight(parent_log_weight: torch.Tensor, target_at: torch.Tensor, draft_at: torch.Tensor):
    """log w_c = min(0, log w_a + log P_a[x_c] - log Q_a[x_c]), all [B]: the sequence-level weight of child c.

    In log space like ``block_weights`` (the same expression, so a chain gives Sun et al.'s w bit for bit).
    """
    return (parent_log_weight + (target_at.log() - draft_at.log())).clamp(max=0.0)


def rejection_residual(weight: torch.Tensor, target: torch.Tensor, draft: torch.Tensor):
    """A node's target distribution once a child is rejected, and Z: (normalize(max(w P - Q, 0)) [B, V], Z [B]).

    Guard: where Z = 0 the residual is never used (the token rule rejects no child when P = Q; in the block rule
    w_a becomes 0, so neither a nor its later children can be accepted), nor where it rounds to nothing; P is kept
    then, as ``final_distribution`` does, rather than dividing by zero.
    """
    residual = (target * weight[:, None] - draft).clamp(min=0.0)
    mass = residual.sum(-1)
    normalized = residual / mass.clamp(min=torch.finfo(mass.dtype).tiny)[:, None]
    return torch.where(mass[:, None] > 0, normalized, target), mass


def weight_after_rejection(weight: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """w_a <- Z / (Z + 1 - w_a), [B]: a node's weight once a child's subtree is rejected (Sun et al.'s h on a chain).

    1 - w first, as in ``block_acceptance``, so the result stays <= 1 after rounding. Guard: the denominator is 0
    only if w_a = 1 and Z = 0, i.e. P_a = Q_a: then every child's w is 1, none is ever rejected, and any value is
    exact (1).
    """
    denominator = mass + (1.0 - weight)
    return torch.where(denominator > 0, mass / denominator.clamp(min=torch.finfo(weight.dtype).tiny), 1.0)


def draft_without(draft: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Q renormalised without ``token`` [B]: what the next distinct sibling was drawn from, [B, V].

    Guard: no mass left means no sibling can follow; the zero row is kept (never used as a distribution).
    """
    draft = draft.scatter(-1, token[:, None], 0.0)
    mass = draft.sum(-1, keepdim=True)
    return torch.where(mass > 0, draft / mass.clamp(min=torch.finfo(draft.dtype).tiny), draft)


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
    A parent's update depends on its child's token only, never on the child's subtree, so one pass in node order
    (parents first) gives Traversal Verification's leaf-first states: the final (w_a, P_a) of a node is the one
    it has when the traversal reaches it with all its children rejected. Hence, per node:
        token: accept = the probability of accepting the node once its parent is reached and its earlier siblings
               rejected;  block: accept = the final w_a, the probability of accepting the path to a when the
               traversal reaches a.   final = P_a after all of a's children were rejected (the token emitted
               after stopping at a; the target's own distribution for a leaf).
    """
    check_choice("rule", rule, TREE_RULES)
    check_choice("scheme", scheme, SCHEMES)
    batch, nodes = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    live = node_mask(num_nodes, nodes)  # [B, N]
    target = target_probs.clone()  # P_a, updated as a's children are rejected; Q_a too, for distinct siblings
    draft = draft_probs.clone() if scheme == "distinct" else draft_probs
    log_weight = torch.zeros(batch, nodes + 1, dtype=target.dtype, device=target.device)  # log w_a; root: w = 1
    accept = torch.zeros(batch, nodes, dtype=target.dtype, device=target.device)
    for child in range(1, nodes + 1):
        real = live[:, child - 1]
        parent = parents[:, child - 1].where(real, 0)  # padding: any parent in range, its update is discarded
        token = draft_tokens[:, child - 1].clamp(0, target.shape[-1] - 1)
        target_a, draft_a, log_weight_a = target[rows, parent], draft[rows, parent], log_weight[rows, parent]
        target_at = target_a.gather(-1, token[:, None]).squeeze(-1)  # [B]
        draft_at = draft_a.gather(-1, token[:, None]).squeeze(-1)
        if rule == "token":
            accept[:, child - 1] = torch.where(real, (target_at / draft_at).clamp(max=1.0), 0.0)
            weight_a = torch.ones_like(log_weight_a)  # the token rule starts afresh at every node: w = 1
        else:
            log_weight[:, child] = torch.where(real, child_log_weight(log_weight_a, target_at, draft_at), -torch.inf)
            weight_a = log_weight_a.exp()
        new_target, mass = rejection_residual(weight_a, target_a, draft_a)
        target[rows, parent] = torch.where(real[:, None], new_target, target_a)
        if rule == "block":
            new_log_weight = weight_after_rejection(weight_a, mass).log()
            log_weight[rows, parent] = torch.where(real, new_log_weight, log_weight_a)
        if scheme == "distinct":
            draft[rows, parent] = torch.where(real[:, None], draft_without(draft_a, token), draft_a)
    if rule == "block":
        accept = log_weight[:, 1:].exp()  # exp(-inf) = 0 on padding
    return accept, target


# --- the law given the tree, and the random part ------------------------------------------------------------


def node_depths(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """[B, N+1] int64: the depth of every node (root 0; padding 0)."""
    batch, nodes = parents.shape
    live = node_mask(num_nodes, nodes)
    depth = torch.zeros(batch, nodes + 1, dtype=torch.long, device=parents.device)
    for child in range(1, nodes + 1):
        parent_depth = depth.gather(1, parents[:, child - 1 : child].where(live[:, child - 1 : child], 0))
        depth[:, child] = torch.where(live[:, child - 1], parent_depth.squeeze(1) + 1, 0)
    return depth


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
    accept = torch.nn.functional.pad(accept.where(live, 0.0), (1, 0), value=1.0)  # [B, N+1]; the root: 1
    parent_of = torch.nn.functional.pad(parents.where(live, 0), (1, 0))  # [B, N+1]; padding -> the root
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


def _descend(parents: torch.Tensor, move: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """The accepted node [B]: from the root, repeatedly go to the FIRST child c (drawing order) with move[c].

    One pass in node order suffices: children come after their parent, and once the walk enters a child its
    later siblings no longer have the current node as parent.
    """
    node = torch.zeros(parents.shape[0], dtype=torch.long, device=parents.device)
    go = move & node_mask(num_nodes, parents.shape[1])  # [B, N]; padding never moves
    for child in range(1, parents.shape[1] + 1):
        node = torch.where(go[:, child - 1] & (parents[:, child - 1] == node), child, node)
    return node


def _subtree_hits(parents: torch.Tensor, hits: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: some node of c's subtree (c included) has a hit; the leaf-first traversal enters c's subtree to
    stop there."""
    batch, nodes = parents.shape
    rows = torch.arange(batch, device=parents.device)
    live = node_mask(num_nodes, nodes)
    found = torch.nn.functional.pad(hits & live, (1, 0))  # [B, N+1]; column 0 (the root) is not read
    for child in range(nodes, 0, -1):  # children (higher index) before their parent
        parent = parents[:, child - 1].where(live[:, child - 1], 0)
        found[rows, parent] |= found[:, child]
    return found[:, 1:]


def _emit_tree(draft_tokens, parents, depth, node, last, max_depth: int) -> TreeVerifyOutput:
    """The path root..node (walked up through ``parents``), its tokens, then ``last``; -1 padding."""
    batch = draft_tokens.shape[0]
    rows = torch.arange(batch, device=draft_tokens.device)
    parent_of = torch.nn.functional.pad(parents, (1, 0))  # [B, N+1]: node a's parent in column a
    tau = depth[rows, node]  # [B]
    path = torch.full((batch, max_depth + 1), -1, dtype=torch.long, device=draft_tokens.device)
    current = node
    for _ in range(max_depth):  # one level up per step; rows already at the root write to the spare column
        level = depth[rows, current]
        path[rows, torch.where(level > 0, level - 1, max_depth)] = current
        current = torch.where(level > 0, parent_of[rows, current], 0)
    path = path[:, :max_depth]
    node_tokens = torch.nn.functional.pad(draft_tokens, (1, 0), value=-1)  # [B, N+1]: node a's token in column a
    tokens = torch.where(path >= 0, node_tokens.gather(1, path.clamp(min=0)), -1)
    tokens = torch.nn.functional.pad(tokens, (0, 1), value=-1).scatter(1, tau[:, None], last[:, None])
    return TreeVerifyOutput(tokens=tokens, num_accepted=tau, accepted_nodes=path)


def _max_depth(depth: torch.Tensor) -> int:
    return int(depth.max()) if depth.numel() else 0


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
    uniforms = draw_uniforms(randomness, generator, target_probs, draft_tokens.shape[1])  # [B, N]
    accept, final = tree_acceptance(draft_tokens, parents, draft_probs, target_probs, num_nodes, rule, scheme)
    hits = uniforms < accept  # P(u < a) = a for u ~ U[0, 1); a = 0 (padding) never hits
    move = hits if rule == "token" else _subtree_hits(parents, hits, num_nodes)
    node = _descend(parents, move, num_nodes)  # [B]
    batch, _, vocab = target_probs.shape
    if randomness is not None:
        exponentials = randomness.exponentials
    else:
        exponentials = draw_exponentials(batch, vocab, dtype=final.dtype, device=final.device, generator=generator)
    rows = torch.arange(batch, device=node.device)
    last = race(final[rows, node], exponentials)
    depth = node_depths(parents, num_nodes)
    return _emit_tree(draft_tokens, parents, depth, node, last, _max_depth(depth))


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
    batch, nodes = draft_tokens.shape
    live = node_mask(num_nodes, nodes)
    choice = target_probs.argmax(-1)  # [B, N+1]
    matched = torch.ones(batch, nodes + 1, dtype=torch.bool, device=draft_tokens.device)  # the root matches
    for child in range(1, nodes + 1):
        parent = parents[:, child - 1 : child].where(live[:, child - 1 : child], 0)
        agrees = draft_tokens[:, child - 1] == choice.gather(1, parent).squeeze(1)
        matched[:, child] = live[:, child - 1] & matched.gather(1, parent).squeeze(1) & agrees
    depth = node_depths(parents, num_nodes)
    node = torch.where(matched, depth, -1).argmax(-1)  # the first maximum: lowest index among the deepest
    return _emit_tree(draft_tokens, parents, depth, node, choice.gather(1, node[:, None]).squeeze(1), _max_depth(depth))


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
    num_nodes = prepare_tree(draft_tokens, parents, draft_probs, target_probs, num_nodes, scheme, None, validate)
    law = tree_law(
        draft_tokens, parents, draft_probs, target_probs, rule=rule, scheme=scheme, num_nodes=num_nodes, validate=False
    )
    return (law.node_law * node_depths(parents, num_nodes)).sum(-1)
