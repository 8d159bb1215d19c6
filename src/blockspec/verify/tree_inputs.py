"""The drafted tree that tree.py's verifiers take, and its checks.

Glossary (B, V as in base.py; N drafted nodes per row, padding beyond a row's own ``num_nodes``):
    node a = 1..N             column a - 1 of the [B, N] tensors, row a of the [B, N+1, V] ones; row 0: the root
    draft_tokens [B, N]       x_a, drawn from its parent's draft distribution
    parents      [B, N]       parent(a) in [0, a): a node is drawn after its parent; siblings in drawing order
    draft_probs  [B, N+1, V]  Q_a = draft_probs[:, a], the distribution a's children were drawn from
    target_probs [B, N+1, V]  P_a = target_probs[:, a], the target's distribution after node a (one forward)
    num_nodes    [B]          row b holds nodes 1..num_nodes[b]
    scheme   how siblings were drawn: "iid" (each from Q_a) or "distinct" (each from Q_a renormalised without
             the siblings drawn before it); distinct siblings fit both, so the verifier must be told
"""

from __future__ import annotations

import torch

from .base import check_distributions, check_randomness_values, describe

SCHEMES = ("iid", "distinct")


def node_mask(num_nodes: torch.Tensor, nodes: int) -> torch.Tensor:
    """[B, N] bool: node a (column a - 1) is real, i.e. a <= num_nodes[b]."""
    return torch.arange(1, nodes + 1, device=num_nodes.device) <= num_nodes[:, None]


def prepare_tree(draft_tokens, parents, draft_probs, target_probs, num_nodes, scheme, randomness, validate):
    """Checks the inputs (when ``validate``) and returns ``num_nodes`` [B] int64, defaulting to N for every row."""
    if validate:
        if scheme is not None:
            check_choice("scheme", scheme, SCHEMES)
        _check_tree_shapes(draft_tokens, parents, draft_probs, target_probs, num_nodes, randomness)
    batch, nodes = draft_tokens.shape
    if num_nodes is None:
        num_nodes = torch.full((batch,), nodes, dtype=torch.long, device=draft_tokens.device)
    if validate:
        _check_tree_values(draft_tokens, parents, draft_probs, target_probs, num_nodes, scheme, randomness)
    return num_nodes


def require_draft(draft_probs) -> None:
    if draft_probs is None:
        raise ValueError("draft_probs is required: the sampled rules need the distributions the tree was drawn from")


