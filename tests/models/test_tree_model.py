"""HFModel as a TreeLanguageModel: a drafted tree scored in one forward, then one path kept (models/base.py).

Every check is in float32 on the tiny models of kits/tiny.py, against transformers' own forward (no cache, no mask)
or HFModel's chain ``forward``. Tolerance 1e-5: the same arithmetic reduced over different key counts and batch
shapes differs by float32 rounding only (a few 1e-7 on these logits of magnitude ~10), while a node that sees one
wrong key or sits at a wrong position is off by 1e-2 or more (the negative controls below).
"""

from __future__ import annotations

import pytest
import torch
from kits.enginekit import reference_greedy
from kits.tiny import perturbed, tiny_model
from kits.treeforward import BAD_PATHS, BAD_TREES, KEPT_PATH, TREE, padded, path_to, random_trees, split_columns

from blockspec.models import hf
from blockspec.models.base import TreeLanguageModel
from blockspec.models.hf import HFModel
from blockspec.verify import verify_tree_greedy

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5  # absolute and relative
ROWS = [[1, 2, 3, 4, 5], [6], [], [7, 8, 9, 10, 11, 12, 13, 14]]  # different lengths, an empty row included


@pytest.fixture(scope="module")
def model(device):
    return tiny_model(sharpness=5.0).to(device)  # 4 query heads share 2 key/value heads, as grouped_sdpa expects


def assert_nodes_match_their_paths(model, rows, tokens, parents, valid, logits):
    """Every valid node's logits equal the last logits of transformers' forward of its row and its path."""
    for b, row in enumerate(rows):
        for i in valid[b].nonzero().flatten().tolist():
            chain = row + [int(tokens[b, a - 1]) for a in path_to(parents[b].tolist(), i + 1)]
            with torch.no_grad():
                fresh = model(torch.tensor([chain], device=logits.device)).logits[0, -1]
            assert_close(logits[b, i], fresh, msg=f"row {b}, node {i + 1}")


