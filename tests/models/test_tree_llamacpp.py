"""LlamaCppModel as a TreeLanguageModel (models/base.py): a drafted tree scored in one ``llama_decode``, each leaf's
path a llama.cpp sequence (models/llamacpp.py's docstring), then one path kept.

On a tiny GGUF written from kits/tiny.py's model (kits/tinygguf.py), every check is against the adapter's own chain
``forward`` of each node's path, from the same cache state (a fresh adapter, or one rolled back).

Tolerance. llama.cpp's defaults round attention to f16 (an f16 KV cache, and flash attention, which rounds its
operands to f16 over any cache): decodes of the same tokens in other shapes, or with their cells in another order in
the cache, differ wherever a float32 difference of ~1e-7 flips an f16 rounding. Measured on these logits (magnitude
~2): up to 6.9e-4 for a tree of 68 or 124 tokens in one decode against its paths one by one, 7.4e-4 for a tree grown
in 2-4 calls against the same tree in one. That is the size of one bug these tests are after: a node one position
off moves these logits by 1.4e-4 to 3e-3 (RoPE is relative; measured over 97 nodes of 4 random trees). So the tests
run with ``llamacpp.F32_ATTENTION`` (an f32 cache, no flash attention), where only the order of float sums differs: at
most 4.8e-7 over the same cases, so TOLERANCE = 1e-5, 20 times that. The negative controls miss it by far: every node
seen one position further misses by more than SHIFTED_MISS, every node that also sees an earlier sibling by more than
SIBLING_MISS (asserted on every node they apply to). One test runs llama.cpp's defaults, at F16_ATOL.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from kits.tiny import VOCAB, tiny_model
from kits.tinygguf import save_gguf
from kits.treeforward import BAD_PATHS, BAD_TREES, KEPT_PATH, TREE, padded, path_to, random_trees, split_columns

from blockspec.models import llamacpp
from blockspec.models.base import TreeLanguageModel, left_pad
from blockspec.models.llamacpp import MAX_ROWS, LlamaCppModel
from blockspec.models.vocab_cut import VocabularyCut, cut_vocabulary, read_cut

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.usefixtures("one_thread", "f32_attention")

TOLERANCE = 1e-5  # |tree - chain| with f32 attention (module docstring)
F16_ATOL = 5e-3  # the same with llama.cpp's f16 attention, as tests/engine/test_llamacpp.py bounds it
SHIFTED_MISS = 1e-4  # the least a node one position further misses its logits by (measured: 2.7e-4 in that test)
SIBLING_MISS = 1e-2  # the least a node that also sees an earlier sibling misses them by (measured: 7.4e-2)
ROWS = [[1, 2, 3, 4, 5], [6], [], [7, 8, 9, 10, 11, 12, 13, 14]]  # different lengths, an empty row included


@pytest.fixture
def f32_attention(monkeypatch):
    monkeypatch.setattr(llamacpp, "F32_ATTENTION", True)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return save_gguf(tiny_model(sharpness=5.0), tmp_path_factory.mktemp("gguf") / "target.gguf")


def adapter(path: str | Path) -> LlamaCppModel:
    return LlamaCppModel(path, None, eos_token_ids=(VOCAB - 1,), threads=1)


def forward(model, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    return model.forward(tokens, torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid)


def miss(actual: torch.Tensor, expected: torch.Tensor) -> float:
    same = actual == expected  # -inf where a cut vocabulary drops a token
    return float(torch.where(same, 0.0, actual - expected).abs().max()) if actual.numel() else 0.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, label: str, tolerance: float = TOLERANCE) -> None:
    error = miss(actual, expected)
    assert actual.shape == expected.shape and error <= tolerance, f"{label}: max |difference| {error:.3g}"


def chain_logits(model, rows, tokens, parents, valid, *, paths=None) -> torch.Tensor:
    """[B, N, V]: each valid node's logits from the adapter's chain ``forward`` of its path, after ``rows`` (prefilled
    on ``model``); one forward per column, rolled back after it. ``paths(b, node)`` gives the path of node numbers to
    run (default: the node's own, ``path_to``)."""
    model.prefill(rows)
    lengths = model.lengths
    out = torch.zeros(*tokens.shape, model.vocab_size)
    for column in range(tokens.shape[1]):
        live = valid[:, column].tolist()
        chains = [
            [int(tokens[b, a - 1]) for a in (paths or path_to)(parents[b].tolist(), column + 1)] if live[b] else []
            for b in range(len(rows))
        ]
        chain, chain_valid = left_pad(chains)
        if chain.shape[1]:
            out[:, column] = forward(model, chain, chain_valid)[:, -1]
            model.rollback(lengths)
    return out


def assert_nodes_match_their_paths(path, rows, tokens, parents, valid, logits, tolerance: float = TOLERANCE) -> None:
    expected = chain_logits(adapter(path), rows, tokens, parents, valid)
    for b in range(len(rows)):
        assert_close(logits[b][valid[b]], expected[b][valid[b]], f"row {b}", tolerance)


def test_the_llama_cpp_adapter_is_a_tree_language_model(path):
    assert isinstance(adapter(path), TreeLanguageModel)


# --- a tree scored in one forward ----------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [12, 40], ids=["39 tokens", "124 tokens"])
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("split", [False, True], ids=["one decode", "decodes of 16 tokens"])
def test_every_node_has_the_logits_of_its_path_run_as_a_chain(path, seed, nodes, split, monkeypatch):
    """Random trees with holes over rows of different lengths (an empty one included); ``split``: the adapter's
    decodes take 16 tokens at most, so a tree's nodes reach llama.cpp in several ``llama_decode`` calls."""
    if split:
        monkeypatch.setattr(llamacpp, "BATCH_TOKENS", 16)
    gen = torch.Generator().manual_seed(seed)
    model = adapter(path)
    model.prefill(ROWS)
    tokens, parents, valid = random_trees(gen, len(ROWS), nodes, holes=0.2)
    logits = model.forward_tree(tokens, parents, valid)
    assert logits.shape == (len(ROWS), nodes, VOCAB) and bool(logits.isfinite().all())
    assert model.lengths.tolist() == [len(r) for r in ROWS]  # the nodes wait for commit
    assert_nodes_match_their_paths(path, ROWS, tokens, parents, valid, logits)


def test_with_llama_cpps_own_f16_attention_every_node_has_the_logits_of_its_path(path, monkeypatch):
    """llama.cpp's defaults (an f16 cache, flash attention): the tree's mask is the same, the rounding coarser."""
    monkeypatch.setattr(llamacpp, "F32_ATTENTION", False)
    gen = torch.Generator().manual_seed(5)
    model = adapter(path)
    model.prefill(ROWS)
    tokens, parents, valid = random_trees(gen, len(ROWS), 24, holes=0.2)
    logits = model.forward_tree(tokens, parents, valid)
    assert_nodes_match_their_paths(path, ROWS, tokens, parents, valid, logits, F16_ATOL)


# --- the negative controls: what the tolerance tells apart ----------------------------------------------------------


def shifted_logits(path, rows, tokens, parents, valid) -> dict[tuple[int, int], torch.Tensor]:
    """The logits of every valid node at depth >= 2 in a row with cached tokens, run as a chain whose nodes sit one
    position further from the row than they should, as if the tree's positions were off by one: the path above the
    node is appended, its cells moved one position on (``llama_memory_seq_add``, which re-ropes their keys), then the
    node decoded after them."""
    model = adapter(path)
    lib = llamacpp.library()
    out = {}
    for b, row in enumerate(rows):
        for i in valid[b].nonzero().flatten().tolist():
            nodes = path_to(parents[b].tolist(), i + 1)
            if not row or len(nodes) < 2 or len(set(row) | {int(tokens[b, a - 1]) for a in nodes}) == 1:
                continue  # one token repeated: every position reads the same values, wherever it sits
            model.prefill([row])
            forward(model, torch.tensor([[int(tokens[b, a - 1]) for a in nodes[:-1]]]))
            memory = lib.llama_get_memory(model._context)
            lib.llama_memory_seq_add(memory, model._sequences[0], len(row), -1, 1)
            position = len(row) + len(nodes)  # one further than the node's own, len(row) + len(nodes) - 1
            sequence = np.array([[model._sequences[0]]], dtype=np.int32)
            out[b, i] = model._decode([int(tokens[b, i])], [position], sequence, outputs=True)[0]
    return out


def sibling_paths(parents: list[int], node: int) -> list[int]:
    """The node's path with its latest earlier sibling inserted above it (its own path if it has none): the context
    of a node that also sees that sibling."""
    own = path_to(parents, node)
    siblings = [a for a in range(1, node) if parents[a - 1] == parents[node - 1]]
    return own[:-1] + siblings[-1:] + own[-1:]


def test_a_node_one_position_off_or_seeing_its_sibling_misses_the_tolerance(path):
    """The tolerance has teeth: against the chain of a node sitting one position further, or of a node that also sees
    an earlier sibling, every node the control applies to misses its tree logits by far more than TOLERANCE."""
    gen = torch.Generator().manual_seed(0)
    model = adapter(path)
    model.prefill(ROWS)
    tokens, parents, valid = random_trees(gen, len(ROWS), 12, holes=0.2)
    logits = model.forward_tree(tokens, parents, valid)

    shifted = shifted_logits(path, ROWS, tokens, parents, valid)
    assert len(shifted) >= 10
    shifted_misses = [miss(logits[b, i], expected) for (b, i), expected in shifted.items()]
    assert min(shifted_misses) > SHIFTED_MISS, sorted(shifted_misses)

    has_sibling = valid.clone()
    for b in range(len(ROWS)):
        for i in valid[b].nonzero().flatten().tolist():
            has_sibling[b, i] = sibling_paths(parents[b].tolist(), i + 1) != path_to(parents[b].tolist(), i + 1)
    assert int(has_sibling.sum()) >= 8
    seeing = chain_logits(adapter(path), ROWS, tokens, parents, has_sibling, paths=sibling_paths)
    sibling_misses = [miss(logits[b, i], seeing[b, i]) for b, i in has_sibling.nonzero().tolist()]
    assert min(sibling_misses) > SIBLING_MISS, sorted(sibling_misses)
    print(f"controls: shifted >= {min(shifted_misses):.3g}, sibling >= {min(sibling_misses):.3g}")  # pytest -s


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


# Each break, and how it shows: its logits miss the check above, or llama.cpp refuses the decode (a RuntimeError from
# the adapter), as it refuses positions that do not continue a sequence's cells and a token whose sequences diverged
BROKEN = {
    "later siblings see earlier ones": "missed",
    "leaves not copied from their row": "refused",
    "positions one further": "refused",
}


@pytest.mark.parametrize("broken", BROKEN)
def test_a_broken_tree_forward_fails_the_same_check(path, broken):
    """Plausible bugs of the adapter, each caught: by the check above, or by llama.cpp itself."""
    gen = torch.Generator().manual_seed(0)
    model = adapter(path)
    model.prefill(ROWS)
    tokens, parents, valid = random_trees(gen, len(ROWS), 12, holes=0.2)
    refused = None
    with pytest.MonkeyPatch.context() as patch:  # undone before the check's own chain forwards
        if broken == "later siblings see earlier ones":
            patch.setattr(llamacpp, "tree_sequences", _earlier_siblings_seen(llamacpp.tree_sequences))
        elif broken == "leaves not copied from their row":
            patch.setattr(llamacpp.library(), "llama_memory_seq_cp", lambda *args: None)
        else:
            lengths = LlamaCppModel.lengths.fget
            assert lengths is not None
            patch.setattr(LlamaCppModel, "lengths", property(lambda self: lengths(self) + 1))
        try:
            logits = model.forward_tree(tokens, parents, valid)
        except RuntimeError as error:
            refused = error
    if BROKEN[broken] == "refused":
        assert refused is not None and "llama_decode failed" in str(refused)
        return
    assert refused is None
    with pytest.raises(AssertionError):
        assert_nodes_match_their_paths(path, ROWS, tokens, parents, valid, logits)


# --- a tree grown level by level, as a drafter reads it ---------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_a_tree_grown_by_several_forwards_is_the_tree_scored_at_once(path, seed):
    """The same random trees (holes included), once in one forward_tree and once in 1-4 consecutive calls cut at
    random columns; every node's logits, the committed path and the next forward must agree, and each node still has
    the logits of its path run as a chain."""
    gen = torch.Generator().manual_seed(10 + seed)
    whole, grown = adapter(path), adapter(path)
    whole.prefill(ROWS)
    grown.prefill(ROWS)
    rows = [list(r) for r in ROWS]
    for step in range(3):
        tokens, parents, valid = random_trees(gen, len(ROWS), 12, holes=0.2)
        expected = whole.forward_tree(tokens, parents, valid)
        parts = split_columns(12, 1 + (seed + step) % 4, gen)
        logits = torch.cat([grown.forward_tree(tokens[:, c], parents[:, c], valid[:, c]) for c in parts], dim=1)
        assert grown.lengths.tolist() == whole.lengths.tolist() == [len(r) for r in rows]
        assert_close(logits[valid], expected[valid], f"step {step}")
        if step < 2:
            assert_nodes_match_their_paths(path, rows, tokens, parents, valid, logits)
        ends = [int(v.nonzero().flatten()[-1]) + 1 if v.any() else 0 for v in valid]
        paths = [path_to(parents[b].tolist(), end) for b, end in enumerate(ends)]
        whole.commit(padded(paths))
        grown.commit(padded(paths))
        rows = [r + [int(tokens[b, a - 1]) for a in p] for b, (r, p) in enumerate(zip(rows, paths))]
        assert grown.lengths.tolist() == whole.lengths.tolist() == [len(r) for r in rows]
        after = torch.randint(1, 40, (len(ROWS), 2), generator=gen)
        assert_close(forward(grown, after), forward(whole, after), f"after step {step}")
        rows = [r + after[b].tolist() for b, r in enumerate(rows)]


def test_a_bad_level_is_refused_and_leaves_the_waiting_tree_as_it_was(path):
    """A second call's parents count the waiting nodes: 3 nodes wait, so its node 1 is node 4 and may hang under any
    of 0..3, not under 4 (itself) nor under a waiting hole."""
    model = adapter(path)
    model.prefill([[1, 2, 3]])
    first = (torch.tensor([[5, 6, 7]]), torch.tensor([[0, 0, 1]]), torch.tensor([[1, 0, 1]]).bool())
    model.forward_tree(*first)
    one = torch.tensor([[8]])
    with pytest.raises(ValueError, match=r"parents\[0, 0\] = 4 \(node 4, after the 3 nodes waiting .*\[0, 4\)"):
        model.forward_tree(one, torch.tensor([[4]]), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"parents\[0, 0\] = 2 \(node 4, after the 3 nodes waiting .*\) is a hole"):
        model.forward_tree(one, torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool))
    second = model.forward_tree(one, torch.tensor([[3]]), torch.ones(1, 1, dtype=torch.bool))
    chain = adapter(path)
    chain.prefill([[1, 2, 3]])  # node 4 hangs under node 3, under node 1: its path is 5, 7, 8
    assert_close(second[0, 0], forward(chain, torch.tensor([[5, 7, 8]]))[0, -1], "node 4")
    model.commit(torch.tensor([[1, 3, 4]]))
    assert model.lengths.tolist() == [6]
    assert_close(forward(model, torch.tensor([[9]])), forward(chain, torch.tensor([[9]])), "after the commit")


