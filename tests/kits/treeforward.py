"""Trees as ``TreeLanguageModel.forward_tree`` takes them (blockspec/models/base.py), and the adapters that score them,
for the protocol's suite (tests/models/test_tree_protocol.py) and each adapter's own tests: random trees with holes,
the path down to a node, a tree cut into consecutive calls, the malformed trees and paths an adapter must refuse (with
the message each refusal gives); each adapter as the suite takes it (``Adapter``: a fresh model, the reference its
nodes must equal, its tolerance) and the plausible bugs of each (``BREAKS``), which the checks must catch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from blockspec.models import hf, llamacpp
from blockspec.models.base import LanguageModel, left_pad
from blockspec.models.hf import HFModel
from blockspec.models.llamacpp import LlamaCppModel
from kits.tiny import VOCAB

ROWS = [[1, 2, 3, 4, 5], [6], [], [7, 8, 9, 10, 11, 12, 13, 14]]  # different lengths, an empty row included


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


# --- the reference: a node's path run as a chain -------------------------------------------------------------------

# reference(rows, chains) -> [B, V]: the logits of each chain's last token after its row, computed without a tree
Reference = Callable[[list[list[int]], list[list[int]]], torch.Tensor]


def forward(model: LanguageModel, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``model.forward`` of CPU tensors (every slot valid unless ``valid`` says otherwise), on the model's device."""
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
    return model.forward(tokens.to(model.device), valid.to(model.device))


def chain_reference(model: LanguageModel) -> Reference:
    """The reference of ``model``'s own chain forward: the rows prefilled afresh, then the chains (left-padded with
    holes) appended by one ``forward``."""

    def reference(rows: list[list[int]], chains: list[list[int]]) -> torch.Tensor:
        model.prefill(rows)
        return forward(model, *left_pad(chains))[:, -1]

    return reference


def chain_logits(reference: Reference, rows, tokens, parents, valid, *, paths=path_to) -> torch.Tensor:
    """[B, N, V] on the CPU: each valid node's logits by ``reference`` of its path after its row (``paths(parents,
    node)``, by default the node's own), one call per column over the rows where it is a valid node; zeros at holes."""
    out = torch.zeros(*tokens.shape, VOCAB)
    for column in range(tokens.shape[1]):
        live = valid[:, column].nonzero().flatten().tolist()
        if live:
            chains = [[int(tokens[b, a - 1]) for a in paths(parents[b].tolist(), column + 1)] for b in live]
            out[live, column] = reference([rows[b] for b in live], chains).cpu()
    return out


# --- the adapters under test -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Adapter:
    """A TreeLanguageModel under test and what checking it takes: ``new()``, a fresh model; ``reference``, what a
    node's logits must equal; ``assert_close(actual, expected, label)`` at the adapter's tolerance;
    ``assert_cache_holds(model, rows)``: the model's cache holds each row's tokens and nothing else, in the adapter's
    own bookkeeping."""

    name: str
    new: Callable[[], Any]
    reference: Reference
    assert_close: Callable[[torch.Tensor, torch.Tensor, str], None]
    assert_cache_holds: Callable[[Any, list[list[int]]], None]


def assert_nodes_match_their_paths(adapter: Adapter, rows, tokens, parents, valid, logits) -> None:
    """Every valid node's logits (``logits`` [B, N, V] of ``tokens``, ``parents``, ``valid`` after ``rows``) are its
    reference's: those of its path run as a chain after its row."""
    expected = chain_logits(adapter.reference, rows, tokens, parents, valid)
    for b in range(len(rows)):
        adapter.assert_close(logits[b].cpu()[valid[b]], expected[b][valid[b]], f"row {b}")


