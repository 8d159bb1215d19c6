"""Tree drafting: the draft model drafts a tree shape level by level, one draft forward per level; the shape is static,
or chosen before each step by ``policy.shapes.AdaptiveShape`` from earlier steps.

Glossary: B rows, V the target's vocabulary. A shape (k_1, .., k_D) gives every node at depth i - 1 up to k_i
children; its S slots are numbered breadth first (slot 0 is the root, the row's pending token), the order they are
drawn in, so every level is a run of consecutive slots. Row b drafts the slots down to its own ``depth[b]`` (its room,
at most D); a node gets fewer children when the draft's support (after top-k / top-p) runs out, and a slot not drawn
is a hole with its whole subtree. The drawn slots, renumbered 1..N in slot order, are the step's tree in
verify/tree_inputs.py's layout (node a = column a - 1, parents first, padding after ``num_nodes``). Each level is
drawn by one method (``_draw``), into per-row tensors: paths.py draws i.i.d. paths in the slots of (k, 1, .., 1) there,
choosing each slot's parent per row.

Siblings are drawn without replacement (``SCHEME = "distinct"``): child j of a node is drawn from the node's draft
distribution less its children 1..j-1, by inversion of the row's own uniform for that slot. The verifier is handed
the node's distribution itself (row a of the proposal's ``probs``) with the scheme, and removes the siblings as they
are rejected: that is the law the children were drawn from (docs/algorithms.md). At temperature 0 child j is the
j-th most likely token of the draft's softmax (child 1: its argmax), and the greedy tree rule needs no probabilities.

The draft reads the root's unseen tokens with a plain forward, then each level it drafts below with ``forward_tree``
(its slots numbered as here: every level is passed whole, holes included); it never reads the deepest level, as a
chain's last drafted token is never read. After verification it keeps the accepted path's nodes it read (``commit``)
and rolls back to the committed tokens, so its cache holds exactly the committed tokens it has read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..checks import probabilities
from ..models.base import TreeLanguageModel, left_pad
from ..policy.shapes import AdaptiveShape
from ..sampling import SamplingParams, draw
from ..verify import TreeVerifyOutput, VerifyOutput
from .block import PAD
from .proposer import Proposal, behind, room_in

SCHEME = "distinct"  # how siblings are drawn, as the tree verifiers name it


def tree_slots(shape: Sequence[int]) -> list[int]:
    """The parent slot of slots 1..S (list index s - 1), breadth first; slot 0 is the root. (2, 1) -> [0, 0, 1, 2]."""
    parents, level = [], [0]
    for children in shape:
        below = []
        for parent in level:
            for _ in range(children):
                parents.append(parent)
                below.append(len(parents))
        level = below
    return parents


class TreeProposer:
    """Drafts a tree of ``shape`` with ``draft`` each step (``propose``; an ``AdaptiveShape`` chooses each step's
    shape, a chain (1, .., 1) or none included), and keeps the draft's cache in step with the
    rows: ``observe`` learns the accepted path, ``roll_back`` commits it and cuts what the rows did not keep. One
    proposer serves one ``generate`` call; ``draft_sampling`` is the law the tree is drawn from."""

    def __init__(
        self,
        target: TreeLanguageModel,
        draft: TreeLanguageModel,
        shape: tuple[int, ...] | AdaptiveShape,
        draft_sampling: SamplingParams,
        vocab: int,
    ):
        self.target, self.draft, self.vocab = target, draft, vocab
        # an adaptive shape chooses each step's (``propose``), and learns from the laws at the rows' roots (``observe``)
        self.adaptive = shape if isinstance(shape, AdaptiveShape) else None
        self._lay_out(() if isinstance(shape, AdaptiveShape) else shape)
        self.greedy = draft_sampling.greedy
        # At temperature 0 the children are ranked by the draft's softmax: its processed law would be one-hot.
        self.law = SamplingParams() if self.greedy else draft_sampling
        self.node_slots = torch.zeros(0, 0, dtype=torch.long)  # [B, N]: the slot of each node of the last proposal
        self.read = torch.zeros(0, 0, dtype=torch.bool)  # [B, S]: the slots the draft read (its waiting tree)
        self.waiting = False  # the draft holds a tree waiting for its commit
        self.accepted: torch.Tensor | None = None  # [B, D]: the verifier's accepted nodes, until roll_back
        self.root_laws: torch.Tensor | None = None  # [B, V]: the draft's law at each root, for the adaptive shape

    def _lay_out(self, shape: tuple[int, ...]) -> None:
        """The slots of ``shape``: each one's parent (``parent_of``) and the slots at each depth (``levels``)."""
        self.parent_of = tree_slots(shape)  # [S]: parent slot of slot s at index s - 1
        depth = [0]  # the depth of slot s at index s (the root's 0 first)
        for parent in self.parent_of:
            depth.append(depth[parent] + 1)
        # levels[d]: the slots at depth d, consecutive (levels[0] = [0], the root)
        self.levels = [[s for s in range(len(depth)) if depth[s] == d] for d in range(len(shape) + 1)]

    def prefill(self, prompts: list[list[int]]) -> None:
        """The prompts less their pending last token (an empty row if a prompt fills the draft's context)."""
        self.draft.prefill([p[:-1] if room_in(self.draft, p) > 0 else [] for p in prompts])

    def propose(self, rows: list[int], contexts: list[list[int]], room: torch.Tensor, uniforms) -> Proposal:
        """Each row's tree, down to ``room[b]`` levels and what fits in both models' contexts. ``uniforms`` [B, >=S]
        float64, one per slot (None at temperature 0). A step where no row drafts is a plain target step (a chain
        proposal of width 0). An adaptive shape chooses the step's shape first, from earlier steps only."""
        device = self.target.device
        limit = room.minimum(torch.tensor([self._draft_room(c) for c in contexts]))  # [B]
        if self.adaptive is not None:
            catch_up = behind(contexts, self.draft.lengths.tolist(), limit.tolist())
            self._lay_out(self.adaptive.choose(len(contexts), catch_up))
        batch, slots = len(contexts), len(self.parent_of)
        depth = limit.clamp(0, len(self.levels) - 1).to(device)  # [B]
        levels = int(depth.max()) if batch else 0
        self.root_laws = None
        if levels == 0:
            empty = torch.zeros(batch, 0, dtype=torch.long, device=device)
            return Proposal(empty, None, empty.sum(1), torch.zeros(batch, dtype=torch.bool), 0)
        tokens = torch.full((batch, slots), PAD, dtype=torch.long, device=device)  # [B, S]: slot s in column s - 1
        drawn = torch.zeros(batch, slots, dtype=torch.bool, device=device)  # [B, S]
        read = torch.zeros(batch, slots, dtype=torch.bool, device=device)  # [B, S]
        # [B, S]: each slot's parent slot, per row (the shape's own here; merged paths redirect theirs, paths.py)
        parents = torch.tensor(self.parent_of, device=device).expand(batch, -1).clone()
        laws = torch.zeros(batch, slots + 1, self.vocab, device=device)  # [B, S+1, V]: the draft's law after slot s
        for level in range(levels):
            # The draft's law after each node at this depth (the root: after what it has not read), if the row
            # drafts the depth below; then that depth's slots.
            laws[:, self.levels[level]] = self._read(level, contexts, tokens, drawn, read, parents, depth)
            self._draw(level, laws, tokens, drawn, read, parents, depth, uniforms)
        self.read, self.waiting = read, levels > 1
        if self.adaptive is not None:
            self.root_laws = laws[:, 0]
        return self._as_tree(tokens, drawn, parents, laws, levels)

    def observe(self, rows: list[int], proposal: Proposal, target_probs: torch.Tensor, out: VerifyOutput) -> None:
        """Learns the accepted path (``out.accepted_nodes``), which ``roll_back`` keeps in the draft's cache; an
        adaptive shape learns from the laws at the roots of the rows that drafted (``AdaptiveShape.observe``)."""
        if self.root_laws is not None:
            assert self.adaptive is not None
            drafted = proposal.verified.to(target_probs.device) > 0  # [B]
            self.adaptive.observe(target_probs[drafted, 0], self.root_laws[drafted], self.greedy)
        if self.waiting:
            assert isinstance(out, TreeVerifyOutput), "a tree proposal is verified by a tree rule"
            self.accepted = out.accepted_nodes

    def roll_back(self, lengths: torch.Tensor) -> None:
        """The draft keeps the accepted path's nodes it read (``commit``), then what it read of the committed tokens
        ``lengths`` [B] (less, where a row's end cut its path)."""
        if self.waiting:
            assert self.accepted is not None, "observe comes before roll_back"
            path = self.accepted.to(self.node_slots.device)  # [B, D]: nodes 1..N, -1 after the path
            slot = torch.where(path > 0, self.node_slots.gather(1, (path - 1).clamp(min=0)), -1)  # [B, D]: 1..S
            kept = (slot > 0) & self.read.gather(1, (slot - 1).clamp(min=0))  # a prefix: the draft reads by depth
            self.draft.commit(torch.where(kept, slot, -1).to(self.draft.device))
            self.waiting, self.accepted = False, None
        self.draft.rollback(torch.minimum(self.draft.lengths, lengths.to(self.draft.device)))

    def select(self, keep: torch.Tensor) -> None:
        self.draft.select(keep)

    def _draft_room(self, context: list[int]) -> int:
        """Levels a row may draft before a model's context is full: the target scores the pending token and d levels
        at positions len - 1 .. len - 1 + d; the draft reads d - 1 of them after it."""
        return min(room_in(self.target, context) - 1, room_in(self.draft, context))

    def _draw(self, level, laws, tokens, drawn, read, parents, depth, uniforms) -> None:
        """Draws the slots at depth ``level`` + 1 into ``tokens`` and ``drawn`` [B, S]: the children of each node at
        depth ``level`` in order, each from the node's law ``laws`` [B, S+1, V] less its children drawn before it."""
        for parent in self.levels[level]:
            left = laws[:, parent].clone()  # [B, V]: the parent's law less its children drawn so far
            grows = depth > level if parent == 0 else read[:, parent - 1]
            for slot in (s for s in self.levels[level + 1] if self.parent_of[s - 1] == parent):
                live = grows & (left.sum(-1) > 0)  # no more children once the draft's support is used up
                token = draw(left, None if uniforms is None else uniforms[:, slot - 1])
                tokens[:, slot - 1] = token.masked_fill(~live, PAD)
                drawn[:, slot - 1] = live
                left.scatter_(1, token[:, None], 0.0)  # without replacement (a row not drawing ignores it)

    def _read(self, level, contexts, tokens, drawn, read, parents, depth) -> torch.Tensor:
        """The draft's law [B, n, V] after the n nodes at depth ``level``: one forward, which reads only the rows that
        draft below it (``depth`` [B] > level); it marks the slots read in ``read`` [B, S]."""
        device = self.target.device
        drafting = depth > level  # [B]
        if level == 0:  # the root: the tokens the draft has not read (1, or 2 after a whole path was accepted)
            seen = self.draft.lengths.tolist()
            unseen, valid = left_pad([c[n:] if d else [] for c, n, d in zip(contexts, seen, drafting.tolist())])
            logits = self.draft.forward(unseen.to(self.draft.device), valid.to(self.draft.device), last=True)
        else:  # the nodes at this depth, whose parents the draft read in an earlier forward of this step
            at = torch.tensor(self.levels[level], device=device) - 1  # their columns
            valid = drawn[:, at] & drafting[:, None]
            read[:, at] = valid
            logits = self.draft.forward_tree(
                tokens[:, at].to(self.draft.device), parents[:, at].to(self.draft.device), valid.to(self.draft.device)
            )
        return probabilities(self.draft, "draft", logits.to(device), self.law, self.vocab)

    def _as_tree(self, tokens, drawn, parents, laws, levels: int) -> Proposal:
        """The drawn slots as the verifiers' tree: nodes 1..N in slot order (parents before children), padding after
        each row's ``num_nodes``; ``probs`` [B, N+1, V] row a = the law node a's children were drawn from (None at
        temperature 0; a leaf's row is never read)."""
        batch, slots = drawn.shape
        num_nodes = drawn.sum(1)  # [B]
        width = int(num_nodes.max())
        order = (~drawn).long().argsort(dim=1, stable=True)[:, :width]  # [B, N]: drawn columns first, in slot order
        live = torch.arange(width, device=drawn.device) < num_nodes[:, None]  # [B, N]
        node_of = drawn.long().cumsum(1) * drawn  # [B, S]: the node number of each drawn slot
        parent_slot = parents.gather(1, order)  # [B, N]
        parents = torch.where(parent_slot > 0, node_of.gather(1, (parent_slot - 1).clamp(min=0)), 0)
        self.node_slots = torch.where(live, order + 1, -1)
        probs = None
        if not self.greedy:
            rows = torch.nn.functional.pad(order + 1, (1, 0))  # [B, N+1]: the root's law, then each node's slot's
            probs = laws.gather(1, rows[..., None].expand(-1, -1, laws.shape[-1]))
        return Proposal(
            tokens=tokens.gather(1, order).masked_fill(~live, PAD),
            probs=probs,
            verified=num_nodes,
            looked_up=torch.zeros(batch, dtype=torch.bool),
            drafted=levels,
            parents=parents.masked_fill(~live, 0),
        )