def check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _check_tree_shapes(draft_tokens, parents, draft_probs, target_probs, num_nodes, randomness) -> None:
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2 or draft_tokens.dtype != torch.long:
        raise ValueError(f"draft_tokens must be a [B, N] int64 tensor, got {describe(draft_tokens)}")
    batch, nodes = draft_tokens.shape
    if not isinstance(parents, torch.Tensor) or list(parents.shape) != [batch, nodes] or parents.dtype != torch.long:
        raise ValueError(f"parents must be a [B, N] = [{batch}, {nodes}] int64 tensor, got {describe(parents)}")
    if (
        not isinstance(target_probs, torch.Tensor)
        or target_probs.dim() != 3
        or target_probs.shape[:2] != (batch, nodes + 1)
    ):
        raise ValueError(
            f"target_probs must be a [B, N+1, V] = [{batch}, {nodes + 1}, V] tensor, got {describe(target_probs)}"
        )
    if target_probs.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"target_probs must be float32 or float64 probabilities, got {target_probs.dtype}")
    vocab = target_probs.shape[2]
    if vocab == 0:
        raise ValueError("target_probs has an empty vocabulary (V = 0)")
    if draft_probs is not None:
        if not isinstance(draft_probs, torch.Tensor) or list(draft_probs.shape) != [batch, nodes + 1, vocab]:
            raise ValueError(
                f"draft_probs must be a [B, N+1, V] = [{batch}, {nodes + 1}, {vocab}] tensor, "
                f"got {describe(draft_probs)}"
            )
        if draft_probs.dtype != target_probs.dtype:
            raise ValueError(f"draft_probs is {draft_probs.dtype} but target_probs is {target_probs.dtype}")
    if num_nodes is not None and (
        not isinstance(num_nodes, torch.Tensor) or list(num_nodes.shape) != [batch] or num_nodes.dtype != torch.long
    ):
        raise ValueError(f"num_nodes must be a [B] = [{batch}] int64 tensor, got {describe(num_nodes)}")
    if randomness is not None:
        for name, value, shape in (
            ("uniforms", randomness.uniforms, [batch, nodes]),
            ("exponentials", randomness.exponentials, [batch, vocab]),
        ):
            if list(value.shape) != shape:
                raise ValueError(f"randomness.{name} must have shape {shape}, got {list(value.shape)}")
    devices = {t.device for t in (draft_tokens, parents, draft_probs, target_probs, num_nodes) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_tree_values(draft_tokens, parents, draft_probs, target_probs, num_nodes, scheme, randomness) -> None:
    batch, nodes = draft_tokens.shape
    vocab = target_probs.shape[2]
    if bool(((num_nodes < 0) | (num_nodes > nodes)).any()):
        raise ValueError(f"num_nodes must lie in [0, N] = [0, {nodes}], got {num_nodes.tolist()}")
    live = node_mask(num_nodes, nodes)  # [B, N]
    index = torch.arange(1, nodes + 1, device=parents.device)  # node a = column a - 1
    for name, values, low, high, rule in (
        ("parents", parents, 0, index, "in [0, a) for node a: a parent is drawn before its children"),
        ("draft_tokens", draft_tokens, 0, vocab, f"in the vocabulary [0, {vocab})"),
    ):
        bad = live & ((values < low) | (values >= high))
        if bool(bad.any()):
            b, i = bad.nonzero()[0].tolist()
            raise ValueError(f"{name}[{b}, {i}] = {int(values[b, i])} (node {i + 1}) must lie {rule}")
    parent_of = parents.where(live, 0)
    check_distributions("target_probs", target_probs, torch.nn.functional.pad(live, (1, 0), value=True))
    if draft_probs is not None:
        has_children = torch.zeros(batch, nodes + 1, dtype=torch.bool, device=parents.device)
        has_children.scatter_(1, parent_of, live)  # only the rows children were drawn from are used
        check_distributions("draft_probs", draft_probs, has_children)
        rows = torch.arange(batch, device=parents.device)[:, None]
        draft_at = draft_probs[rows, parent_of, draft_tokens.clamp(0, vocab - 1)]  # [B, N]: Q_parent(a)[x_a]
        impossible = live & (draft_at <= 0)
        if bool(impossible.any()):
            b, i = impossible.nonzero()[0].tolist()
            raise ValueError(
                f"draft_tokens[{b}, {i}] = {int(draft_tokens[b, i])} has zero probability under its parent's row "
                f"draft_probs[{b}, {int(parent_of[b, i])}]: every node must be drawn from its parent's draft_probs"
            )
    if scheme == "distinct":
        same = (parent_of[:, :, None] == parent_of[:, None, :]) & (draft_tokens[:, :, None] == draft_tokens[:, None, :])
        earlier = torch.ones(nodes, nodes, dtype=torch.bool, device=parents.device).triu(1)  # [i, j]: i < j
        duplicate = same & earlier & live[:, :, None] & live[:, None, :]
        if bool(duplicate.any()):
            b, i, j = duplicate.nonzero()[0].tolist()
            raise ValueError(
                f"scheme='distinct' but nodes {i + 1} and {j + 1} of row {b} are siblings with the same token "
                f"{int(draft_tokens[b, i])}: draw distinct siblings, or pass scheme='iid' if they were drawn i.i.d."
            )
    if randomness is not None:
        check_randomness_values(randomness)