def forward(adapter: HFModel, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``adapter.forward`` of CPU tensors (every slot valid unless ``valid`` says otherwise), on its device."""
    valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid
    return adapter.forward(tokens.to(adapter.device), valid.to(adapter.device))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
    torch.testing.assert_close(actual, expected, atol=TOLERANCE, rtol=TOLERANCE, msg=msg)


def test_hf_model_is_a_tree_language_model(model):
    assert isinstance(HFModel(model), TreeLanguageModel)


@pytest.mark.parametrize("seed", range(3))
def test_every_node_has_the_logits_of_its_path_run_as_a_chain(model, seed):
    gen = torch.Generator().manual_seed(seed)
    adapter = HFModel(model)
    adapter.prefill(ROWS)
    tokens, parents, valid = random_trees(gen, len(ROWS), 12, holes=0.2)
    logits = adapter.forward_tree(tokens, parents, valid)
    assert logits.shape == (len(ROWS), 12, model.config.vocab_size) and bool(logits.isfinite().all())
    assert adapter.lengths.tolist() == [len(r) for r in ROWS]  # the nodes wait for commit
    assert_nodes_match_their_paths(model, ROWS, tokens, parents, valid, logits)


def _siblings_see_each_other(real):
    def mask(slot_pos, ancestors, valid, dtype):
        above = ancestors & ~torch.eye(ancestors.shape[1], dtype=torch.bool, device=ancestors.device)
        siblings = (above[:, :, None, :] == above[:, None, :, :]).all(-1)  # [B, N, N]: the same ancestors
        return real(slot_pos, ancestors | siblings, valid, dtype)

    return mask


def _chain_positions(adapter: HFModel):
    """Positions counted along the columns, as a chain's forward counts them, instead of by depth."""
    real = adapter._call

    def call(layers, tokens, mask, positions, logits_to_keep):
        columns = torch.arange(tokens.shape[1], device=positions.device)
        return real(layers, tokens, mask, positions[:, :1] + columns, logits_to_keep)  # node 1 sits at lengths

    return call


@pytest.mark.parametrize("broken", ["siblings see each other", "positions along the columns"])
def test_a_broken_tree_forward_fails_the_same_check(model, broken, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    adapter = HFModel(model)
    adapter.prefill(ROWS)
    tokens, parents, valid = random_trees(gen, len(ROWS), 12, holes=0.2)
    has_siblings = any(len(set(p)) < len(p) for p in (parents[b][valid[b]].tolist() for b in range(len(ROWS))))
    assert has_siblings and any(len(path_to(parents[0].tolist(), a)) >= 3 for a in range(1, 13) if valid[0, a - 1])
    if broken == "siblings see each other":
        monkeypatch.setattr(hf, "tree_mask", _siblings_see_each_other(hf.tree_mask))
    else:
        monkeypatch.setattr(adapter, "_call", _chain_positions(adapter))
    logits = adapter.forward_tree(tokens, parents, valid)
    with pytest.raises(AssertionError):
        assert_nodes_match_their_paths(model, ROWS, tokens, parents, valid, logits)


@pytest.mark.parametrize("form", ["accepted nodes", "kept mask"])
def test_a_committed_path_leaves_the_cache_as_a_chain_forward_of_it(model, form, device):
    """Tree steps (forward_tree, commit a random path) interleaved with chain forwards, rollbacks and a select, on
    one adapter; the same tokens by chain forwards alone on another. Every logit and length must agree."""
    gen = torch.Generator().manual_seed(1)
    tree_model, chain_model = HFModel(model), HFModel(model)
    rows = [list(r) for r in ROWS]
    tree_model.prefill(rows)
    chain_model.prefill(rows)
    for step in range(16):
        nodes = 1 + step % 8
        tokens, parents, valid = random_trees(gen, len(rows), nodes, holes=0.25)
        logits = tree_model.forward_tree(tokens, parents, valid)
        # Each row keeps the path to a random valid node, or to the root (an empty path).
        ends = [int(torch.multinomial(torch.cat([torch.ones(1), v.float()]), 1, generator=gen)) for v in valid]
        paths = [path_to(parents[b].tolist(), end) for b, end in enumerate(ends)]
        if form == "accepted nodes":
            tree_model.commit(padded(paths))
        else:
            keep = torch.zeros(len(rows), nodes, dtype=torch.bool)
            for b, path in enumerate(paths):
                keep[b, [a - 1 for a in path]] = True
            tree_model.commit(keep)

        chain_tokens = padded([[int(tokens[b, a - 1]) for a in p] for b, p in enumerate(paths)], fill=0)
        chain_valid = padded([[1] * len(p) for p in paths], fill=0).bool()
        if chain_tokens.shape[1]:
            chain_logits = forward(chain_model, chain_tokens, chain_valid)
            for b, path in enumerate(paths):
                assert_close(logits[b, [a - 1 for a in path]], chain_logits[b, : len(path)])
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
        assert_close(forward(tree_model, after, after_valid)[mask], forward(chain_model, after, after_valid)[mask])
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
    last = torch.tensor([[5]] * len(rows))
    final = forward(tree_model, last)
    for b, row in enumerate(rows):  # and both agree with transformers' own forward of the whole row
        with torch.no_grad():
            fresh = model(torch.tensor([row + [5]], device=final.device)).logits[0, -1]
        assert_close(final[b, 0], fresh)


def test_rows_do_not_affect_each_other(model):
    """A batch of rows of different lengths, trees with holes and different paths: each row's logits are those of
    the row alone, in the tree forward and in the forward after its commit."""
    gen = torch.Generator().manual_seed(2)
    batch = HFModel(model)
    batch.prefill(ROWS)
    tokens, parents, valid = random_trees(gen, len(ROWS), 10, holes=0.3)
    logits = batch.forward_tree(tokens, parents, valid)
    ends = [int(v.nonzero().flatten()[-1]) + 1 if v.any() else 0 for v in valid]
    paths = padded([path_to(parents[b].tolist(), end) for b, end in enumerate(ends)])
    batch.commit(paths)
    committed = batch.lengths.tolist()
    after = torch.randint(1, 40, (len(ROWS), 3), generator=gen)
    after_logits = forward(batch, after)
    for b, row in enumerate(ROWS):
        alone = HFModel(model)
        alone.prefill([row])
        rows = slice(b, b + 1)
        assert_close(alone.forward_tree(tokens[rows], parents[rows], valid[rows])[0][valid[b]], logits[b][valid[b]])
        alone.commit(paths[rows])
        assert alone.lengths.tolist() == [committed[b]]
        assert_close(forward(alone, after[rows])[0], after_logits[b])


@pytest.mark.parametrize("prompts", [[[1, 2, 3]], [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10]]], ids=["one row", "two rows"])
def test_the_cache_holds_the_kept_tokens_and_one_steps_nodes_over_2000_tokens(device, prompts):
    """Over 200+ tree steps that keep 2000 tokens per row, the cache's slots stay at the kept tokens (one row) or
    within the compaction bound for holes between rows' paths of different lengths (two rows: at most twice the
    longest row), plus one step's nodes while a tree waits for its commit. The last logits must still be the
    whole row's."""
    nodes, generated = 10, 2000
    model = tiny_model(sharpness=5.0, context=4096).to(device)
    adapter = HFModel(model)
    adapter.prefill(prompts)
    cache = adapter._cache
    gen = torch.Generator().manual_seed(3)
    rows, steps = [list(p) for p in prompts], 0
    while min(len(r) - len(p) for r, p in zip(rows, prompts)) < generated:
        tokens, parents, valid = random_trees(gen, len(rows), nodes, deep=0.7)
        before = cache.slot_pos.shape[1]
        adapter.forward_tree(tokens, parents, valid)
        assert all(layer.used <= before + nodes for layer in cache.layers)  # a compaction may have come first
        # Each row keeps the path to a random node (at most `nodes` tokens, so it takes 200+ steps).
        ends = torch.randint(1, nodes + 1, (len(rows),), generator=gen).tolist()
        paths = [path_to(parents[b].tolist(), end) for b, end in enumerate(ends)]
        adapter.commit(padded(paths))
        rows = [r + [int(tokens[b, a - 1]) for a in p] for b, (r, p) in enumerate(zip(rows, paths))]
        longest = max(len(r) for r in rows)
        slots = cache.slot_pos.shape[1]
        assert all(layer.used == slots for layer in cache.layers)
        if len(rows) == 1:
            assert slots == longest, f"step {steps}: {slots} slots for {longest} tokens"
        else:
            assert slots <= max(2 * longest, 32) + nodes, f"step {steps}: {slots} slots for {longest} tokens"
        assert cache.layers[0].capacity <= 2 * (max(2 * longest, 32) + nodes)
        steps += 1
    assert steps >= 200 and adapter.lengths.tolist() == [len(r) for r in rows]
    last = torch.tensor([[5]] * len(rows))
    final = forward(adapter, last)
    for b, row in enumerate(rows):
        with torch.no_grad():
            fresh = model(torch.tensor([row + [5]], device=final.device)).logits[0, -1]
        assert_close(final[b, 0], fresh)


def test_greedy_tree_steps_through_the_verifier_reproduce_plain_greedy_decoding(model):
    """The layout docs/guide/library.md gives for a step: the token not yet cached as node 1, the drafted tree below
    it (verifier node a = node a + 1), the logits as the verifier's target rows, and commit of node 1 then
    ``accepted_nodes + 1``. Each tree holds a perturbed draft's greedy chain with a random sibling before every
    chain node, so accepted paths skip nodes."""
    draft = perturbed(model, scale=0.3, seed=1)
    gen = torch.Generator().manual_seed(4)
    prompt, length = [1, 2, 3, 4], 30
    target = HFModel(model)
    target.prefill([prompt[:-1]])
    out, pending, steps = [], prompt[-1], 0
    while len(out) < length:
        tokens, parents = [pending], [0]
        for token in reference_greedy(draft, prompt + out, 4, eos=None):
            tokens += [int(torch.randint(1, 40, (), generator=gen)), token]
            parents += [len(tokens) - 2, len(tokens) - 2]  # a sibling, then the chain's node, both under the last
        tokens, parents = torch.tensor([tokens]), torch.tensor([parents])
        logits = target.forward_tree(tokens, parents, torch.ones_like(tokens, dtype=torch.bool))
        verdict = verify_tree_greedy(tokens[:, 1:], parents[:, 1:] - 1, None, logits.cpu().softmax(-1))
        accepted = verdict.accepted_nodes
        target.commit(torch.cat([torch.ones(1, 1, dtype=torch.long), torch.where(accepted >= 0, accepted + 1, -1)], 1))
        emitted = verdict.tokens[0, : int(verdict.num_accepted[0]) + 1].tolist()
        out, pending, steps = out + emitted, emitted[-1], steps + 1
        assert target.lengths.tolist() == [len(prompt) + len(out) - 1]
    assert out[:length] == reference_greedy(model, prompt, length, eos=None)
    assert steps < length * 0.7  # paths were accepted, so nodes were skipped over


# --- a tree grown level by level, as a drafter reads it -------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_a_tree_grown_by_several_forwards_is_the_tree_scored_at_once(model, seed):
    """The same random trees (holes included), once in one forward_tree and once in 1-4 consecutive calls cut at
    random columns (a call's parents point at the waiting nodes and its own); every node's logits, the committed path
    and the next forward must agree, and each node still has the logits of its path run as a chain."""
    gen = torch.Generator().manual_seed(10 + seed)
    whole, grown = HFModel(model), HFModel(model)
    whole.prefill(ROWS)
    grown.prefill(ROWS)
    for step in range(3):
        tokens, parents, valid = random_trees(gen, len(ROWS), 12, holes=0.2)
        expected = whole.forward_tree(tokens, parents, valid)
        parts = split_columns(12, 1 + (seed + step) % 4, gen)
        logits = torch.cat([grown.forward_tree(tokens[:, c], parents[:, c], valid[:, c]) for c in parts], dim=1)
        assert grown.lengths.tolist() == whole.lengths.tolist()  # the nodes wait for commit
        mask = valid.to(logits.device)
        assert_close(logits[mask], expected[mask])
        if step == 0:
            assert_nodes_match_their_paths(model, ROWS, tokens, parents, valid, logits)
        ends = [int(v.nonzero().flatten()[-1]) + 1 if v.any() else 0 for v in valid]
        paths = padded([path_to(parents[b].tolist(), end) for b, end in enumerate(ends)])
        whole.commit(paths)
        grown.commit(paths)
        assert grown.lengths.tolist() == whole.lengths.tolist()
        after = torch.randint(1, 40, (len(ROWS), 2), generator=gen)
        assert_close(forward(grown, after), forward(whole, after))


def test_a_bad_level_is_refused_and_leaves_the_waiting_tree_as_it_was(model):
    """A second call's parents count the waiting nodes: 3 nodes wait, so its node 1 is node 4 and may hang under any
    of 0..3, not under 4 (itself) nor under a waiting hole."""
    adapter = HFModel(model)
    adapter.prefill([[1, 2, 3]])
    first = (torch.tensor([[5, 6, 7]]), torch.tensor([[0, 0, 1]]), torch.tensor([[1, 0, 1]]).bool())
    adapter.forward_tree(*first)
    one = torch.tensor([[8]])
    with pytest.raises(ValueError, match=r"parents\[0, 0\] = 4 \(node 4, after the 3 nodes waiting .*\[0, 4\)"):
        adapter.forward_tree(one, torch.tensor([[4]]), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"parents\[0, 0\] = 2 \(node 4, after the 3 nodes waiting .*\) is a hole"):
        adapter.forward_tree(one, torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool))
    second = adapter.forward_tree(one, torch.tensor([[3]]), torch.ones(1, 1, dtype=torch.bool))
    with torch.no_grad():  # node 4 hangs under node 3, under node 1: its path is 5, 7, 8
        fresh = model(torch.tensor([[1, 2, 3, 5, 7, 8]], device=second.device)).logits[0, -1]
    assert_close(second[0, 0], fresh)
    adapter.commit(torch.tensor([[1, 3, 4]]))
    assert adapter.lengths.tolist() == [6]