# --- commit -----------------------------------------------------------------------------------------------------------

# Two rows (one empty) hold the same tree, grown in two calls: nodes 1-4 (two children of the root, one child under
# each), then 5-7 under the waiting nodes 3, 4 and 3, where node 4 gains no child and node 3 two: a leaf that gains
# children hands its sequence on, a leaf that gains none keeps it.
LEVELS = [
    (torch.tensor([[20, 21, 22, 23]] * 2), torch.tensor([[0, 0, 1, 2]] * 2)),
    (torch.tensor([[24, 25, 26]] * 2), torch.tensor([[3, 4, 3]] * 2)),
]
GROWN_PARENTS = [0, 0, 1, 2, 3, 4, 3]


@pytest.mark.parametrize("end", range(8), ids=[f"to node {e}" for e in range(8)])
def test_every_kept_path_leaves_the_cache_as_a_chain_forward_of_it(path, end):
    """Each node as the end of the kept path (0: the empty path), the second row keeping the path to the node after
    it: lengths, the kept nodes' logits and the next forward are those of an adapter that appended the path by
    ``forward``."""
    rows = [[1, 2, 3], []]
    model, chain = adapter(path), adapter(path)
    model.prefill(rows)
    chain.prefill(rows)
    logits = torch.cat([model.forward_tree(t, p, torch.ones_like(t, dtype=torch.bool)) for t, p in LEVELS], dim=1)
    tokens = torch.cat([t for t, _ in LEVELS], dim=1)
    paths = [path_to(GROWN_PARENTS, end), path_to(GROWN_PARENTS, (end + 1) % 8)]
    model.commit(padded(paths))
    assert model.lengths.tolist() == [len(r) + len(p) for r, p in zip(rows, paths)]
    kept = padded([[int(tokens[b, a - 1]) for a in p] for b, p in enumerate(paths)], fill=0)
    if kept.shape[1]:
        kept_valid = padded([[1] * len(p) for p in paths], fill=0).bool()
        chain_logits = forward(chain, kept, kept_valid)
        for b, p in enumerate(paths):
            assert_close(logits[b, [a - 1 for a in p]], chain_logits[b, : len(p)], f"row {b}'s kept nodes")
    after = torch.tensor([[30, 31], [32, 33]])
    assert_close(forward(model, after), forward(chain, after), "the forward after the commit")