def assert_every_node_has_the_logits_of_its_path(adapter: Adapter, seed: int, nodes: int) -> None:
    """A random tree of ``nodes`` nodes a row, holes included, over ROWS in one forward_tree: its logits' shape, the
    lengths as they were (the nodes wait for commit), every valid node's logits those of its path."""
    gen = torch.Generator().manual_seed(seed)
    model = adapter.new()
    model.prefill(ROWS)
    tokens, parents, valid = random_trees(gen, len(ROWS), nodes, holes=0.2)
    logits = model.forward_tree(tokens, parents, valid)
    assert logits.shape == (len(ROWS), nodes, VOCAB), f"logits of shape {list(logits.shape)}"
    assert bool(logits.isfinite().all()), "logits that are not finite"
    assert model.lengths.tolist() == [len(r) for r in ROWS], f"lengths {model.lengths.tolist()} before the commit"
    assert_nodes_match_their_paths(adapter, ROWS, tokens, parents, valid, logits)


@dataclass(frozen=True)
class Break:
    """A plausible bug of an adapter: ``apply(patch, model)`` plants it (``patch``: a pytest MonkeyPatch, undone after
    the broken forward_tree). ``refused``: the message of the RuntimeError the backend then refuses the tree with, or
    None where it scores the tree and the logits must miss the check."""

    apply: Callable[[Any, Any], None]
    refused: str | None = None


# --- transformers: HFModel -------------------------------------------------------------------------------------------

# In float32, against transformers' own forward (no cache, no mask), absolute and relative: the same arithmetic reduced
# over different key counts and batch shapes differs by float32 rounding only (a few 1e-7 on these logits of magnitude
# ~10), while a node that sees one wrong key or sits at a wrong position is off by 1e-2 or more (HF_BREAKS).
HF_TOLERANCE = 1e-5


