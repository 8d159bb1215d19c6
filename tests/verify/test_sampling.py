"""Logits processing (temperature, top-k, top-p) against plain reference implementations, and the sampler."""

from __future__ import annotations

import pytest
import torch
from kits import lawkit

from blockspec.sampling import NonFiniteLogitsError, SamplingParams, check_unsupported, process, sample
from blockspec.verify.base import argmax


def reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row at a time, with a full sort: the definition the fast version must reproduce."""
    rows = []
    for row in logits.double():
        if params.greedy:
            rows.append(torch.nn.functional.one_hot(row.argmax(), row.numel()).double())
            continue
        row = row / params.temperature
        if params.top_k:
            row = torch.where(
                row >= row.sort(descending=True).values[min(params.top_k, row.numel()) - 1], row, -torch.inf
            )
        probs = row.softmax(-1)
        if params.top_p < 1:
            ordered = probs.sort(descending=True).values
            reach = int((ordered.cumsum(0) < params.top_p).sum())  # index of the token that reaches top_p
            probs = torch.where(probs >= ordered[min(reach, row.numel() - 1)], probs, 0.0)
            probs = probs / probs.sum()
        rows.append(probs)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(top_p=0.9),
        SamplingParams(temperature=0.5, top_k=40, top_p=0.8),
        SamplingParams(top_p=0.3),
        SamplingParams(temperature=0.0),
    ],
)
def test_processing_matches_the_reference(params):
    gen = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(6, 3, 1000, generator=gen)  # [B, K+1, V]: any leading shape is kept
    fast = process(logits, params)
    assert fast.shape == logits.shape and fast.dtype == torch.float32
    torch.testing.assert_close(
        fast.reshape(-1, 1000).double(), reference(logits.reshape(-1, 1000), params), atol=2e-6, rtol=1e-4
    )
    torch.testing.assert_close(fast.sum(-1), torch.ones(6, 3), atol=1e-5, rtol=0)


def test_top_p_on_a_flat_full_vocabulary_and_in_bf16():
    """The doubling search must reach the whole vocabulary when the nucleus is wide."""
    logits = torch.zeros(2, 151936, dtype=torch.bfloat16)
    logits[1, :100] = 15.0  # 100 tied tokens hold 99.95 % of the mass
    probs = process(logits, SamplingParams(top_p=0.95))
    assert int((probs[0] > 0).sum()) == 151936  # all tied: all kept, by the documented tie rule
    assert int((probs[1] > 0).sum()) == 100 and torch.allclose(probs.sum(-1), torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_breaks_ties_to_the_lowest_id_and_allows_masked_tokens(dtype):
    logits = torch.zeros(2, 3, 151936, dtype=dtype)
    logits[0, :, [7, 900, 151935]] = 2.0  # three tied peaks per position
    logits[1, :, 5] = float("-inf")  # a masked token beside a finite peak is fine
    logits[1, 2, 151935] = 1.0
    probs = process(logits, SamplingParams(temperature=0.0))
    assert probs.dtype == torch.float32 and torch.equal(probs.sum(-1), torch.ones(2, 3))
    assert probs.argmax(-1).tolist() == [[7, 7, 7], [0, 0, 151935]]


def test_rows_processed_in_chunks_match_rows_processed_alone():
    """20 rows of 151,936 logits span two of row_chunks' chunks: each row as if processed on its own."""
    logits = 3 * torch.randn(20, 151936, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.8, top_p=0.9)
    alone = torch.cat([process(row[None], params) for row in logits])
    torch.testing.assert_close(process(logits, params), alone, atol=1e-7, rtol=1e-5)  # float32 summation order


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_processing_leaves_the_callers_logits_alone(temperature):
    logits = torch.randn(2, 50)
    before = logits.clone()
    process(logits, SamplingParams(temperature=temperature, top_k=3))
    assert torch.equal(logits, before)


BAD_ROWS = {  # logits of row 13 of 20 (the second of row_chunks' chunks at V = 151,936): what each makes of it
    "nan": lambda row: row.index_fill_(0, torch.tensor([77]), float("nan")),
    "+inf": lambda row: row.index_fill_(0, torch.tensor([151935]), float("inf")),
    "all -inf": lambda row: row.fill_(float("-inf")),
    "overflow below T = 1": lambda row: row.index_fill_(0, torch.tensor([5]), 3e38),
}


@pytest.mark.parametrize("bad", BAD_ROWS)
@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=1e-4), SamplingParams(temperature=0.7, top_k=40, top_p=0.9)],
    ids=["T=1", "T=1e-4", "top-k-p"],
)
def test_a_non_finite_row_is_refused_naming_it(bad, params):
    """In every chunk, with or without a temperature, top-k or top-p; the message names the row in the caller's
    shape. Large finite logits and masked (-inf) tokens beside finite ones are fine."""
    logits = 3 * torch.randn(20, 151936, generator=torch.Generator().manual_seed(4))
    logits[2, :1000] = float("-inf")
    logits[3, 9] = 1e35 if params.temperature == 1 else 80.0
    process(logits, params)
    if bad == "overflow below T = 1" and params.temperature == 1:
        return  # 3e38 is finite at T = 1 (row 3 is checked just above)
    BAD_ROWS[bad](logits[13])
    with pytest.raises(NonFiniteLogitsError, match=r"at 1 of 20 positions \(first at index \(13,\) of \(20,\)"):
        process(logits, params)
    with pytest.raises(NonFiniteLogitsError, match=r"first at index \(3, 1\) of \(5, 4\)"):
        process(logits.reshape(5, 4, -1), params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_argmax_is_torchs_first_maximum(dtype):
    """Ties to the first, NaN as the maximum, any leading shape, a strided view (numpy's on the CPU in float32 and
    float64, torch's otherwise)."""
    logits = torch.randint(0, 3, (4, 3, 1000), generator=torch.Generator().manual_seed(5)).to(dtype)  # many ties
    logits[1, 2, 500] = logits[1, 2, 700] = float("nan")
    logits[2, 0] = float("-inf")
    found = argmax(logits)
    assert found.dtype == torch.long and torch.equal(found, logits.argmax(-1))
    assert found[1, 2] == 500 and found[2, 0] == 0
    view = logits[:, 1, 100:]  # rows 3,000 apart
    assert torch.equal(argmax(view), view.argmax(-1))


def test_top_k_keeps_exactly_k_tokens_without_ties():
    probs = process(torch.randn(4, 100, generator=torch.Generator().manual_seed(1)), SamplingParams(top_k=7))
    assert ((probs > 0).sum(-1) == 7).all()


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1.0),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(temperature=float("nan")),
    ],
)
def test_bad_sampling_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_unsupported_options_are_named():
    with pytest.raises(ValueError, match="min_p is not supported"):
        check_unsupported({"min_p": 0.1})
    check_unsupported({})


def test_sampler_follows_the_distribution_and_never_draws_zero_mass():
    """Inversion sampling of 200k draws against the exact law (chi-square, alpha 1e-4); zeros never drawn,
    including the last id, which the rounding of u * total could otherwise land on."""
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.25, 0.05, 0.6, 0.0]]).expand(200_000, -1)
    uniforms = torch.rand(200_000, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    counts = torch.bincount(sample(probs, uniforms), minlength=7).double()
    test = lawkit.chi_square(counts, probs[0].double())
    assert test.passed, test
    edge = sample(probs[:2], torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    assert edge.tolist() == [1, 5]