@pytest.mark.parametrize("form", ["accepted nodes", "kept mask"])
def test_a_committed_path_leaves_the_cache_as_a_chain_forward_of_it(path, form):
    """Tree steps (forward_tree in 1-3 calls, commit a random path) interleaved with chain forwards, rollbacks and a
    select, on one adapter; the same tokens by chain forwards alone on another. Every logit and length must agree."""
    gen = torch.Generator().manual_seed(1)
    tree_model, chain_model = adapter(path), adapter(path)
    rows = [list(r) for r in ROWS]
    tree_model.prefill(rows)
    chain_model.prefill(rows)
    for step in range(16):
        nodes = 1 + step % 8
        tokens, parents, valid = random_trees(gen, len(rows), nodes, holes=0.25)
        parts = split_columns(nodes, 1 + step % 3, gen)
        logits = torch.cat([tree_model.forward_tree(tokens[:, c], parents[:, c], valid[:, c]) for c in parts], 1)
        # Each row keeps the path to a random valid node, or to the root (an empty path).
        ends = [int(torch.multinomial(torch.cat([torch.ones(1), v.float()]), 1, generator=gen)) for v in valid]
        paths = [path_to(parents[b].tolist(), end) for b, end in enumerate(ends)]
        if form == "accepted nodes":
            tree_model.commit(padded(paths))
        else:
            keep = torch.zeros(len(rows), nodes, dtype=torch.bool)
            for b, p in enumerate(paths):
                keep[b, [a - 1 for a in p]] = True
            tree_model.commit(keep)

        chain_tokens = padded([[int(tokens[b, a - 1]) for a in p] for b, p in enumerate(paths)], fill=0)
        chain_valid = padded([[1] * len(p) for p in paths], fill=0).bool()
        if chain_tokens.shape[1]:
            chain_logits = forward(chain_model, chain_tokens, chain_valid)
            for b, p in enumerate(paths):
                assert_close(logits[b, [a - 1 for a in p]], chain_logits[b, : len(p)], f"step {step}, row {b}")
        assert (
            tree_model.lengths.tolist()
            == chain_model.lengths.tolist()
            == [len(r) + len(p) for r, p in zip(rows, paths)]
        )
        rows = [r + chain_tokens[b, : len(p)].tolist() for b, (r, p) in enumerate(zip(rows, paths))]

        # The next forward (1-3 tokens, some holes) sees the same cache in both.
        width = 1 + step % 3
        after = torch.randint(1, 40, (len(rows), width), generator=gen)
        after_valid = torch.rand(len(rows), width, generator=gen) < 0.8
        assert_close(
            forward(tree_model, after, after_valid)[after_valid],
            forward(chain_model, after, after_valid)[after_valid],
            f"after step {step}",
        )
        rows = [r + after[b][after_valid[b]].tolist() for b, r in enumerate(rows)]
        # Roll back into the committed path: replaying it must give the same cache again.
        keep_lengths = (tree_model.lengths - torch.randint(0, 4, (len(rows),), generator=gen)).clamp(min=1)
        keep_lengths = torch.minimum(keep_lengths, tree_model.lengths)
        tree_model.rollback(keep_lengths)
        chain_model.rollback(keep_lengths)
        rows = [r[: int(k)] for r, k in zip(rows, keep_lengths)]
        if step == 8:  # a finished row leaves the batch
            tree_model.select(torch.tensor([0, 1, 3]))
            chain_model.select(torch.tensor([0, 1, 3]))
            rows = [rows[0], rows[1], rows[3]]
    last = torch.tensor([[5]] * len(rows))
    fresh = adapter(path)
    fresh.prefill(rows)
    assert_close(forward(tree_model, last), forward(fresh, last), "the whole rows")


