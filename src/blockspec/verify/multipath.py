"""Multi-path verification: a step drafts k paths of L tokens and the target verifies them jointly, in one forward.

Glossary (B, V as in base.py):
    k, L                   paths per row (a row's own ``num_paths`` may be fewer) and tokens per path
    path_tokens       [B, k, L]       x_{j,1..L}: path j's drafted tokens
    path_draft_probs  [B, k, L, V]    row i: the draft's distribution x_{j,i+1} was drawn from (after x_{j,1..i})
    path_target_probs [B, k, L+1, V]  row i: the target's distribution after x_{j,1..i}; row 0 is the step's context
    num_paths         [B]             row b drafted paths 0..num_paths[b] - 1 (the others are padding)
Paths sharing a prefix share its context, so where they do the rows of the lowest-index path are read.

How the paths may be drawn: "iid" (k independent paths from the draft) or "distinct" (the first tokens without
replacement, each from the draft renormalised without the earlier paths' first tokens; each path then goes on
independently). Both are verified by the same computation, so unlike the tree verifiers this one need not be told
which: the prefix tree of either is a tree drawn under tree.py's scheme "distinct", the one it is verified with.

The rule: the paths form a prefix tree (a node per distinct prefix, children in order of first appearance), which
tree.py verifies: by Traversal Verification (rule "block", Weng et al., arXiv 2505.12398; with k = 1 it is Sun et
al.'s block verification) or by recursive rejection sampling (rule "token"), with the tree scheme "distinct":
  - distinct first tokens: the root's children were drawn without replacement, and every deeper node has one child;
  - i.i.d. paths: the m paths through a node continue with m i.i.d. draws from its draft distribution, and merging
    keeps the distinct ones in order of first appearance. Given the children seen so far, the next new one is drawn
    from the draft renormalised without them: sampling without replacement, with a number of children decided by
    the draws.
Not lossless (each fails the exact test, tests/verify/test_multipath_exact.py): the prefix tree verified as "iid"
(no renormalisation after a rejected sibling), each path block-verified alone and the longest accepted kept, a
node's draft replaced by the chance its token shows up among the draws through it, siblings tried likeliest first.
The exact tests enumerate every set of k paths, for both schemes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Randomness, check_distributions, check_randomness_values, describe
from .tree import TreeLaw, TreeVerifyOutput, expected_accepted_tree, tree_law, verify_tree_block, verify_tree_token
from .tree_inputs import check_choice

# The tree scheme the prefix tree of paths drawn either way is verified with (module docstring).
TREE_SCHEME = "distinct"
_VERIFIERS = {"block": verify_tree_block, "token": verify_tree_token}


@dataclass(frozen=True)
class PathTree:
    """The prefix tree of a batch of paths, as tree.py's verifiers take it (N = k * L columns, padded)."""

    draft_tokens: torch.Tensor  # [B, N] int64: node a's token in column a - 1; -1 on padding
    parents: torch.Tensor  # [B, N] int64: parent(a) < a; -1 on padding
    draft_probs: torch.Tensor  # [B, N+1, V]: Q_a, the distribution a's children were drawn from; 0 where none were
    target_probs: torch.Tensor  # [B, N+1, V]: P_a, the target's distribution after node a
    num_nodes: torch.Tensor  # [B] int64: distinct prefixes of the row's paths
    path_nodes: torch.Tensor  # [B, k, L] int64: the node holding x_{j,1..i+1}; -1 on padding paths

    @property
    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.draft_tokens, self.parents, self.draft_probs, self.target_probs


@dataclass(frozen=True)
class MultiPathVerifyOutput(TreeVerifyOutput):
    """tokens [B, L+1] (the accepted prefix, then one more token; -1 after), num_accepted [B] = tau, accepted_nodes
    [B, L] (the prefix tree's nodes of the accepted prefix; -1 after), and which path to keep."""

    accepted_path: torch.Tensor  # [B] int64: the lowest-index path whose first tau tokens were accepted (0 if tau = 0)


