"""The ``TreeLanguageModel`` protocol (models/base.py), one suite for every adapter: a drafted tree scored in one
forward or grown level by level, one path of it kept, and the calls refused, on random trees with holes over rows of
different lengths.

Each test runs once per adapter (``adapter``, a kits/treeforward.py ``Adapter``), which supplies what differs: how the
model is built, the reference a node's logits must equal (those of its path run as a chain after its row) and the
tolerance.
- ``hf``: HFModel on kits/tiny.py's model in float32, on each device (tests/conftest.py's ``devices``), against
  transformers' own forward of each whole row (no cache, no mask), at HF_TOLERANCE (1e-5, absolute and relative).
- ``llamacpp``: LlamaCppModel on a GGUF written from the same model (kits/tinygguf.py), with ``llamacpp.F32_ATTENTION``
  on, against its own chain forward, at LLAMACPP_TOLERANCE (1e-5, absolute); test_tree_llamacpp.py's docstring says
  why. Skipped without llama-cpp-python.
What one adapter alone has is tested in its own file: test_tree_model.py, test_tree_llamacpp.py.
"""

from __future__ import annotations

import pytest
import torch
from kits.tiny import VOCAB, tiny_model
from kits.tinygguf import save_gguf
from kits.treeforward import (
    BAD_PATHS,
    BAD_TREES,
    BREAKS,
    KEPT_PATH,
    ROWS,
    TREE,
    Adapter,
    assert_every_node_has_the_logits_of_its_path,
    assert_nodes_match_their_paths,
    forward,
    hf_adapter,
    llamacpp_adapter,
    padded,
    path_to,
    random_trees,
    split_columns,
)

from blockspec.models import llamacpp
from blockspec.models.base import TreeLanguageModel, left_pad

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(device):
    return tiny_model(sharpness=5.0).to(device)  # 4 query heads share 2 key/value heads, as grouped_sdpa expects


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> str:
    pytest.importorskip("llama_cpp")
    return save_gguf(tiny_model(sharpness=5.0), tmp_path_factory.mktemp("gguf") / "target.gguf")


@pytest.fixture(params=["hf", "llamacpp"])
def adapter(request, device, monkeypatch) -> Adapter:
    if request.param == "hf":
        return hf_adapter(request.getfixturevalue("tiny"))
    if device != "cpu":
        pytest.skip("llama.cpp runs on the CPU alone: its tests run once, with the CPU's")
    monkeypatch.setattr(llamacpp, "F32_ATTENTION", True)  # the premise of its tolerance
    return llamacpp_adapter(request.getfixturevalue("gguf"))


def test_the_adapter_is_a_tree_language_model(adapter):
    assert isinstance(adapter.new(), TreeLanguageModel)


# --- a tree scored in one forward ----------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [12, 40], ids=["12 nodes a row", "40 nodes a row"])
@pytest.mark.parametrize("seed", range(3))
def test_every_node_has_the_logits_of_its_path_run_as_a_chain(adapter, seed, nodes):
    assert_every_node_has_the_logits_of_its_path(adapter, seed, nodes)


@pytest.mark.parametrize(
    "adapter, broken", [(name, broken) for name, breaks in BREAKS.items() for broken in breaks], indirect=["adapter"]
)
def test_a_broken_tree_forward_fails_the_same_check(adapter, broken):
    """Plausible bugs of each adapter, each caught: by the check every node passes above, or by the backend itself."""
    gen = torch.Generator().manual_seed(0)
    model = adapter.new()
    model.prefill(ROWS)
    tokens, parents, valid = random_trees(gen, len(ROWS), 12, holes=0.2)
    has_siblings = any(len(set(p)) < len(p) for p in (parents[b][valid[b]].tolist() for b in range(len(ROWS))))
    assert has_siblings and any(len(path_to(parents[0].tolist(), a)) >= 3 for a in range(1, 13) if valid[0, a - 1])
    bug = BREAKS[adapter.name][broken]
    with pytest.MonkeyPatch.context() as patch:  # undone before the check's reference runs
        bug.apply(patch, model)
        if bug.refused is not None:
            with pytest.raises(RuntimeError, match=bug.refused):
                model.forward_tree(tokens, parents, valid)
            return
        logits = model.forward_tree(tokens, parents, valid)
    with pytest.raises(AssertionError):
        assert_nodes_match_their_paths(adapter, ROWS, tokens, parents, valid, logits)


