"""Verification-length policies: the stopping rule is lossless; look-ahead variants are not (exact law).

Toy context-dependent draft, companion and target tables; per drafted block the policy picks L from the
draft-companion overlap S_i and the companion's acceptance of the previous token A_{i-1}; the block is then
verified with num_verified = L. The latency table jumps at 3 scored tokens, so goodput is not concave in L.
"""

from __future__ import annotations

import pytest
import torch
from kits import lawkit

from blockspec.policy import LatencyTable, ragged_stopping_lengths, stopping_lengths
from blockspec.verify import SAMPLED_RULES, accepted_length_law, final_distributions

VOCAB, DRAFT_LEN = 3, 3
GENTLE = LatencyTable(batch_sizes=(1,), tokens=(1, 4), seconds=((1.0, 1.3),))
LATENCY = LatencyTable(batch_sizes=(1, 8), tokens=(1, 2, 3, 4), seconds=((1.0, 1.2, 1.7, 1.72), (2.0, 2.4, 3.4, 3.44)))


def features(tables: lawkit.Tables, companion: lawkit.Tables, blocks: torch.Tensor):
    """Per drafted position i: S_i (overlap of draft and companion at x_<i) and A_i = min(1, companion/draft at x_i)."""
    overlap, accept = [], []
    for i in range(blocks.shape[1]):
        draft, comp = tables.draft_at(blocks[:, :i]), companion.draft_at(blocks[:, :i])
        overlap.append(torch.minimum(draft, comp).sum(-1))
        x = blocks[:, i : i + 1]
        accept.append((comp.gather(1, x) / draft.gather(1, x)).clamp(max=1.0).squeeze(1))
    return torch.stack(overlap, 1), torch.stack(accept, 1)


def predictor(overlap_i: torch.Tensor, accept_before: torch.Tensor) -> torch.Tensor:
    return (2.0 * overlap_i * accept_before - 0.6).clamp(0.02, 0.98)


def seconds(latency=LATENCY):
    return lambda width: latency(1, 1 + width)


def stopping_policy(overlap, accept, latency=LATENCY, rule=stopping_lengths):
    """Allowed: p_i from S_i and A_{i-1} (A_0 = 1), gains as their running product, then the stopping rule."""
    before = torch.cat([torch.ones_like(accept[:, :1]), accept[:, :-1]], dim=1)
    gains = predictor(overlap, before).cumprod(1)
    return torch.stack(
        [rule(gains[b : b + 1], torch.tensor([DRAFT_LEN]), seconds(latency))[0] for b in range(len(gains))]
    )


def ragged_stopping_policy(overlap, accept):
    """The same gains under the stopping rule of a flattened batch (each row pays for its own tokens)."""
    return stopping_policy(overlap, accept, GENTLE, rule=ragged_stopping_lengths)


def gentle_stopping_policy(overlap, accept):
    """The same rule on a smooth latency curve, where it verifies every length from 0 to K."""
    return stopping_policy(overlap, accept, GENTLE)


def lookahead_policy(overlap, accept, rule=stopping_lengths):
    """NOT allowed: x_i's own A_i decides whether x_i is verified."""
    gains = predictor(overlap, accept).cumprod(1)
    return torch.stack([rule(gains[b : b + 1], torch.tensor([DRAFT_LEN]), seconds())[0] for b in range(len(gains))])


def ragged_lookahead_policy(overlap, accept):
    return lookahead_policy(overlap, accept, rule=ragged_stopping_lengths)


def argmax_policy(overlap, accept):
    """NOT allowed although every prediction uses allowed features: the global argmax over L of the goodput
    curve lets p_{i+1} (which uses A_i) decide whether x_i is verified."""
    before = torch.cat([torch.ones_like(accept[:, :1]), accept[:, :-1]], dim=1)
    survival = predictor(overlap, before).double().cumprod(1)
    emitted = torch.cat([torch.ones(len(survival), 1, dtype=torch.float64), 1 + survival.cumsum(1)], dim=1)
    cost = torch.tensor([LATENCY(1, 1 + n) for n in range(DRAFT_LEN + 1)], dtype=torch.float64)
    return (emitted / cost).argmax(1)


def step_with(policy, rule: str, tables: lawkit.Tables, companion: lawkit.Tables) -> lawkit.StepLaw:
    def step(blocks, draft_probs, target_probs):
        lengths = policy(*features(tables, companion, blocks))
        return (
            accepted_length_law(blocks, draft_probs, target_probs, rule, lengths),
            final_distributions(blocks, draft_probs, target_probs, rule, lengths),
        )

    return step


def law_errors(policy, rule):
    errors, lengths_seen = [], set()
    for seed in range(6):
        tables = lawkit.random_tables(VOCAB, DRAFT_LEN, seed=40 + seed)
        companion = lawkit.random_tables(VOCAB, DRAFT_LEN, seed=80 + seed, peaked=0.5)
        blocks = lawkit.all_blocks(VOCAB, DRAFT_LEN)
        lengths_seen |= set(policy(*features(tables, companion, blocks)).tolist())
        law = lawkit.speculative_law(tables, DRAFT_LEN, step_with(policy, rule, tables, companion))
        errors.append(lawkit.max_abs_error(law, lawkit.target_law(tables, DRAFT_LEN + 1)))
    return errors, lengths_seen