# --- refusals ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, message", BAD_TREES.values(), ids=BAD_TREES)
def test_a_bad_tree_is_refused_and_leaves_the_cache_as_it_was(model, change, message):
    adapter = HFModel(model)
    adapter.prefill([[1, 2, 3]])
    arguments = dict(zip(("tokens", "parents", "valid"), TREE)) | change
    with pytest.raises(ValueError, match=message):
        adapter.forward_tree(**arguments)
    # Nothing is pending and nothing was appended: the tree forward of the good tree is as if the bad never came.
    logits = adapter.forward_tree(*TREE)
    assert_nodes_match_their_paths(model, [[1, 2, 3]], *TREE, logits)


@pytest.mark.parametrize("path, message", BAD_PATHS.values(), ids=BAD_PATHS)
def test_committing_anything_but_one_path_is_refused_and_the_tree_still_waits(model, path, message):
    adapter = HFModel(model)
    adapter.prefill([[1, 2, 3]])
    adapter.forward_tree(*TREE)
    with pytest.raises(ValueError, match=message):
        adapter.commit(path)
    adapter.commit(KEPT_PATH)
    assert adapter.lengths.tolist() == [6]
    final = forward(adapter, torch.tensor([[5]]))
    with torch.no_grad():
        fresh = model(torch.tensor([[1, 2, 3, 5, 7, 8, 5]], device=final.device)).logits[0, -1]
    assert_close(final[0, 0], fresh)