def paths_to_tree(
    path_tokens: torch.Tensor,  # [B, k, L] int64
    path_draft_probs: torch.Tensor,  # [B, k, L, V]
    path_target_probs: torch.Tensor,  # [B, k, L+1, V]
    *,
    num_paths: torch.Tensor | None = None,  # [B] int64 in [0, k]; default k
) -> PathTree:
    """The prefix tree of the paths: a node per distinct prefix x_{j,1..i}, numbered path by path (path j's new
    nodes after path j - 1's, shallow first), so parents come before their children and siblings in the order
    their paths were drawn (first appearance). No checks: ``verify_multipath`` checks the paths first."""
    batch, paths, length = path_tokens.shape
    vocab = path_target_probs.shape[-1]
    device = path_tokens.device
    num_paths = _default_num_paths(num_paths, batch, paths, device)
    live = torch.arange(paths, device=device) < num_paths[:, None]  # [B, k]
    # same[b, j', j, i]: paths j' and j agree on their first i + 1 tokens (both live)
    equal = path_tokens[:, :, None, :] == path_tokens[:, None, :, :]  # [B, k, k, L]
    same = equal.long().cumprod(-1).bool() & live[:, :, None, None] & live[:, None, :, None]
    first = same.long().argmax(1)  # [B, k, L]: the lowest-index path with the same prefix (j itself if none)
    new = (first == torch.arange(paths, device=device)[None, :, None]) & live[:, :, None]  # [B, k, L]
    new_flat = new.reshape(batch, paths * length)  # path-major: (j, i) in column j * L + i
    node_id = new_flat.long().cumsum(1) * new_flat  # [B, k * L]: 1..n for new prefixes
    path_nodes = node_id.reshape(batch, paths, length).gather(1, first)  # the node of path first[b, j, i]'s prefix
    path_nodes = torch.where(live[:, :, None], path_nodes, -1)
    # each new prefix's parent: the node of its path's prefix one token shorter (the root at i = 0)
    parent_nodes = torch.nn.functional.pad(path_nodes[:, :, :-1], (1, 0)).reshape(batch, paths * length)
    order = torch.sort((~new_flat).long(), dim=1, stable=True).indices  # new prefixes first, in node order
    num_nodes = new_flat.sum(1)
    real = torch.arange(paths * length, device=device) < num_nodes[:, None]  # [B, N]
    draft_tokens = torch.where(real, path_tokens.reshape(batch, -1).gather(1, order), -1)
    parents = torch.where(real, parent_nodes.gather(1, order), -1)
    # node (j, i) reads path j's rows after its token: row i + 1 (the draft has none after the last token)
    rows = order[..., None].expand(-1, -1, vocab)
    draft_after = torch.nn.functional.pad(path_draft_probs[:, :, 1:], (0, 0, 0, 1)).reshape(batch, -1, vocab)
    target_after = path_target_probs[:, :, 1:].reshape(batch, -1, vocab)
    draft_probs = torch.cat(
        [path_draft_probs[:, :1, 0], torch.where(real[..., None], draft_after.gather(1, rows), 0)], 1
    )
    target_probs = torch.cat(
        [path_target_probs[:, :1, 0], torch.where(real[..., None], target_after.gather(1, rows), 0)], 1
    )
    return PathTree(draft_tokens, parents, draft_probs, target_probs, num_nodes, path_nodes)