@pytest.mark.parametrize("rule", SAMPLED_RULES)
@pytest.mark.parametrize(
    ("policy", "lengths_used"),
    [(stopping_policy, {0, 1}), (gentle_stopping_policy, {0, 1, 2, 3}), (ragged_stopping_policy, {0, 1, 2, 3})],
    ids=["non-concave latency", "smooth latency", "ragged"],
)
def test_the_stopping_rule_is_lossless(policy, lengths_used, rule):
    errors, lengths = law_errors(policy, rule)
    assert max(errors) < 1e-12, errors
    assert lengths == lengths_used  # the policy really varies the verified length with the features


@pytest.mark.parametrize("rule", SAMPLED_RULES)
@pytest.mark.parametrize(
    "policy",
    [lookahead_policy, ragged_lookahead_policy, argmax_policy],
    ids=["look-ahead", "ragged look-ahead", "global-argmax"],
)
def test_policies_that_look_at_the_token_they_decide_on_are_biased(policy, rule):
    errors, _ = law_errors(policy, rule)
    assert max(errors) > 1e-4, errors


def test_goodput_here_is_not_concave_so_the_argmax_and_the_stopping_rule_differ():
    p = torch.tensor([[0.9, 0.7, 0.99]])
    assert stopping_lengths(p.cumprod(1), torch.tensor([3]), seconds()).item() == 1  # stops at the latency jump
    emitted = 1 + p[0].cumprod(0).cumsum(0)
    goodput = [1.0] + [float(emitted[n - 1]) / LATENCY(1, 1 + n) for n in (1, 2, 3)]
    assert max(range(4), key=goodput.__getitem__) == 3


def test_the_batch_widens_when_its_rows_gains_together_pay_for_it():
    p = torch.tensor([[0.99, 0.99, 0.99], [0.99, 0.99, 0.99], [0.01, 0.01, 0.01]])
    assert stopping_lengths(p[:1], torch.tensor([3]), seconds()).tolist() == [3]  # alone, a sure row goes on
    # three rows make the second position cost more than its 1.0 expected tokens; each row keeps its own cap
    assert stopping_lengths(p, torch.tensor([3, 1, 3]), lambda w: LATENCY(3, 1 + w)).tolist() == [1, 1, 1]
    assert stopping_lengths(p, torch.tensor([0, 0, 0]), lambda w: LATENCY(3, 1 + w)).tolist() == [0, 0, 0]
    # 64 rows: no single row's gain pays for a 5 % wider forward, their sum does at every position
    cheap = lambda w: 1 + 0.05 * w  # noqa: E731
    assert stopping_lengths(torch.full((64, 3), 0.9), torch.full((64,), 3), cheap).tolist() == [3] * 64
    assert stopping_lengths(torch.full((64, 3), 0.04), torch.full((64,), 3), cheap).tolist() == [0] * 64


def test_in_a_flattened_batch_each_row_verifies_what_pays_for_its_own_tokens():
    p = torch.tensor([[0.99, 0.99, 0.99], [0.99, 0.99, 0.99], [0.01, 0.01, 0.01]])
    per_token = lambda tokens: 1 + 0.1 * tokens  # noqa: E731  (each verified token costs a tenth of a plain step)
    assert ragged_stopping_lengths(p, torch.tensor([3, 3, 3]), per_token).tolist() == [3, 3, 0]  # the unsure row stops
    assert ragged_stopping_lengths(p, torch.tensor([3, 1, 3]), per_token).tolist() == [3, 1, 0]  # its own cap each
    # padded to its widest row, the same batch verifies the unsure row as far as the sure ones
    assert stopping_lengths(p, torch.tensor([3, 3, 3]), lambda width: per_token(3 * width)).tolist() == [3, 3, 3]
    # a gain of 0.4 does not pay for half a step; once a step's drafting has cost one step, it does
    half = lambda tokens: 1 + 0.5 * tokens  # noqa: E731
    assert ragged_stopping_lengths(torch.tensor([[0.4]]), torch.tensor([1]), half).tolist() == [0]
    assert ragged_stopping_lengths(torch.tensor([[0.4]]), torch.tensor([1]), half, paid=lambda i: 1.0).tolist() == [1]


def test_latency_table_interpolates_and_checks_its_axes():
    assert LATENCY(1, 2) == pytest.approx(1.2)
    assert LATENCY(4, 1) == pytest.approx(1.0 + 3 / 7)  # linear in the batch size between 1 and 8
    assert LATENCY(1, 5) == pytest.approx(1.74)  # extended linearly past the last measured width
    with pytest.raises(ValueError, match="strictly increasing"):
        LatencyTable(batch_sizes=(2, 1), tokens=(1,), seconds=((1.0,), (2.0,)))