# --- a tree grown level by level, as a drafter reads it ---------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_a_tree_grown_by_several_forwards_is_the_tree_scored_at_once(adapter, seed):
    """The same random trees (holes included), once in one forward_tree and once in 1-4 consecutive calls cut at
    random columns (a call's parents point at the waiting nodes and its own); every node's logits, the committed path
    and the next forward must agree, and each node still has the logits of its path run as a chain."""
    gen = torch.Generator().manual_seed(10 + seed)
    whole, grown = adapter.new(), adapter.new()
    whole.prefill(ROWS)
    grown.prefill(ROWS)
    rows = [list(r) for r in ROWS]
    for step in range(3):
        tokens, parents, valid = random_trees(gen, len(ROWS), 12, holes=0.2)
        expected = whole.forward_tree(tokens, parents, valid)
        parts = split_columns(12, 1 + (seed + step) % 4, gen)
        logits = torch.cat([grown.forward_tree(tokens[:, c], parents[:, c], valid[:, c]) for c in parts], dim=1)
        assert grown.lengths.tolist() == whole.lengths.tolist() == [len(r) for r in rows]  # the nodes wait
        mask = valid.to(logits.device)
        adapter.assert_close(logits[mask], expected[mask], f"step {step}")
        if step < 2:
            assert_nodes_match_their_paths(adapter, rows, tokens, parents, valid, logits)
        ends = [int(v.nonzero().flatten()[-1]) + 1 if v.any() else 0 for v in valid]
        paths = [path_to(parents[b].tolist(), end) for b, end in enumerate(ends)]
        whole.commit(padded(paths))
        grown.commit(padded(paths))
        rows = [r + [int(tokens[b, a - 1]) for a in p] for b, (r, p) in enumerate(zip(rows, paths))]
        assert grown.lengths.tolist() == whole.lengths.tolist() == [len(r) for r in rows]
        after = torch.randint(1, 40, (len(ROWS), 2), generator=gen)
        adapter.assert_close(forward(grown, after), forward(whole, after), f"after step {step}")
        rows = [r + after[b].tolist() for b, r in enumerate(rows)]


def test_a_bad_level_is_refused_and_leaves_the_waiting_tree_as_it_was(adapter):
    """A second call's parents count the waiting nodes: 3 nodes wait, so its node 1 is node 4 and may hang under any
    of 0..3, not under 4 (itself) nor under a waiting hole."""
    model = adapter.new()
    model.prefill([[1, 2, 3]])
    first = (torch.tensor([[5, 6, 7]]), torch.tensor([[0, 0, 1]]), torch.tensor([[1, 0, 1]]).bool())
    model.forward_tree(*first)
    one = torch.tensor([[8]])
    with pytest.raises(ValueError, match=r"parents\[0, 0\] = 4 \(node 4, after the 3 nodes waiting .*\[0, 4\)"):
        model.forward_tree(one, torch.tensor([[4]]), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"parents\[0, 0\] = 2 \(node 4, after the 3 nodes waiting .*\) is a hole"):
        model.forward_tree(one, torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool))
    second = model.forward_tree(one, torch.tensor([[3]]), torch.ones(1, 1, dtype=torch.bool))
    # node 4 hangs under node 3, under node 1: its path is 5, 7, 8
    adapter.assert_close(second[:, 0], adapter.reference([[1, 2, 3]], [[5, 7, 8]]), "node 4")
    model.commit(torch.tensor([[1, 3, 4]]))
    assert model.lengths.tolist() == [6]
    after = adapter.reference([[1, 2, 3, 5, 7, 8]], [[9]])
    adapter.assert_close(forward(model, torch.tensor([[9]]))[:, 0], after, "after the commit")


