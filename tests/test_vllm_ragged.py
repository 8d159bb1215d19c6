"""Block verification on vLLM's flattened ragged layout (blockspec.vllm.ragged), without vLLM.

Each request of a ragged batch must come out exactly as ``verify_block`` gives it alone, with the same draws,
when the bonus token is the one the target's row after the last drafted token gives with those draws; and the
first emitted token must follow the target's law (chi-square against it, with a broken variant that fails).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from blockspec.verify import Randomness, verify_block
from blockspec.verify.base import race
from blockspec.vllm.ragged import PLACEHOLDER, block_verify_ragged, pad_ragged


def ragged_batch(counts: list[int], vocab: int, generator: torch.Generator, max_spec_len: int):
    """Random distributions and draws for requests drafting ``counts`` tokens, in vLLM's layout, plus each
    request's own row after its last drafted token (the bonus token's distribution)."""
    total = sum(counts)
    draft_probs = torch.rand(total, vocab, generator=generator, dtype=torch.float64).pow(3)
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    target_probs = torch.rand(total, vocab, generator=generator, dtype=torch.float64).pow(3)
    target_probs /= target_probs.sum(-1, keepdim=True)
    tokens = (torch.multinomial(draft_probs, 1, generator=generator).squeeze(-1) if total
              else torch.zeros(0, dtype=torch.long))
    after = torch.rand(len(counts), vocab, generator=generator, dtype=torch.float64)
    after /= after.sum(-1, keepdim=True)
    uniforms = torch.rand(total, generator=generator, dtype=torch.float64)
    exponentials = torch.empty(len(counts), vocab, dtype=torch.float64).exponential_(generator=generator)
    bonus = race(after, exponentials)[:, None]  # what verify_block draws after all tokens, with the same draws
    return dict(draft_token_ids=tokens, num_draft_tokens=torch.tensor(counts), max_spec_len=max_spec_len,
                draft_probs=draft_probs, target_probs=target_probs, bonus_token_ids=bonus, uniforms=uniforms,
                exponentials=exponentials), after


def one_request(batch: dict, after: torch.Tensor, b: int) -> list[int]:
    """Request b verified alone by verify_block, as a list of emitted tokens."""
    counts = batch["num_draft_tokens"].tolist()
    start, n = sum(counts[:b]), counts[b]
    rows = slice(start, start + n)
    target = torch.cat([batch["target_probs"][rows], after[b:b + 1]])[None]
    randomness = Randomness(batch["uniforms"][rows][None], batch["exponentials"][b:b + 1])
    out = verify_block(batch["draft_token_ids"][rows][None], batch["draft_probs"][rows][None], target,
                       randomness=randomness)
    return [t for t in out.tokens[0].tolist() if t != -1]


@pytest.mark.parametrize("counts", [[3], [2, 0, 1], [0, 0], [1, 3, 2, 3], [4, 1]])
def test_each_request_is_verify_block_alone(counts):
    generator = torch.Generator().manual_seed(sum(counts) + len(counts))
    for _ in range(200):
        batch, after = ragged_batch(counts, 5, generator, max_spec_len=4)
        output = block_verify_ragged(**batch)
        assert output.shape == (len(counts), 5) and output.dtype == torch.int32
        for b in range(len(counts)):
            expected = one_request(batch, after, b)
            assert output[b, :len(expected)].tolist() == expected
            assert (output[b, len(expected):] == PLACEHOLDER).all()


def test_pad_ragged_places_each_request_s_rows_first():
    flat = torch.arange(6)
    padded = pad_ragged(flat, torch.tensor([2, 0, 3, 1]), 3, -1)
    assert padded.tolist() == [[0, 1, -1], [-1, -1, -1], [2, 3, 4], [5, -1, -1]]


def test_placeholder_drafts_and_inconsistent_counts_are_refused():
    generator = torch.Generator().manual_seed(0)
    batch, _ = ragged_batch([2, 1], 4, generator, max_spec_len=2)
    batch["draft_token_ids"][1] = PLACEHOLDER
    with pytest.raises(ValueError, match="placeholder"):
        block_verify_ragged(**batch)
    batch, _ = ragged_batch([2, 1], 4, generator, max_spec_len=2)
    with pytest.raises(ValueError, match="must sum"):
        block_verify_ragged(**{**batch, "num_draft_tokens": torch.tensor([1, 1])})


def first_token_counts(verify, samples: int, seed: int):
    """Counts of the first emitted token of request 1 in a batch of three, over fresh draws each time; the
    drafts and distributions stay fixed, the bonus token is drawn from its own row."""
    generator = torch.Generator().manual_seed(seed)
    batch, after = ragged_batch([1, 3, 2], 4, generator, max_spec_len=3)
    counts = torch.zeros(4)
    for _ in range(samples):
        draft = torch.multinomial(batch["draft_probs"], 1, generator=generator).squeeze(-1)
        uniforms = torch.rand(6, generator=generator, dtype=torch.float64)
        exponentials = torch.empty(3, 4, dtype=torch.float64).exponential_(generator=generator)
        bonus = torch.multinomial(after, 1, generator=generator)
        output = verify(**{**batch, "draft_token_ids": draft, "uniforms": uniforms, "exponentials": exponentials,
                           "bonus_token_ids": bonus})
        counts[output[1, 0]] += 1
    return counts, batch["target_probs"][1]  # request 1's first target row


def shifted_draft_rows(**batch):
    """Broken: each request's draft rows read one row late (an off-by-one in the ragged offsets)."""
    return block_verify_ragged(**{**batch, "draft_probs": batch["draft_probs"].roll(-1, 0)})


@pytest.mark.parametrize("verify, passes", [(block_verify_ragged, True), (shifted_draft_rows, False)])
def test_first_token_follows_the_target(verify, passes):
    samples = 4000
    counts, target = first_token_counts(verify, samples, seed=3)
    expected = samples * target
    statistic = float(((counts - expected) ** 2 / expected).sum())
    threshold = chi2.ppf(1 - 1e-4, df=len(target) - 1)  # a false alarm once in 10,000 seeds
    assert (statistic < threshold) == passes, (statistic, threshold, counts.tolist(), expected.tolist())
