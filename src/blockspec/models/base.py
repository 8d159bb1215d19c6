"""The one interface the engine sees: a causal LM with a per-row KV cache that rolls back for free."""

from __future__ import annotations

import weakref
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch


@runtime_checkable
class LanguageModel(Protocol):
    """A batch of B rows, each a token sequence whose first ``lengths[b]`` tokens are in the model's cache.

    ``forward`` appends tokens and returns their logits; ``rollback`` forgets each row's latest tokens;
    ``select`` keeps a subset of rows (finished rows stop costing compute). Positions are per row, so rows of
    different lengths share one batch.
    """

    vocab_size: int  # size of the logits' last dimension
    eos_token_ids: tuple[int, ...]
    max_length: int | None  # the model's context length, if it has one
    tokenizer: Any  # a transformers tokenizer, or None
    device: torch.device

    @property
    def lengths(self) -> torch.Tensor: ...  # [B] int64: tokens in the cache per row

    def prefill(self, sequences: list[list[int]]) -> None:
        """Start a new batch: one row per sequence, every token of it in the cache (no logits kept)."""

    def forward(self, tokens: torch.Tensor, valid: torch.Tensor, *, last: bool = False) -> torch.Tensor:
        """Append ``tokens`` [B, S] to each row (slots where ``valid`` [B, S] is False are skipped: they take no
        position and are never attended to) and return their logits [B, S, vocab_size]; with ``last``, those of the
        last column alone, [B, 1, vocab_size] (a draft catching up on its rows' unread tokens, left-padded, reads no
        other: each position's logits cost the output layer's work). The logits of skipped slots are never used but
        must be finite: the engine checks every logit it is handed for NaN and inf."""
        ...

    def rollback(self, lengths: torch.Tensor) -> None:
        """Cut each row back to its first ``lengths[b]`` tokens (never more than it has)."""

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` [B'] (indices into the current batch), in that order."""


@runtime_checkable
class TreeLanguageModel(LanguageModel, Protocol):
    """A LanguageModel that also scores a drafted *tree* in one forward, then keeps one of its paths.

    A tree is laid out as verify/tree_inputs.py lays it out, so a verifier's tensors pass unchanged. Per row, N
    nodes: node a = 1..N is column a - 1 of the [B, N] tensors and 0 is the root, the row's last cached token.
        tokens  [B, N] int64  node a's token
        parents [B, N] int64  parent(a) in [0, a): 0 for a child of the root; a parent precedes its children,
                              in any such order (breadth first, depth first, as drawn)
        valid   [B, N] bool   False: a hole (anywhere in the row), which takes no position, is never attended to
                              and has logits that are finite but meaningless; a valid node's parent is valid
    Node a of row b sits at position ``lengths[b] + depth(a) - 1`` (a child of the root has depth 1, right after the
    cached tokens) and attends to the row's cached tokens, its ancestors and itself: its logits are those a plain
    ``forward`` of its root-to-node path would give.

    ``forward_tree`` leaves ``lengths`` as it was: the nodes wait for ``commit`` (``forward``, ``rollback`` and
    ``select`` are refused until then; ``prefill`` starts afresh). Another ``forward_tree`` before the ``commit`` grows
    the waiting tree, as a drafter that reads its tree level by level does: its nodes are numbered after the P nodes
    waiting (node P + a is column a - 1 of its tensors), its parents lie in [0, P + a) (the root, a waiting node or
    an earlier node of its own), and it returns the logits of its own nodes only. ``commit`` keeps one root-to-node
    path per row (possibly empty) of all the waiting nodes as if a plain ``forward`` had appended it, frees every
    other node's cache, and adds the path's length to ``lengths``.
    """

    def forward_tree(self, tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Append the N nodes of each row's tree (``tokens``, ``parents``, ``valid`` [B, N]) in one forward, after
        the nodes already waiting for a ``commit`` if any, and return their logits [B, N, vocab_size]. Raises
        ValueError for a parent that is not an earlier valid node or the root (the waiting tree stays as it was)."""
        ...

    def commit(self, path: torch.Tensor) -> None:
        """Keep each row's accepted path of the waiting tree (every ``forward_tree`` since the last commit), given
        either as the nodes at depth 1, 2, ... [B, D] int64 (node numbers 1..N, then -1: the verifier's
        ``accepted_nodes``), or as the nodes kept [B, N] bool. Raises ValueError unless each row's nodes form one
        path down from the root."""
        ...


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows of different lengths as (tokens [B, S], valid [B, S]), padded on the left with holes, so
    every row's last token is in the last column."""
    width = max((len(r) for r in rows), default=0)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, row in enumerate(rows):
        if row:
            tokens[b, width - len(row) :] = torch.tensor(row)
            valid[b, width - len(row) :] = True
    return tokens, valid


def check_tree(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    batch: int,
    waiting: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Checks a ``forward_tree``'s arguments (``TreeLanguageModel``) for a batch of ``batch`` rows and returns
    ``ancestors`` [B, P+N, P+N] bool over the P nodes ``waiting`` = (parents, valid) [B, P] (already checked; none
    if None) and the N new ones: [b, i, j] = node j + 1 is node i + 1 or one of its ancestors (holes: themselves
    only). Raises ValueError for a misshapen argument or a new node whose parent is not the root or an earlier
    valid node."""
    for name, value, dtype in (
        ("tokens", tokens, torch.long),
        ("parents", parents, torch.long),
        ("valid", valid, torch.bool),
    ):
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.dtype != dtype:
            raise ValueError(f"{name} must be a [B, N] {dtype} tensor, got {_describe(value)}")
    if tokens.shape[0] != batch or parents.shape != tokens.shape or valid.shape != tokens.shape:
        raise ValueError(
            f"tokens, parents and valid must all be [B, N] with B = {batch} rows, got {list(tokens.shape)}, "
            f"{list(parents.shape)} and {list(valid.shape)}"
        )
    before = 0 if waiting is None else waiting[0].shape[1]  # P: node P + a is column a - 1 of the new tensors
    if waiting is not None:
        parents, valid = torch.cat([waiting[0], parents], dim=1), torch.cat([waiting[1], valid], dim=1)
    nodes = parents.shape[1]
    column = torch.arange(nodes, device=parents.device)  # node a = column a - 1
    late = valid & ((parents < 0) | (parents > column))  # parent(a) must lie in [0, a)
    orphan = valid & ~late & ~valid.gather(1, (parents - 1).clamp(0, max(nodes - 1, 0)))
    orphan &= parents > 0
    late, orphan = late[:, before:], orphan[:, before:]  # the waiting nodes were checked by their own call
    if bool((late | orphan).any()):  # one host sync for both checks
        b, i = (late | orphan).nonzero()[0].tolist()
        parent, node = int(parents[b, before + i]), before + i + 1
        waiting_nodes = f", after the {before} nodes waiting for a commit" if before else ""
        if late[b, i]:
            raise ValueError(
                f"parents[{b}, {i}] = {parent} (node {node}{waiting_nodes}) must lie in [0, {node}): 0 is the root, "
                "the row's last cached token, and node a's parent is an earlier node (column a - 1), so parents "
                "precede children"
            )
        raise ValueError(
            f"parents[{b}, {i}] = {parent} (node {node}{waiting_nodes}) is a hole: a valid node's parent must be valid"
        )
    # One step up (a node's parent), or none; then the reach doubles with each boolean square: after k squarings
    # it spans 2**k steps, and a path among N nodes has at most N - 1. float32 counts of at most N paths are
    # exact (also in TF32 while N < 2048), and are thresholded back to 0/1 each time.
    reach = ((parents - 1)[:, :, None] == column) & valid[:, :, None]
    reach |= torch.eye(nodes, dtype=torch.bool, device=parents.device)
    span = 1
    while span < nodes - 1:
        as_float = reach.float()
        reach = torch.bmm(as_float, as_float) > 0
        span *= 2
    return reach


class _WaitingTree(Protocol):  # an adapter's record of the tree awaiting its commit
    @property
    def parents(self) -> torch.Tensor: ...

    @property
    def valid(self) -> torch.Tensor: ...


Waiting = TypeVar("Waiting", bound=_WaitingTree)


def committed_path(name: str, tree: Waiting | None, path: torch.Tensor, device) -> tuple[Waiting, torch.Tensor]:
    """A ``commit``'s (``TreeLanguageModel``) ``tree`` awaiting it, and ``path`` on it as ``tree_path``'s columns, on
    ``device``. Raises RuntimeError, naming the model ``name``, where no tree awaits a commit."""
    if tree is None:
        raise RuntimeError(f"{name}: commit keeps a path of the last forward_tree, and none awaits it")
    if isinstance(path, torch.Tensor):
        path = path.to(device)
    return tree, tree_path(path, tree.parents, tree.valid)


def tree_path(path: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Checks a ``commit``'s ``path`` (``TreeLanguageModel``) against the tree's ``parents`` and ``valid`` [B, N] and
    returns each row's path as columns [B, L] (node a = column a - 1, root to leaf, -1 after; L = the longest
    path). Raises ValueError unless every row's nodes are one path down from the root, of valid nodes."""
    batch, nodes = parents.shape
    column = torch.arange(nodes, device=parents.device)
    if isinstance(path, torch.Tensor) and path.dtype == torch.bool and list(path.shape) == [batch, nodes]:
        if bool((path & ~valid).any()):
            b, i = (path & ~valid).nonzero()[0].tolist()
            raise ValueError(f"commit keeps node {i + 1} of row {b}, a hole")
        # Parents precede children, so a path's nodes in column order are its nodes root to leaf.
        width = int(path.sum(1).max()) if batch else 0
        order = torch.where(path, column, nodes).sort(dim=1).values[:, :width]  # [B, L]; N after the kept ones
        path = torch.where(order < nodes, order + 1, -1)
    elif not (isinstance(path, torch.Tensor) and path.dtype == torch.long and path.dim() == 2 and len(path) == batch):
        raise ValueError(
            f"commit takes the accepted path as [B, D] int64 node numbers 1..N (-1 after the path) or as the nodes "
            f"kept [B, N] bool, with B = {batch} and N = {nodes}; got {_describe(path)}"
        )
    real = path != -1  # [B, D]
    out_of_range = real & ((path < 1) | (path > nodes))
    gap = torch.zeros_like(real)
    gap[:, 1:] = real[:, 1:] & ~real[:, :-1]  # a node after a -1
    at = (path - 1).clamp(0, max(nodes - 1, 0))
    if nodes:
        above = torch.cat([torch.zeros_like(path[:, :1]), path[:, :-1]], dim=1)  # the node one level up; 0: the root
        wrong_parent = real & ~out_of_range & (parents.gather(1, at) != above)
        hole = real & ~out_of_range & ~valid.gather(1, at)
    else:
        wrong_parent = hole = torch.zeros_like(real)
    problems = out_of_range | gap | wrong_parent | hole
    if bool(problems.any()):  # one host sync for every check
        b, d = problems.nonzero()[0].tolist()
        node, row = int(path[b, d]), path[b].tolist()
        if out_of_range[b, d]:
            raise ValueError(f"commit: row {b}'s path {row} holds {node}, not a node number in 1..{nodes} or -1")
        if gap[b, d]:
            raise ValueError(f"commit: row {b}'s path {row} goes on after a -1: -1 only pads the end of a path")
        if hole[b, d]:
            raise ValueError(f"commit: row {b}'s path {row} holds node {node}, a hole")
        above = int(path[b, d - 1]) if d else 0
        raise ValueError(
            f"commit: row {b}'s path {row} is not one path down from the root: node {node}'s parent is "
            f"{int(parents[b, node - 1])}, not {above}"
        )
    width = int(real.sum(1).max()) if batch and path.shape[1] else 0
    return torch.where(real, path - 1, -1)[:, :width]


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {list(value.shape)} {value.dtype} tensor"
    return type(value).__name__


def target_vocabulary(target: LanguageModel) -> int:
    """The ids the target can emit: its logits, less any padding rows beyond its tokenizer (embedding tables
    are often padded to a multiple of 64 or 128)."""
    if target.tokenizer is None:
        return target.vocab_size
    return min(target.vocab_size, len(target.tokenizer))


def check_shared_vocabulary(target: LanguageModel, model: LanguageModel, vocab: int, role: str) -> None:
    """Refuse a draft or companion that does not cover the target's ``vocab`` ids or has another tokenizer:
    the target's law would silently lose the ids it cannot propose or score."""
    if target.tokenizer is not None and model.tokenizer is not None:
        if not same_vocabulary(target.tokenizer, model.tokenizer):
            raise ValueError(
                f"the {role} ({model_name(model)}) and the target ({model_name(target)}) have different tokenizers: "
                "speculative decoding needs a shared vocabulary"
            )
    elif model.vocab_size != target.vocab_size:
        raise ValueError(
            f"the {role} ({model_name(model)}) has {model.vocab_size} logits and the target ({model_name(target)}) "
            f"{target.vocab_size}, and without tokenizers "
            "blockspec cannot check they share a vocabulary"
        )
    if model.vocab_size < vocab:
        raise ValueError(
            f"the {role} model ({model_name(model)}) has {model.vocab_size} logits but the target's vocabulary has "
            f"{vocab} tokens: ids {model.vocab_size}..{vocab - 1} could never be emitted; use a {role} with the "
            "target's vocabulary"
        )


# tokenizer -> {tokenizer found to share its vocabulary: both sizes then}; entries go with either tokenizer
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def same_vocabulary(a: Any, b: Any) -> bool:
    """Whether tokenizers ``a`` and ``b`` map the same strings to the same ids. A pair found to is remembered while
    both objects live and keep their sizes (tokens added to either compare them again): ``get_vocab`` builds a dict
    of the whole vocabulary, a quarter of a second for Qwen2.5's, and every decoder built checks its models."""
    try:
        known = _SHARED.setdefault(a, weakref.WeakKeyDictionary())
        remembered = known.get(b)
    except TypeError:  # a tokenizer that weak references cannot track: compared every time
        return a.get_vocab() == b.get_vocab()
    sizes = (len(a), len(b))
    if remembered == sizes:
        return True
    if a is not b and a.get_vocab() != b.get_vocab():
        return False
    known[b] = sizes
    return True


def model_name(model: LanguageModel) -> str:
    """The adapter's ``name`` if it has one, else its class name: how errors name a model."""
    return getattr(model, "name", None) or type(model).__name__