def test_a_tree_waiting_for_its_commit_refuses_every_call_but_a_tree_forward(model):
    adapter = HFModel(model)
    adapter.prefill([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="none awaits it"):
        adapter.commit(torch.tensor([[1]]))
    adapter.forward_tree(*TREE)
    for call in (
        lambda: forward(adapter, torch.tensor([[4]])),
        lambda: adapter.rollback(torch.tensor([1], device=adapter.device)),
        lambda: adapter.select(torch.tensor([0], device=adapter.device)),
    ):
        with pytest.raises(RuntimeError, match="commit the tree's accepted path first"):
            call()
    adapter.prefill([[1, 2]])  # a new batch drops the waiting tree
    assert adapter.lengths.tolist() == [2]
    forward(adapter, torch.tensor([[4]]))


def test_an_empty_tree_and_an_empty_path_change_nothing(model):
    adapter = HFModel(model)
    adapter.prefill([[1, 2, 3], [4]])
    empty = torch.zeros(2, 0, dtype=torch.long)
    assert adapter.forward_tree(empty, empty, empty.bool()).shape == (2, 0, model.config.vocab_size)
    adapter.commit(torch.zeros(2, 0, dtype=torch.long))
    adapter.forward_tree(torch.tensor([[5], [6]]), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1).bool())
    adapter.commit(torch.tensor([[-1], [-1]]))  # the verifier's accepted_nodes when nothing is accepted
    assert adapter.lengths.tolist() == [3, 1]
    logits = forward(adapter, torch.tensor([[7], [7]]))
    for b, row in enumerate([[1, 2, 3, 7], [4, 7]]):
        with torch.no_grad():
            fresh = model(torch.tensor([row], device=logits.device)).logits[0, -1]
        assert_close(logits[b, 0], fresh)
