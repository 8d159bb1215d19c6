"""Trees as ``TreeLanguageModel.forward_tree`` takes them (blockspec/models/base.py), for the tests of every adapter
that scores trees: random trees with holes, the path down to a node, a tree cut into consecutive calls, and the
malformed trees and paths an adapter must refuse (with the message each refusal gives)."""

from __future__ import annotations

import torch


def random_trees(gen: torch.Generator, batch: int, nodes: int, *, holes: float = 0.0, deep: float = 0.5):
    """(tokens, parents, valid) [B, N] in verify/tree_inputs.py's layout: node a's parent is, with probability
    ``deep``, the last valid node before it (so trees grow deep), else the root or any earlier valid node; a node
    is a hole with probability ``holes``, and a hole's parent is garbage (it must be ignored)."""
    tokens = torch.randint(1, 40, (batch, nodes), generator=gen)
    parents = torch.full((batch, nodes), 10**6, dtype=torch.long)
    valid = torch.rand(batch, nodes, generator=gen) >= holes
    for b in range(batch):
        earlier = [0]  # the root, then every valid node so far
        for a in range(1, nodes + 1):
            if not valid[b, a - 1]:
                continue
            if float(torch.rand((), generator=gen)) < deep:
                parents[b, a - 1] = earlier[-1]
            else:
                parents[b, a - 1] = earlier[int(torch.randint(len(earlier), (), generator=gen))]
            earlier.append(a)
    return tokens, parents, valid


def path_to(parents: list[int], node: int) -> list[int]:
    """Node numbers from the root's child down to ``node`` (0: the root, an empty path)."""
    path = []
    while node:
        path.append(node)
        node = parents[node - 1]
    return path[::-1]


def padded(paths: list[list[int]], fill: int = -1) -> torch.Tensor:
    width = max((len(p) for p in paths), default=0)
    return torch.tensor([p + [fill] * (width - len(p)) for p in paths], dtype=torch.long).reshape(len(paths), width)


def split_columns(nodes: int, parts: int, gen: torch.Generator) -> list[slice]:
    """The columns of a tree of ``nodes`` nodes, cut at random places into ``parts`` consecutive calls (some possibly
    empty)."""
    cuts = sorted(torch.randint(0, nodes + 1, (parts - 1,), generator=gen).tolist())
    bounds = [0, *cuts, nodes]
    return [slice(bounds[i], bounds[i + 1]) for i in range(parts)]


# --- refusals: each case changes TREE (one row of 5 nodes, node 5 a hole) and names the message it must give -------

TREE = (torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[0, 0, 1, 3, 0]]), torch.tensor([[1, 1, 1, 1, 0]]).bool())

BAD_TREES = {
    "parent after child": (
        {"parents": torch.tensor([[0, 3, 1, 2, 0]])},
        r"parents\[0, 1\] = 3 \(node 2\) must lie in \[0, 2\)",
    ),
    "parent -1": ({"parents": torch.tensor([[-1, 0, 1, 3, 0]])}, r"parents\[0, 0\] = -1 \(node 1\) .* 0 is the root"),
    "parent out of range": (
        {"parents": torch.tensor([[0, 0, 9, 3, 0]])},
        r"parents\[0, 2\] = 9 \(node 3\) must lie in \[0, 3\)",
    ),
    "parent a hole": ({"valid": torch.tensor([[1, 1, 0, 1, 0]]).bool()}, r"parents\[0, 3\] = 3 \(node 4\) is a hole"),
    "shapes": ({"parents": torch.tensor([[0, 0, 1, 3]])}, r"must all be \[B, N\] with B = 1 row"),
    "rows": ({"tokens": torch.ones(2, 5, dtype=torch.long)}, r"must all be \[B, N\] with B = 1 row"),
    "dtype": ({"valid": torch.ones(1, 5, dtype=torch.long)}, r"valid must be a \[B, N\] torch.bool tensor"),
}

BAD_PATHS = {
    "skips a level": (torch.tensor([[1, 4]]), r"node 4's parent is 3, not 1"),
    "below the root": (torch.tensor([[3]]), r"node 3's parent is 1, not 0"),
    "siblings": (torch.tensor([[1, 2]]), r"node 2's parent is 0, not 1"),
    "siblings kept": (torch.tensor([[True, True, False, False, False]]), r"node 2's parent is 0, not 1"),
    "gap": (torch.tensor([[1, -1, 3]]), r"goes on after a -1"),
    "out of range": (torch.tensor([[6]]), r"holds 6, not a node number in 1..5"),
    "hole": (torch.tensor([[5]]), r"holds node 5, a hole"),
    "hole kept": (torch.tensor([[False, False, False, False, True]]), r"keeps node 5 of row 0, a hole"),
    "int32": (torch.tensor([[1, 3]], dtype=torch.int32), r"\[B, D\] int64 node numbers"),
    "a list": ([[1, 3]], r"\[B, D\] int64 node numbers"),
}
KEPT_PATH = torch.tensor([[1, 3, 4]])  # a path of TREE that may be committed: tokens 5, 7, 8