def verify_multipath(
    path_tokens: torch.Tensor,  # [B, k, L] int64
    path_draft_probs: torch.Tensor,  # [B, k, L, V] float32/64
    path_target_probs: torch.Tensor,  # [B, k, L+1, V] same dtype
    *,
    rule: str = "block",  # "block" (Traversal Verification) or "token" (recursive rejection sampling)
    num_paths: torch.Tensor | None = None,  # [B] int64 in [0, k]; default k
    generator: torch.Generator | None = None,
    randomness: Randomness | None = None,  # uniforms [B, k * L] (one per prefix-tree node), exponentials [B, V]
    validate: bool = True,
) -> MultiPathVerifyOutput:
    """Verifies k drafted paths jointly: the tree ``rule`` on their prefix tree (``paths_to_tree``). Lossless under
    either drawing scheme (i.i.d. paths, or distinct first tokens): the emitted tokens follow the target's law.
    With k = 1 the "block" rule is Sun et al.'s block verification of the one path, the "token" rule token
    verification, decision for decision with the same randomness.

    uniforms[:, a - 1] is node a's (numbered as in ``paths_to_tree``); the accepted prefix is path
    ``accepted_path``'s first ``num_accepted`` tokens.
    """
    tree = _checked_tree(path_tokens, path_draft_probs, path_target_probs, rule, num_paths, randomness, validate)
    out = _VERIFIERS[rule](
        *tree.inputs,
        scheme=TREE_SCHEME,
        num_nodes=tree.num_nodes,
        generator=generator,
        randomness=randomness,
        validate=False,  # checked as paths above; the prefix tree of valid paths is a valid tree
    )
    length = path_tokens.shape[2]
    tokens = torch.nn.functional.pad(out.tokens, (0, length + 1 - out.tokens.shape[1]), value=-1)  # [B, L+1]
    nodes = torch.nn.functional.pad(out.accepted_nodes, (0, length - out.accepted_nodes.shape[1]), value=-1)
    rows = torch.arange(len(nodes), device=nodes.device)
    deepest = nodes[rows, (out.num_accepted - 1).clamp(min=0)]  # [B]: the accepted node (junk where tau = 0)
    through = tree.path_nodes[rows, :, (out.num_accepted - 1).clamp(min=0)] == deepest[:, None]  # [B, k]
    accepted_path = torch.where(out.num_accepted > 0, through.long().argmax(1), 0)
    return MultiPathVerifyOutput(tokens, out.num_accepted, nodes, accepted_path)


def multipath_law(
    path_tokens: torch.Tensor,  # [B, k, L] int64
    path_draft_probs: torch.Tensor,  # [B, k, L, V]
    path_target_probs: torch.Tensor,  # [B, k, L+1, V]
    *,
    rule: str,
    num_paths: torch.Tensor | None = None,  # [B] int64
    validate: bool = True,
) -> tuple[PathTree, TreeLaw]:
    """The prefix tree and the exact law of ``verify_multipath`` given the paths (``tree_law`` on that tree):
    which node is accepted (its depth is tau), and the token emitted after it."""
    tree = _checked_tree(path_tokens, path_draft_probs, path_target_probs, rule, num_paths, None, validate)
    law = tree_law(*tree.inputs, rule=rule, scheme=TREE_SCHEME, num_nodes=tree.num_nodes, validate=False)
    return tree, law


def expected_accepted_multipath(
    path_tokens: torch.Tensor,  # [B, k, L] int64
    path_draft_probs: torch.Tensor,  # [B, k, L, V]
    path_target_probs: torch.Tensor,  # [B, k, L+1, V]
    *,
    rule: str,
    num_paths: torch.Tensor | None = None,  # [B] int64
    validate: bool = True,
) -> torch.Tensor:
    """E[tau | paths] [B] float, exactly (``expected_accepted_tree`` on the prefix tree); averaged over the draws of
    the paths it is the step's expected accepted length (the step emits one token more)."""
    tree = _checked_tree(path_tokens, path_draft_probs, path_target_probs, rule, num_paths, None, validate)
    return expected_accepted_tree(*tree.inputs, rule=rule, scheme=TREE_SCHEME, num_nodes=tree.num_nodes, validate=False)


# --- checks ---------------------------------------------------------------------------------------------------


def _default_num_paths(num_paths, batch: int, paths: int, device) -> torch.Tensor:
    if num_paths is None:
        return torch.full((batch,), paths, dtype=torch.long, device=device)
    return num_paths


def _checked_tree(path_tokens, path_draft_probs, path_target_probs, rule, num_paths, randomness, validate):
    check_choice("rule", rule, tuple(_VERIFIERS))
    if validate:
        _check_path_shapes(path_tokens, path_draft_probs, path_target_probs, num_paths, randomness)
        _check_path_values(path_tokens, path_draft_probs, path_target_probs, num_paths, randomness)
    return paths_to_tree(path_tokens, path_draft_probs, path_target_probs, num_paths=num_paths)


