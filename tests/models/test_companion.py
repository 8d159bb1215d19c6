"""Companions for SV: the target-prefix companion equals the target's truncated forward, shares its weights,
rolls back like any HFModel and leaves the target untouched; load_companion refuses a foreign tokenizer."""

from __future__ import annotations

import pytest
import torch
from kits.tiny import save_tiny, tiny_model, tiny_tokenizer

from blockspec.models.base import left_pad
from blockspec.models.companion import load_companion, target_prefix
from blockspec.models.hf import HFModel

ROWS = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.fixture(scope="module")
def target():
    return HFModel(tiny_model(layers=4, sharpness=5.0), tiny_tokenizer(), name="tiny")


def reference_logits(model, row: list[int], layers: int) -> torch.Tensor:
    """[len(row), V]: the full model's hidden state after ``layers`` layers under its final norm and head.
    hidden_states[k] is the output of layer k - 1 without the final norm (only the last entry has it)."""
    with torch.no_grad():
        hidden = model(torch.tensor([row]), output_hidden_states=True).hidden_states[layers]
        return model.lm_head(model.model.norm(hidden))[0]


def run(model, prompts: list[list[int]], rest: list[list[int]]) -> torch.Tensor:
    model.prefill(prompts)
    return model.forward(*left_pad(rest))


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_prefix_logits_equal_the_targets_truncated_forward(target, layers):
    companion = target_prefix(target, layers)
    rest = [row[2:] for row in ROWS]  # rows of different lengths: left-padded with holes
    logits = run(companion, [row[:2] for row in ROWS], rest)  # [2, 5, V]
    for b, row in enumerate(ROWS):
        expected = reference_logits(target.model, row, layers)[2:]
        torch.testing.assert_close(logits[b, logits.shape[1] - len(rest[b]) :], expected, atol=1e-5, rtol=1e-5)


def test_prefix_shares_the_targets_parameters(target):
    companion = target_prefix(target, 2)
    ours, theirs = companion.model.model, target.model.model
    for mine, original in [
        (ours.embed_tokens.weight, theirs.embed_tokens.weight),
        (ours.layers[0].self_attn.q_proj.weight, theirs.layers[0].self_attn.q_proj.weight),
        (ours.layers[1].mlp.down_proj.weight, theirs.layers[1].mlp.down_proj.weight),
        (ours.norm.weight, theirs.norm.weight),
        (companion.model.lm_head.weight, target.model.lm_head.weight),
    ]:
        assert mine.data_ptr() == original.data_ptr()
    target_storage = {p.data_ptr() for p in target.model.parameters()}
    assert all(p.data_ptr() in target_storage for p in companion.model.parameters())
    assert len(ours.layers) == 2 and len(theirs.layers) == 4
    assert companion.name == "tiny[:2]" and companion.num_layers == 2
    assert companion.tokenizer is target.tokenizer and companion.eos_token_ids == target.eos_token_ids
    assert (companion.dtype, companion.device, companion.vocab_size) == (target.dtype, target.device, target.vocab_size)


def test_prefix_of_a_raw_pretrained_model():
    model = tiny_model(family="llama", layers=3)
    companion = target_prefix(model, 1)
    assert companion.model.lm_head is model.lm_head
    torch.testing.assert_close(
        run(companion, [[]], [ROWS[0]])[0], reference_logits(model, ROWS[0], 1), atol=1e-5, rtol=1e-5
    )


def test_rollback_then_forward_equals_a_fresh_companion(target):
    companion = target_prefix(target, 2)
    run(companion, ROWS, [[20, 21, 22], [23, 24, 25]])
    companion.rollback(companion.lengths - 1)  # forget 22 and 25
    after = companion.forward(torch.tensor([[30], [31]]), torch.ones(2, 1, dtype=torch.bool))  # [2, 1, V]
    fresh = target_prefix(target, 2)
    expected = run(fresh, [ROWS[0] + [20, 21], ROWS[1] + [23, 24]], [[30], [31]])
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)

    companion.select(torch.tensor([1]))  # keep the second row only
    kept = companion.forward(torch.tensor([[32]]), torch.ones(1, 1, dtype=torch.bool))
    expected = run(fresh, [ROWS[1] + [23, 24, 31]], [[32]])
    assert companion.lengths.tolist() == [len(ROWS[1]) + 4]
    torch.testing.assert_close(kept, expected, atol=1e-5, rtol=1e-5)


def test_target_is_unchanged_by_its_companion(target):
    before = run(target, ROWS, [[20, 21], [22, 23]])
    companion = target_prefix(target, 3)
    run(companion, ROWS, [[20, 21], [22, 23]])
    assert target.model.config.num_hidden_layers == 4 and len(target.model.model.layers) == 4
    torch.testing.assert_close(run(target, ROWS, [[20, 21], [22, 23]]), before, atol=0, rtol=0)


@pytest.mark.parametrize("layers", [0, 4, 5])
def test_prefix_layer_count_out_of_range(target, layers):
    with pytest.raises(ValueError, match="1 to 3 layers"):
        target_prefix(target, layers)


def test_prefix_of_an_unsupported_family():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=48, n_embd=16, n_layer=2, n_head=2, n_positions=32))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        target_prefix(model, 1)


def test_load_companion_prefix_spec(target):
    companion = load_companion("prefix:2", target)
    assert companion.name == "tiny[:2]"
    with pytest.raises(ValueError, match="prefix:K"):
        load_companion("prefix:abc", target)


def test_load_companion_from_a_directory(target, tmp_path):
    companion = load_companion(save_tiny(tmp_path / "small", seed=3), target, dtype="float32")
    assert companion.vocab_size == target.vocab_size and companion.dtype == torch.float32


def test_load_companion_refuses_another_tokenizer(target, tmp_path):
    path = tmp_path / "foreign"
    tiny_model(vocab=40).save_pretrained(path)
    tiny_tokenizer(40).save_pretrained(path)
    with pytest.raises(ValueError, match="must share the target's tokenizer"):
        load_companion(str(path), target, dtype="float32")