def cache_state(model: LlamaCppModel) -> dict[int, tuple[int, int]]:
    """(first, last) position of every llama.cpp sequence id the context has, for those holding any cell."""
    lib = llamacpp.library()
    memory = lib.llama_get_memory(model._context)
    span = {s: (lib.llama_memory_seq_pos_min(memory, s), lib.llama_memory_seq_pos_max(memory, s)) for s in range(256)}
    return {s: pair for s, pair in span.items() if s < lib.llama_n_seq_max(model._context) and pair != (-1, -1)}


def free_cells(model: LlamaCppModel) -> int:
    """The cells of the KV cache that hold nothing, counted by filling them: a decode of that many tokens into a
    spare sequence fits, one more token does not (llama.cpp finds no slot), then the spare sequence is removed."""
    lib = llamacpp.library()
    memory = lib.llama_get_memory(model._context)
    spare = lib.llama_n_seq_max(model._context) - 1
    assert spare not in model._sequences and lib.llama_memory_seq_pos_max(memory, spare) == -1

    def fits(count: int) -> bool:
        try:
            model._decode([1] * count, list(range(count)), np.full((count, 1), spare, dtype=np.int32), outputs=False)
            return True
        except RuntimeError:
            return False
        finally:
            lib.llama_memory_seq_rm(memory, spare, -1, -1)

    cells = int(lib.llama_n_ctx(model._context)) - int(model.lengths.sum())
    assert fits(cells) and not fits(cells + 1), "the cache holds more cells than the rows' tokens"
    return cells