def _check_path_shapes(path_tokens, path_draft_probs, path_target_probs, num_paths, randomness) -> None:
    if not isinstance(path_tokens, torch.Tensor) or path_tokens.dim() != 3 or path_tokens.dtype != torch.long:
        raise ValueError(f"path_tokens must be a [B, k, L] int64 tensor, got {describe(path_tokens)}")
    batch, paths, length = path_tokens.shape
    if paths == 0 or length == 0:
        raise ValueError(
            f"path_tokens must hold at least one path of at least one token, got shape {[batch, paths, length]}"
        )
    if not isinstance(path_target_probs, torch.Tensor) or path_target_probs.dim() != 4:
        raise ValueError(f"path_target_probs must be a [B, k, L+1, V] tensor, got {describe(path_target_probs)}")
    if path_target_probs.shape[:3] != (batch, paths, length + 1):
        raise ValueError(
            f"path_target_probs must have shape [B, k, L+1, V] = [{batch}, {paths}, {length + 1}, V], "
            f"got {list(path_target_probs.shape)}"
        )
    if path_target_probs.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"path_target_probs must be float32 or float64 probabilities, got {path_target_probs.dtype}")
    vocab = path_target_probs.shape[3]
    if vocab == 0:
        raise ValueError("path_target_probs has an empty vocabulary (V = 0)")
    if not isinstance(path_draft_probs, torch.Tensor) or list(path_draft_probs.shape) != [batch, paths, length, vocab]:
        raise ValueError(
            f"path_draft_probs must be a [B, k, L, V] = [{batch}, {paths}, {length}, {vocab}] tensor, "
            f"got {describe(path_draft_probs)}"
        )
    if path_draft_probs.dtype != path_target_probs.dtype:
        raise ValueError(
            f"path_draft_probs is {path_draft_probs.dtype} but path_target_probs is {path_target_probs.dtype}"
        )
    if num_paths is not None and (
        not isinstance(num_paths, torch.Tensor) or list(num_paths.shape) != [batch] or num_paths.dtype != torch.long
    ):
        raise ValueError(f"num_paths must be a [B] = [{batch}] int64 tensor, got {describe(num_paths)}")
    if randomness is not None:
        for name, value, shape in (
            ("uniforms", randomness.uniforms, [batch, paths * length]),
            ("exponentials", randomness.exponentials, [batch, vocab]),
        ):
            if list(value.shape) != shape:
                raise ValueError(
                    f"randomness.{name} must have shape {shape} (one uniform per k * L), got {list(value.shape)}"
                )
    devices = {t.device for t in (path_tokens, path_draft_probs, path_target_probs, num_paths) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_path_values(path_tokens, path_draft_probs, path_target_probs, num_paths, randomness) -> None:
    batch, paths, length = path_tokens.shape
    vocab = path_target_probs.shape[3]
    num_paths = _default_num_paths(num_paths, batch, paths, path_tokens.device)
    if bool(((num_paths < 0) | (num_paths > paths)).any()):
        raise ValueError(f"num_paths must lie in [0, k] = [0, {paths}], got {num_paths.tolist()}")
    live = torch.arange(paths, device=path_tokens.device) < num_paths[:, None]  # [B, k]
    outside = live[..., None] & ((path_tokens < 0) | (path_tokens >= vocab))
    if bool(outside.any()):
        b, j, i = outside.nonzero()[0].tolist()
        raise ValueError(
            f"path_tokens[{b}, {j}, {i}] = {int(path_tokens[b, j, i])} is outside the vocabulary [0, {vocab})"
        )
    root_used = torch.zeros(batch, paths, dtype=torch.bool, device=live.device)
    root_used[:, 0] = True  # the context's row is read from path 0 even when a row drafted no path
    for j in range(paths):
        check_distributions(
            f"path_target_probs[:, {j}]",
            path_target_probs[:, j],
            (live[:, j] | root_used[:, j])[:, None].expand(-1, length + 1),
        )
        check_distributions(f"path_draft_probs[:, {j}]", path_draft_probs[:, j], live[:, j, None].expand(-1, length))
    draft_at = path_draft_probs.gather(-1, path_tokens.clamp(0, vocab - 1)[..., None]).squeeze(-1)  # [B, k, L]
    impossible = live[..., None] & (draft_at <= 0)
    if bool(impossible.any()):
        b, j, i = impossible.nonzero()[0].tolist()
        raise ValueError(
            f"path_tokens[{b}, {j}, {i}] = {int(path_tokens[b, j, i])} has zero probability under "
            f"path_draft_probs[{b}, {j}, {i}]: every token must be drawn from the draft's distribution before it"
        )
    if randomness is not None:
        check_randomness_values(randomness)
