"""HFModel as a TreeLanguageModel, what it alone has: rows that do not affect each other, a cache bounded over 2000
tokens, greedy tree steps through the verifier, each on every device. The protocol itself (every node's logits, trees
grown level by level, commits, refusals) is test_tree_protocol.py's, for every adapter.

Every check is in float32 on the tiny models of kits/tiny.py, against transformers' own forward (no cache, no mask)
or HFModel's chain ``forward``, at HF_TOLERANCE (kits/treeforward.py says why).
"""

from __future__ import annotations

import pytest
import torch
from kits.enginekit import reference_greedy
from kits.tiny import perturbed, tiny_model
from kits.treeforward import ROWS, forward, hf_adapter, hf_close, padded, path_to, random_trees

from blockspec.models.hf import HFModel
from blockspec.verify import verify_tree_greedy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model(device):
    return tiny_model(sharpness=5.0).to(device)  # 4 query heads share 2 key/value heads, as grouped_sdpa expects


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
        alone_logits = alone.forward_tree(tokens[rows], parents[rows], valid[rows])
        hf_close(alone_logits[0][valid[b]], logits[b][valid[b]], f"row {b}'s tree")
        alone.commit(paths[rows])
        assert alone.lengths.tolist() == [committed[b]]
        hf_close(forward(alone, after[rows])[0], after_logits[b], f"row {b} after the commit")


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
    final = forward(adapter, torch.tensor([[5]] * len(rows)))[:, 0]
    hf_close(final, hf_adapter(model).reference(rows, [[5]] * len(rows)), "the whole rows")


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