def test_over_200_tree_steps_the_cache_holds_the_committed_tokens_and_nothing_else(path):
    """200 tree steps (10 nodes in 1-2 calls, a random path kept; a row near the model's context of 256 rolled back to
    its prompt): after every commit each row's sequence spans exactly its tokens and no other sequence holds a cell;
    every 50 steps the cache's free cells are counted by filling them, and only the rows' tokens take cells."""
    model = adapter(path)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]
    model.prefill(prompts)
    gen = torch.Generator().manual_seed(3)
    rows = [list(p) for p in prompts]
    for step in range(200):
        tokens, parents, valid = random_trees(gen, len(rows), 10, deep=0.7)
        for columns in split_columns(10, 1 + step % 2, gen):
            model.forward_tree(tokens[:, columns], parents[:, columns], valid[:, columns])
        ends = torch.randint(0, 11, (len(rows),), generator=gen).tolist()
        paths = [path_to(parents[b].tolist(), end) for b, end in enumerate(ends)]
        model.commit(padded(paths))
        rows = [r + [int(tokens[b, a - 1]) for a in p] for b, (r, p) in enumerate(zip(rows, paths))]
        assert cache_state(model) == {s: (0, len(r) - 1) for s, r in zip(model._sequences, rows)}, f"step {step}"
        if (step + 1) % 50 == 0:
            free_cells(model)
        if max(len(r) for r in rows) > 240:
            model.rollback(torch.tensor([len(p) for p in prompts]))
            rows = [list(p) for p in prompts]
    last = torch.tensor([[5]] * len(rows))
    fresh = adapter(path)
    fresh.prefill(rows)
    assert_close(forward(model, last), forward(fresh, last), "the whole rows")


