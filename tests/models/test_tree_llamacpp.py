"""LlamaCppModel as a TreeLanguageModel (models/base.py), what it alone has: a drafted tree scored in one
``llama_decode`` (or in decodes of BATCH_TOKENS), each leaf's path a llama.cpp sequence (models/llamacpp.py's
docstring); the f16 attention of its defaults; the negative controls of the tolerance; the cache's cells over 200 tree
steps and grown under a waiting tree; its 256 sequence ids; a cut vocabulary. The protocol itself (every node's logits,
trees grown level by level, commits, refusals, and the broken adapters that must fail) is test_tree_protocol.py's, for
every adapter.

On a tiny GGUF written from kits/tiny.py's model (kits/tinygguf.py), every check is against the adapter's own chain
``forward`` of each node's path, on another adapter with the rows prefilled afresh (``llamacpp_adapter``).

Tolerance. llama.cpp's defaults round attention to f16 (an f16 KV cache, and flash attention, which rounds its
operands to f16 over any cache): decodes of the same tokens in other shapes, or with their cells in another order in
the cache, differ wherever a float32 difference of ~1e-7 flips an f16 rounding. Measured on these logits (magnitude
~2): up to 6.9e-4 for a tree of 68 or 124 tokens in one decode against its paths one by one, 7.4e-4 for a tree grown
in 2-4 calls against the same tree in one. That is the size of one bug these tests are after: a node one position
off moves these logits by 1.4e-4 to 3e-3 (RoPE is relative; measured over 97 nodes of 4 random trees). So these tests
and the protocol's run with ``llamacpp.F32_ATTENTION`` (an f32 cache, no flash attention), where only the order of
float sums differs: at most 4.8e-7 over the same cases, so LLAMACPP_TOLERANCE (kits/treeforward.py) = 1e-5, 20 times
that. The negative controls miss it by far: every node seen one position further misses by more than SHIFTED_MISS,
every node that also sees an earlier sibling by more than SIBLING_MISS (asserted on every node they apply to). One
test runs llama.cpp's defaults, at F16_ATOL.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from kits.tiny import VOCAB, tiny_model
from kits.tinygguf import save_gguf
from kits.treeforward import (
    ROWS,
    Adapter,
    assert_every_node_has_the_logits_of_its_path,
    assert_nodes_match_their_paths,
    cache_state,
    chain_logits,
    chain_reference,
    forward,
    llamacpp_adapter,
    llamacpp_close,
    llamacpp_model,
    miss,
    padded,
    path_to,
    random_trees,
    split_columns,
    within,
)

from blockspec.models import llamacpp
from blockspec.models.base import TreeLanguageModel
from blockspec.models.llamacpp import MAX_ROWS, LlamaCppModel
from blockspec.models.vocab_cut import VocabularyCut, cut_vocabulary, read_cut

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.usefixtures("one_thread", "f32_attention")

F16_ATOL = 5e-3  # the same with llama.cpp's f16 attention, as tests/engine/test_llamacpp.py bounds it
SHIFTED_MISS = 1e-4  # the least a node one position further misses its logits by (measured: 2.7e-4 in that test)
SIBLING_MISS = 1e-2  # the least a node that also sees an earlier sibling misses them by (measured: 7.4e-2)


@pytest.fixture
def f32_attention(monkeypatch):
    monkeypatch.setattr(llamacpp, "F32_ATTENTION", True)


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    return save_gguf(tiny_model(sharpness=5.0), tmp_path_factory.mktemp("gguf") / "target.gguf")


@pytest.fixture
def adapter(path) -> Adapter:
    return llamacpp_adapter(path)


# --- a tree scored in one forward ----------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [12, 40], ids=["39 tokens", "124 tokens"])
@pytest.mark.parametrize("seed", range(2))
def test_in_decodes_of_16_tokens_every_node_has_the_logits_of_its_path(adapter, seed, nodes, monkeypatch):
    """The adapter's decodes take 16 tokens at most, so a tree's nodes reach llama.cpp in several ``llama_decode``
    calls."""
    monkeypatch.setattr(llamacpp, "BATCH_TOKENS", 16)
    assert_every_node_has_the_logits_of_its_path(adapter, seed, nodes)


def test_with_llama_cpps_own_f16_attention_every_node_has_the_logits_of_its_path(adapter, monkeypatch):
    """llama.cpp's defaults (an f16 cache, flash attention): the tree's mask is the same, the rounding coarser."""
    monkeypatch.setattr(llamacpp, "F32_ATTENTION", False)
    assert_every_node_has_the_logits_of_its_path(replace(adapter, assert_close=within(F16_ATOL)), 5, 24)


# --- the negative controls: what the tolerance tells apart ----------------------------------------------------------


def shifted_logits(path, rows, tokens, parents, valid) -> dict[tuple[int, int], torch.Tensor]:
    """The logits of every valid node at depth >= 2 in a row with cached tokens, run as a chain whose nodes sit one
    position further from the row than they should, as if the tree's positions were off by one: the path above the
    node is appended, its cells moved one position on (``llama_memory_seq_add``, which re-ropes their keys), then the
    node decoded after them."""
    model = llamacpp_model(path)
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


def test_a_node_one_position_off_or_seeing_its_sibling_misses_the_tolerance(path, adapter):
    """The tolerance has teeth: against the chain of a node sitting one position further, or of a node that also sees
    an earlier sibling, every node the control applies to misses its tree logits by far more than the tolerance."""
    gen = torch.Generator().manual_seed(0)
    model = adapter.new()
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
    seeing = chain_logits(adapter.reference, ROWS, tokens, parents, has_sibling, paths=sibling_paths)
    sibling_misses = [miss(logits[b, i], seeing[b, i]) for b, i in has_sibling.nonzero().tolist()]
    assert min(sibling_misses) > SIBLING_MISS, sorted(sibling_misses)
    print(f"controls: shifted >= {min(shifted_misses):.3g}, sibling >= {min(sibling_misses):.3g}")  # pytest -s


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


def test_over_200_tree_steps_the_cache_holds_the_committed_tokens_and_nothing_else(adapter):
    """200 tree steps (10 nodes in 1-2 calls, a random path kept; a row near the model's context of 256 rolled back to
    its prompt): after every commit each row's sequence spans exactly its tokens and no other sequence holds a cell;
    every 50 steps the cache's free cells are counted by filling them, and only the rows' tokens take cells."""
    model = adapter.new()
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
    last = forward(model, torch.tensor([[5]] * len(rows)))[:, 0]
    llamacpp_close(last, adapter.reference(rows, [[5]] * len(rows)), "the whole rows")


# --- the cache's room: cells and sequence ids ------------------------------------------------------------------------


def test_the_cache_growing_mid_tree_keeps_the_logits(path, monkeypatch, caplog):
    """With MIN_CELLS = 32 the context is outgrown (a new one, the rows and the waiting tree decoded again) while trees
    grow level by level, first two paths per row (two leaves), then wider (more sequence ids than the context has):
    every logit is that of a context big enough from the start."""

    def run() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(4)
        model = llamacpp_model(path)
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
        llamacpp_close(small, reference, f"call {step}")


def every(rows: int, width: int) -> torch.Tensor:
    return torch.ones(rows, width, dtype=torch.bool)


def test_a_tree_needing_more_sequences_than_llama_cpp_has_is_refused_and_the_tree_waits(path):
    """One sequence id per row and per leaf beyond a row's first, MAX_ROWS in all: 100 rows of 3 leaves need 300, and
    are refused, as is a second level that would take a waiting tree of 200 past it; what fits still runs."""
    model = llamacpp_model(path)
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
    chain = llamacpp_model(path)
    chain.prefill(rows)
    llamacpp_close(two[:, 1], forward(chain, three[0][:, 1:2])[:, 0], "node 2")
    llamacpp_close(forward(model, torch.full((100, 1), 9)), forward(chain, torch.full((100, 1), 9)), "after")


# --- a draft of a cut vocabulary -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("probes_in_a_temporary_cache")  # the cut GGUF goes to the model cache
def test_a_cut_vocabulary_scores_trees_through_the_model_it_wraps(path, adapter):
    """``VocabularyCut`` (vocab_cut.py) over the adapter is a TreeLanguageModel: a tree's nodes read as the cut reads
    them, and their logits are its chain forward's, -inf on the dropped ids."""
    copy = cut_vocabulary(Path(path), 20)

    def cut() -> VocabularyCut:
        return VocabularyCut(LlamaCppModel(copy, None, threads=1), *read_cut(copy), eos_token_ids=(VOCAB - 1,))

    cut_adapter = replace(adapter, new=cut, reference=chain_reference(cut()))  # llama.cpp's tolerance, cut models
    model = cut_adapter.new()
    assert isinstance(model, TreeLanguageModel)
    rows = [[1, 2, 30], [25]]  # 30 and 25 are dropped ids, read as kept ones
    gen = torch.Generator().manual_seed(6)
    tokens, parents, valid = random_trees(gen, 2, 6, holes=0.2)
    tokens[0, 0] = 33
    model.prefill(rows)
    logits = model.forward_tree(tokens, parents, valid)
    assert logits.shape == (2, 6, VOCAB) and bool((logits[valid][:, 20:-1] == float("-inf")).all())
    assert_nodes_match_their_paths(cut_adapter, rows, tokens, parents, valid, logits)
    ends = [int(v.nonzero().flatten()[-1]) + 1 for v in valid]
    model.commit(padded([path_to(parents[b].tolist(), end) for b, end in enumerate(ends)]))
    assert model.lengths.tolist() == [
        len(r) + len(path_to(parents[b].tolist(), e)) for b, (r, e) in enumerate(zip(rows, ends))
    ]