# --- commit -----------------------------------------------------------------------------------------------------------

# Two rows (one empty) hold the same tree, grown in two calls: nodes 1-4 (two children of the root, one child under
# each), then 5-7 under the waiting nodes 3, 4 and 3, where node 4 gains no child and node 3 two (on llama.cpp, a leaf
# that gains children hands its sequence on, a leaf that gains none keeps it).
LEVELS = [
    (torch.tensor([[20, 21, 22, 23]] * 2), torch.tensor([[0, 0, 1, 2]] * 2)),
    (torch.tensor([[24, 25, 26]] * 2), torch.tensor([[3, 4, 3]] * 2)),
]
GROWN_PARENTS = [0, 0, 1, 2, 3, 4, 3]


@pytest.mark.parametrize("end", range(8), ids=[f"to node {e}" for e in range(8)])
def test_every_kept_path_leaves_the_cache_as_a_chain_forward_of_it(adapter, end):
    """Each node as the end of the kept path (0: the empty path), the second row keeping the path to the node after
    it: lengths, the kept nodes' logits and the next forward are those of a model that appended the path by
    ``forward``."""
    rows = [[1, 2, 3], []]
    model, chain = adapter.new(), adapter.new()
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
            adapter.assert_close(logits[b, [a - 1 for a in p]], chain_logits[b, : len(p)], f"row {b}'s kept nodes")
    after = torch.tensor([[30, 31], [32, 33]])
    adapter.assert_close(forward(model, after), forward(chain, after), "the forward after the commit")


@pytest.mark.parametrize("form", ["accepted nodes", "kept mask"])
def test_a_committed_path_leaves_the_cache_as_a_chain_forward_of_it(adapter, form):
    """Tree steps (forward_tree in 1-3 calls, commit a random path) interleaved with chain forwards, rollbacks and a
    select, on one model; the same tokens by chain forwards alone on another. Every logit and length must agree, and
    the last logits are the reference's of the whole rows."""
    gen = torch.Generator().manual_seed(1)
    tree_model, chain_model = adapter.new(), adapter.new()
    device = tree_model.device
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
                adapter.assert_close(logits[b, [a - 1 for a in p]], chain_logits[b, : len(p)], f"step {step}, row {b}")
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
        mask = after_valid.to(device)
        actual = forward(tree_model, after, after_valid)[mask]
        adapter.assert_close(actual, forward(chain_model, after, after_valid)[mask], f"after step {step}")
        rows = [r + after[b][after_valid[b]].tolist() for b, r in enumerate(rows)]
        # Roll back into the committed path: replaying it must give the same cache again.
        keep_lengths = (tree_model.lengths.cpu() - torch.randint(0, 4, (len(rows),), generator=gen)).clamp(min=1)
        keep_lengths = torch.minimum(keep_lengths, tree_model.lengths.cpu()).to(device)
        tree_model.rollback(keep_lengths)
        chain_model.rollback(keep_lengths)
        rows = [r[: int(k)] for r, k in zip(rows, keep_lengths)]
        if step == 8:  # a finished row leaves the batch
            tree_model.select(torch.tensor([0, 1, 3], device=device))
            chain_model.select(torch.tensor([0, 1, 3], device=device))
            rows = [rows[0], rows[1], rows[3]]
    last = forward(tree_model, torch.tensor([[5]] * len(rows)))[:, 0]
    adapter.assert_close(last, adapter.reference(rows, [[5]] * len(rows)), "the whole rows")


# --- refusals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", BAD_TREES.values(), ids=BAD_TREES)
def test_a_bad_tree_is_refused_and_leaves_the_cache_as_it_was(adapter, change, message):
    model = adapter.new()
    model.prefill([[1, 2, 3]])
    arguments = dict(zip(("tokens", "parents", "valid"), TREE)) | change
    with pytest.raises(ValueError, match=message):
        model.forward_tree(**arguments)
    # Nothing is pending and nothing was appended: the tree forward of the good tree is as if the bad never came.
    logits = model.forward_tree(*TREE)
    assert_nodes_match_their_paths(adapter, [[1, 2, 3]], *TREE, logits)