# --- the cache's room: cells and sequence ids ------------------------------------------------------------------------


def test_the_cache_growing_mid_tree_keeps_the_logits(path, monkeypatch, caplog):
    """With MIN_CELLS = 32 the context is outgrown (a new one, the rows and the waiting tree decoded again) while trees
    grow level by level, first two paths per row (two leaves), then wider (more sequence ids than the context has):
    every logit is that of a context big enough from the start."""

    def run() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(4)
        model = adapter(path)
        model.prefill([[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]])
        out = []
        for step in range(12):
            two = torch.tensor([0, 0, 1, 2]).expand(3, 4)  # two paths of two nodes: two leaves per row
            out.append(model.forward_tree(torch.randint(1, 40, (3, 4), generator=gen), two, every(3, 4)))
            tokens, parents, valid = random_trees(gen, 3, 8, holes=0.2)
            parents = torch.where(parents == 0, torch.randint(1, 5, (3, 8), generator=gen), parents + 4)
            out.append(model.forward_tree(tokens, parents, valid)[valid])
            kept = torch.tensor([[1, 3], [2, 4], [1, -1], [-1, -1]])[step % 4]  # either path, or less
            model.commit(kept.expand(3, 2).contiguous())
        out.append(model.lengths)
        return out

    big = run()
    monkeypatch.setattr(llamacpp, "MIN_CELLS", 32)
    replays = []
    real = LlamaCppModel._replay_tree
    monkeypatch.setattr(LlamaCppModel, "_replay_tree", lambda self, tree: (replays.append(self), real(self, tree)))
    with caplog.at_level(logging.INFO, logger=llamacpp.__name__):
        grown = run()
    growths = [r for r in caplog.records if "KV cache grown" in r.getMessage()]
    assert len(growths) >= 2 and len(replays) >= 2, f"grown {len(growths)} times, {len(replays)} with a tree waiting"
    assert replays[-1]._rows_max > 3, "the sequence ids never outgrew the rows: the test did not exercise it"
    assert torch.equal(grown[-1], big[-1])
    for step, (small, reference) in enumerate(zip(grown[:-1], big[:-1])):
        assert_close(small, reference, f"call {step}")