def hf_adapter(model) -> Adapter:
    """HFModel over ``model``, a transformers causal LM (kits/tiny.py's), against transformers' own forward of each
    whole row and chain."""

    def reference(rows: list[list[int]], chains: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            return torch.stack(
                [model(torch.tensor([r + c], device=model.device)).logits[0, -1] for r, c in zip(rows, chains)]
            )

    return Adapter("hf", lambda: HFModel(model), reference, hf_close, hf_cache_holds)


def hf_close(actual: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    torch.testing.assert_close(actual, expected, atol=HF_TOLERANCE, rtol=HF_TOLERANCE, msg=lambda m: f"{label}: {m}")


def hf_cache_holds(model: HFModel, rows: list[list[int]]) -> None:
    """Each row's slots hold its positions 0..len(row) - 1, each once; every other slot is free (position -1)."""
    held = [sorted(p for p in row if p >= 0) for row in model._cache.slot_pos.tolist()]
    assert held == [list(range(len(r))) for r in rows], f"the cache's positions, row by row: {held}"


def _siblings_see_each_other(real):
    def mask(slot_pos, ancestors, valid, dtype):
        above = ancestors & ~torch.eye(ancestors.shape[1], dtype=torch.bool, device=ancestors.device)
        siblings = (above[:, :, None, :] == above[:, None, :, :]).all(-1)  # [B, N, N]: the same ancestors
        return real(slot_pos, ancestors | siblings, valid, dtype)

    return mask


def _chain_positions(model: HFModel):
    """Positions counted along the columns, as a chain's forward counts them, instead of by depth."""
    real = model._call

    def call(layers, tokens, mask, positions, logits_to_keep):
        columns = torch.arange(tokens.shape[1], device=positions.device)
        return real(layers, tokens, mask, positions[:, :1] + columns, logits_to_keep)  # node 1 sits at lengths

    return call


HF_BREAKS = {
    "siblings see each other": Break(
        lambda patch, model: patch.setattr(hf, "tree_mask", _siblings_see_each_other(hf.tree_mask))
    ),
    "positions along the columns": Break(lambda patch, model: patch.setattr(model, "_call", _chain_positions(model))),
}


# --- llama.cpp: LlamaCppModel ----------------------------------------------------------------------------------------

# |tree - chain| with llamacpp.F32_ATTENTION on, absolute (-inf equal to -inf): tests/models/test_tree_llamacpp.py's
# docstring has the measurements, with llama.cpp's default f16 attention too
LLAMACPP_TOLERANCE = 1e-5


def llamacpp_model(path: str | Path) -> LlamaCppModel:
    return LlamaCppModel(path, None, eos_token_ids=(VOCAB - 1,), threads=1)


def llamacpp_adapter(path: str | Path) -> Adapter:
    """LlamaCppModel on the GGUF at ``path``, against its own chain forward (on another model of the same file)."""
    return Adapter(
        "llamacpp", lambda: llamacpp_model(path), chain_reference(llamacpp_model(path)), llamacpp_close, llamacpp_holds
    )


def miss(actual: torch.Tensor, expected: torch.Tensor) -> float:
    same = actual == expected  # -inf where a cut vocabulary drops a token
    return float(torch.where(same, 0.0, actual - expected).abs().max()) if actual.numel() else 0.0


def within(tolerance: float) -> Callable[[torch.Tensor, torch.Tensor, str], None]:
    """An ``assert_close`` at an absolute ``tolerance``."""

    def assert_close(actual: torch.Tensor, expected: torch.Tensor, label: str) -> None:
        error = miss(actual, expected)
        assert actual.shape == expected.shape and error <= tolerance, f"{label}: max |difference| {error:.3g}"

    return assert_close


llamacpp_close = within(LLAMACPP_TOLERANCE)


def cache_state(model: LlamaCppModel) -> dict[int, tuple[int, int]]:
    """(first, last) position of every llama.cpp sequence id the context has, for those holding any cell."""
    lib = llamacpp.library()
    memory = lib.llama_get_memory(model._context)
    span = {s: (lib.llama_memory_seq_pos_min(memory, s), lib.llama_memory_seq_pos_max(memory, s)) for s in range(256)}
    return {s: pair for s, pair in span.items() if s < lib.llama_n_seq_max(model._context) and pair != (-1, -1)}


def llamacpp_holds(model: LlamaCppModel, rows: list[list[int]]) -> None:
    """Each row's sequence spans its tokens, and no other sequence holds a cell."""
    state = cache_state(model)
    assert state == {s: (0, len(r) - 1) for s, r in zip(model._sequences, rows) if r}, f"the sequences' spans: {state}"


def _earlier_siblings_seen(real):
    """``tree_sequences`` as if each node's later siblings hung under it too: it joins the sequences of the leaves
    below them, so they attend to it (at their own position). The batch stays one llama.cpp accepts: each sequence's
    positions still rise along the batch and coupled sequences still hold the same cells."""

    def sequences(ancestors, owners, valid):
        nodes = ancestors.shape[1]
        above = ancestors & ~torch.eye(nodes, dtype=torch.bool)
        siblings = (above[:, :, None, :] == above[:, None, :, :]).all(-1)  # [B, N, N]: the same ancestors
        later = siblings & (torch.arange(nodes)[:, None] > torch.arange(nodes))  # [b, i, j]: i a later sibling of j
        below_a_later_sibling = torch.bmm(ancestors.float(), later.float()) > 0  # [b, leaf, j]
        return real(ancestors | below_a_later_sibling, owners, valid)

    return sequences


def _positions_one_further(patch, model: LlamaCppModel) -> None:
    lengths = LlamaCppModel.lengths.fget
    assert lengths is not None
    patch.setattr(LlamaCppModel, "lengths", property(lambda self: lengths(self) + 1))


# llama.cpp refuses (llama_decode fails) positions that do not continue a sequence's cells, and a token whose
# sequences diverged
LLAMACPP_BREAKS = {
    "later siblings see earlier ones": Break(
        lambda patch, model: patch.setattr(llamacpp, "tree_sequences", _earlier_siblings_seen(llamacpp.tree_sequences))
    ),
    "leaves not copied from their row": Break(
        lambda patch, model: patch.setattr(llamacpp.library(), "llama_memory_seq_cp", lambda *args: None),
        refused="llama_decode failed",
    ),
    "positions one further": Break(_positions_one_further, refused="llama_decode failed"),
}

BREAKS = {"hf": HF_BREAKS, "llamacpp": LLAMACPP_BREAKS}