@pytest.mark.parametrize("path, message", BAD_PATHS.values(), ids=BAD_PATHS)
def test_committing_anything_but_one_path_is_refused_and_the_tree_still_waits(adapter, path, message):
    model = adapter.new()
    model.prefill([[1, 2, 3]])
    model.forward_tree(*TREE)
    with pytest.raises(ValueError, match=message):
        model.commit(path)
    model.commit(KEPT_PATH)
    assert model.lengths.tolist() == [6]
    after = adapter.reference([[1, 2, 3, 5, 7, 8]], [[5]])
    adapter.assert_close(forward(model, torch.tensor([[5]]))[:, 0], after, "after the commit")


def test_a_tree_waiting_for_its_commit_refuses_every_call_but_a_tree_forward(adapter):
    model = adapter.new()
    model.prefill([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="none awaits it"):
        model.commit(torch.tensor([[1]]))
    model.forward_tree(*TREE)
    for call in (
        lambda: forward(model, torch.tensor([[4]])),
        lambda: model.rollback(torch.tensor([1], device=model.device)),
        lambda: model.select(torch.tensor([0], device=model.device)),
    ):
        with pytest.raises(RuntimeError, match="commit the tree's accepted path first"):
            call()
    model.prefill([[1, 2]])  # a new batch drops the waiting tree
    assert model.lengths.tolist() == [2]
    adapter.assert_cache_holds(model, [[1, 2]])
    forward(model, torch.tensor([[4]]))


def test_an_empty_tree_and_an_empty_path_change_nothing(adapter):
    model = adapter.new()
    model.prefill([[1, 2, 3], [4]])
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert model.forward_tree(empty, empty, empty.bool()).shape == (2, 0, VOCAB)
    model.commit(torch.zeros(2, 0, dtype=torch.long))
    model.forward_tree(torch.tensor([[5], [6]]), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1).bool())
    model.commit(torch.tensor([[-1], [-1]]))  # the verifier's accepted_nodes when nothing is accepted
    assert model.lengths.tolist() == [3, 1]
    adapter.assert_cache_holds(model, [[1, 2, 3], [4]])
    after = adapter.reference([[1, 2, 3], [4]], [[7], [7]])
    adapter.assert_close(forward(model, torch.tensor([[7], [7]]))[:, 0], after, "after")


def test_a_batch_of_no_rows_takes_an_empty_forward_and_tree(adapter):
    model = adapter.new()
    model.prefill([])
    none = torch.zeros(0, 2, dtype=torch.long)
    assert model.forward(none, none.bool()).shape == (0, 2, VOCAB)
    none = torch.zeros(0, 3, dtype=torch.long)
    assert model.forward_tree(none, none, none.bool()).shape == (0, 3, VOCAB)
    model.commit(torch.zeros(0, 0, dtype=torch.long))
    assert model.lengths.tolist() == []


def test_the_last_column_alone_is_that_of_the_whole_forward(adapter):
    """``forward(..., last=True)``, as a draft catching up calls it (its rows left-padded, of different widths, one
    reading nothing): the logits of the whole forward's last column, zeros where that slot is a hole, and the same
    cache after it, so that the next forward is the same."""
    whole, last = adapter.new(), adapter.new()
    tokens, valid = left_pad([[20, 21, 22], [23], [], [24, 25]])
    for model in (whole, last):
        model.prefill(ROWS)
    expected = forward(whole, tokens, valid)[:, -1:]
    got = last.forward(tokens.to(last.device), valid.to(last.device), last=True)
    assert got.shape == (len(ROWS), 1, VOCAB)
    adapter.assert_close(got[valid[:, -1]].cpu(), expected[valid[:, -1]].cpu(), "the last column")
    assert not bool(got[~valid[:, -1]].any())
    assert last.lengths.tolist() == whole.lengths.tolist()
    step = torch.tensor([[26], [27], [28], [29]])
    adapter.assert_close(forward(last, step).cpu(), forward(whole, step).cpu(), "the next forward")
