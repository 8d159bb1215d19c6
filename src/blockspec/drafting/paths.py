"""Multi-path drafting: k paths of L tokens drafted by the draft model each step, level by level.

Glossary as in tree.py (B rows, V the target's vocabulary, S = k * L slots). The paths take the slots of the tree
shape (k, 1, .., 1): slot (d - 1) * k + j + 1 holds path j's token at depth d (j = 0..k-1), breadth first, so every
level is a run of k consecutive slots. Paths drawn "distinct" (their first tokens without replacement, each then
going on alone) are exactly the trees ``TreeProposer`` draws with that shape. Paths drawn "iid" (k independent paths)
are drawn here, by ``PathProposer``, merged into their prefix tree as they are drawn (verify/multipath.py):

- at each depth, every path draws its next token from the draft's law after the node it has reached, by inversion of
  the row's own uniform for its slot; the m paths through a node thus draw m i.i.d. tokens from its law;
- a path that draws the token an earlier path drew from the same node joins that path's node (its slot is a hole,
  and it goes on from the joined node); the others are new nodes, the children of each node in order of first
  appearance.

A slot's parent is then the node its path reached, which varies by row: at most k nodes per level, one draft forward
over them, and the target scores one node per distinct prefix, fewer than k * L where paths agree. The merged tree
is verified under the tree scheme "distinct", exactly (docs/algorithms.md, "Multi-path verification").

At temperature 0 every path draws the draft's argmax: the k paths are one greedy chain of L tokens, which is what
the step drafts (the "distinct" paths rank their first tokens instead).
"""

from __future__ import annotations

import torch

from ..sampling import draw
from .block import PAD
from .tree import TreeProposer


class PathProposer(TreeProposer):
    """Drafts k i.i.d. paths of L tokens each step, merged into their prefix tree, with ``draft``: a ``TreeProposer``
    of the shape (k, 1, .., 1) (``checks.path_layout``) whose slots are drawn as the module docstring says."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # [B, k]: the slot of the node each path has reached (0: the root), while a step draws its levels
        self.reached = torch.zeros(0, 0, dtype=torch.long)

    def _draw(self, level, laws, tokens, drawn, read, parents, depth, uniforms) -> None:
        """Draws the k slots at depth ``level`` + 1, one per path, merging the paths that draw the same token from
        the same node; a slot's entry in ``parents`` [B, S] is the node its path had reached."""
        slots = self.levels[level + 1]
        batch, paths = len(depth), len(slots)
        if level == 0:
            self.reached = torch.zeros(batch, paths, dtype=torch.long, device=depth.device)
        reached = torch.zeros_like(self.reached)  # [B, k]: after this depth
        rows = torch.arange(batch, device=depth.device)
        drawing = depth > level  # [B]: a draft law always has mass, so every path of a drafting row goes on
        step = torch.full_like(self.reached, -1)  # [B, k]: the tokens the paths drew at this depth, -1 before
        for j, slot in enumerate(slots):
            parent = self.reached[:, j]  # [B]
            law = laws[rows, parent]  # [B, V]
            token = draw(law, None if uniforms is None else uniforms[:, slot - 1])
            # an earlier path that drew the same token from the same node
            same = (self.reached == parent[:, None]) & (step == token[:, None])  # [B, k]
            merged = same.any(1)
            joined = reached.gather(1, same.long().argmax(1, keepdim=True)).squeeze(1)  # the first such path's node
            step[:, j] = token
            reached[:, j] = torch.where(merged, joined, slot)
            live = drawing & ~merged
            tokens[:, slot - 1] = token.masked_fill(~live, PAD)
            drawn[:, slot - 1] = live
            parents[:, slot - 1] = parent
        self.reached = reached