def every(rows: int, width: int) -> torch.Tensor:
    return torch.ones(rows, width, dtype=torch.bool)


def test_a_tree_needing_more_sequences_than_llama_cpp_has_is_refused_and_the_tree_waits(path):
    """One sequence id per row and per leaf beyond a row's first, MAX_ROWS in all: 100 rows of 3 leaves need 300, and
    are refused, as is a second level that would take a waiting tree of 200 past it; what fits still runs."""
    model = adapter(path)
    rows = [[1 + b % 40] for b in range(100)]
    model.prefill(rows)
    three = torch.randint(1, 40, (100, 3)), torch.zeros(100, 3, dtype=torch.long), every(100, 3)
    with pytest.raises(ValueError, match=rf"these trees need 300 llama.cpp sequences .* more than the {MAX_ROWS}"):
        model.forward_tree(*three)
    assert model._tree is None and model.lengths.tolist() == [1] * 100
    two = model.forward_tree(three[0][:, :2], three[1][:, :2], every(100, 2))  # 200 sequences
    more = torch.full((100, 1), 7), torch.full((100, 1), 1), every(100, 1)  # under node 1: hands its sequence on
    model.forward_tree(*more)
    with pytest.raises(ValueError, match=r"these trees need 300 llama.cpp sequences"):
        model.forward_tree(torch.full((100, 1), 8), torch.full((100, 1), 1), every(100, 1))  # a sibling of node 3
    model.commit(torch.tensor([[2]] * 100))
    assert model.lengths.tolist() == [2] * 100
    chain = adapter(path)
    chain.prefill(rows)
    assert_close(two[:, 1], forward(chain, three[0][:, 1:2])[:, 0], "node 2")
    assert_close(forward(model, torch.full((100, 1), 9)), forward(chain, torch.full((100, 1), 9)), "after")


# --- refusals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", BAD_TREES.values(), ids=BAD_TREES)
def test_a_bad_tree_is_refused_and_leaves_the_cache_as_it_was(path, change, message):
    model = adapter(path)
    model.prefill([[1, 2, 3]])
    arguments = dict(zip(("tokens", "parents", "valid"), TREE)) | change
    with pytest.raises(ValueError, match=message):
        model.forward_tree(**arguments)
    # Nothing is pending and nothing was appended: the tree forward of the good tree is as if the bad never came.
    logits = model.forward_tree(*TREE)
    assert_nodes_match_their_paths(path, [[1, 2, 3]], *TREE, logits)


