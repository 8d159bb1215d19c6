"""benchmarks/shape_drift.py: a row's logits one token per forward, in one wide forward, and beside other rows."""

from __future__ import annotations

import pytest
import torch
from kits.tiny import tiny_model

from blockspec.models.hf import HFModel

ROWS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


@pytest.fixture(scope="module")
def drift(benchmark_script):
    return benchmark_script("shape_drift")


class WideHotter:
    """HFModel whose forwards of more than one token per row return logits scaled by 1.01: a kernel whose numbers
    move with the forward's width, as llama.cpp's quantized products do (far more weakly than this)."""

    def __init__(self, model):
        self.adapter = HFModel(model)

    def prefill(self, rows):
        self.adapter.prefill(rows)

    def forward(self, tokens, valid):
        logits = self.adapter.forward(tokens, valid)
        return logits * 1.01 if tokens.shape[1] > 1 else logits


def test_each_way_scores_the_same_positions_and_float32_barely_moves(drift):
    model = HFModel(tiny_model(sharpness=5.0))
    reference = drift.scored(model, ROWS[:1], 3, 5, 1)
    assert reference.shape == (5, model.vocab_size)
    with torch.no_grad():  # position j's logits are those after the row's first 3 + j + 1 tokens
        expected = model.model(torch.tensor([ROWS[0][:8]])).logits[0, 3:8].double()
    assert torch.allclose(reference, expected, atol=1e-5)
    for other in (drift.scored(model, ROWS[:1], 3, 5, 5), drift.scored(model, ROWS, 3, 5, 1)):
        rows = drift.compare(reference, other)
        assert len(rows) == 5 and max(r["tv"] for r in rows) < 1e-6 and not any(r["argmax_moved"] for r in rows)


def test_a_kernel_that_moves_with_the_width_is_seen_in_the_wide_way_only(drift):
    model = WideHotter(tiny_model(sharpness=5.0))
    reference = drift.scored(model, ROWS[:1], 3, 5, 1)
    wide = drift.summary(drift.compare(reference, drift.scored(model, ROWS[:1], 3, 5, 5)))
    batched = drift.summary(drift.compare(reference, drift.scored(model, ROWS, 3, 5, 1)))
    assert wide["positions"] == batched["positions"] == 5
    assert wide["tv_median"] > 1e-4 and wide["max_logit_max"] > 1e-2
    assert batched["tv_max"] < 1e-6