@pytest.mark.parametrize("bad, message", BAD_PATHS.values(), ids=BAD_PATHS)
def test_committing_anything_but_one_path_is_refused_and_the_tree_still_waits(path, bad, message):
    model = adapter(path)
    model.prefill([[1, 2, 3]])
    model.forward_tree(*TREE)
    with pytest.raises(ValueError, match=message):
        model.commit(bad)
    model.commit(KEPT_PATH)
    assert model.lengths.tolist() == [6]
    chain = adapter(path)
    chain.prefill([[1, 2, 3, 5, 7, 8]])
    assert_close(forward(model, torch.tensor([[5]])), forward(chain, torch.tensor([[5]])), "after the commit")


def test_a_tree_waiting_for_its_commit_refuses_every_call_but_a_tree_forward(path):
    model = adapter(path)
    model.prefill([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="none awaits it"):
        model.commit(torch.tensor([[1]]))
    model.forward_tree(*TREE)
    for call in (
        lambda: forward(model, torch.tensor([[4]])),
        lambda: model.rollback(torch.tensor([1])),
        lambda: model.select(torch.tensor([0])),
    ):
        with pytest.raises(RuntimeError, match="commit the tree's accepted path first"):
            call()
    model.prefill([[1, 2]])  # a new batch drops the waiting tree
    assert model.lengths.tolist() == [2] and cache_state(model) == {0: (0, 1)}
    forward(model, torch.tensor([[4]]))


def test_an_empty_tree_and_an_empty_path_change_nothing(path):
    model, chain = adapter(path), adapter(path)
    model.prefill([])  # no rows at all
    none = torch.zeros(0, 3, dtype=torch.long)
    assert model.forward_tree(none, none, none.bool()).shape == (0, 3, VOCAB)
    model.commit(torch.zeros(0, 0, dtype=torch.long))
    model.prefill([[1, 2, 3], [4]])
    chain.prefill([[1, 2, 3], [4]])
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert model.forward_tree(empty, empty, empty.bool()).shape == (2, 0, VOCAB)
    model.commit(torch.zeros(2, 0, dtype=torch.long))
    model.forward_tree(torch.tensor([[5], [6]]), torch.zeros(2, 1, dtype=torch.long), every(2, 1))
    model.commit(torch.tensor([[-1], [-1]]))  # the verifier's accepted_nodes when nothing is accepted
    assert model.lengths.tolist() == [3, 1] and cache_state(model) == {0: (0, 2), 1: (0, 0)}
    assert_close(forward(model, torch.tensor([[7], [7]])), forward(chain, torch.tensor([[7], [7]])), "after")


# --- a draft of a cut vocabulary -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("probes_in_a_temporary_cache")  # the cut GGUF goes to the model cache
def test_a_cut_vocabulary_scores_trees_through_the_model_it_wraps(path):
    """``VocabularyCut`` (vocab_cut.py) over the adapter is a TreeLanguageModel: a tree's nodes read as the cut reads
    them, and their logits are its chain forward's, -inf on the dropped ids."""
    copy = cut_vocabulary(Path(path), 20)
    model = VocabularyCut(LlamaCppModel(copy, None, threads=1), *read_cut(copy), eos_token_ids=(VOCAB - 1,))
    chain = VocabularyCut(LlamaCppModel(copy, None, threads=1), *read_cut(copy), eos_token_ids=(VOCAB - 1,))
    assert isinstance(model, TreeLanguageModel)
    rows = [[1, 2, 30], [25]]  # 30 and 25 are dropped ids, read as kept ones
    gen = torch.Generator().manual_seed(6)
    tokens, parents, valid = random_trees(gen, 2, 6, holes=0.2)
    tokens[0, 0] = 33
    model.prefill(rows)
    logits = model.forward_tree(tokens, parents, valid)
    assert logits.shape == (2, 6, VOCAB) and bool((logits[valid][:, 20:-1] == float("-inf")).all())
    expected = chain_logits(chain, rows, tokens, parents, valid)
    for b in range(2):
        assert_close(logits[b][valid[b]], expected[b][valid[b]], f"row {b}")
    ends = [int(v.nonzero().flatten()[-1]) + 1 for v in valid]
    model.commit(padded([path_to(parents[b].tolist(), end) for b, end in enumerate(ends)]))
    assert model.lengths.tolist() == [
        len(r) + len(path_to(parents[b].tolist(), e)) for b, (r, e) in enumerate(zip(rows, ends))
    ]
