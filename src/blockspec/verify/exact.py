"""Closed forms given a drafted block: acceptance survival, the law of tau, the emitted token's distribution.

They integrate exactly over the random part of a rule's verifier, so two rules can be compared on the SAME drafts
with no sampling noise, and losslessness can be checked by enumeration (tests/verify/test_exact_law.py). Each function
takes the rule's name and reads its closed forms from the registry (``rules``); a rule without them (greedy) is
refused.
"""

from __future__ import annotations

import torch

from .base import final_distribution, prepare
from .rules import get_rule


def acceptance_survival(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] or None (one-hot draft)
    target_probs: torch.Tensor,  # [B, K+1, V]
    rule: str,
    num_verified: torch.Tensor | None = None,  # [B] int64
    *,
    validate: bool = True,
) -> torch.Tensor:
    """P(tau >= i | drafted block) for i = 0..K, as [B, K+1] (column 0 is 1).

    token: prod_{k <= i} min(1, ratio_k).   block: 1 - prod_{j >= i} (1 - h_j) (tau is the LAST hit).
    """
    survival = get_rule(rule).survival
    if survival is None:
        raise _no_closed_form(rule, "survival")
    num_verified = prepare(draft_tokens, draft_probs, target_probs, num_verified, None, validate)
    later = survival(draft_tokens, draft_probs, target_probs, num_verified)
    return torch.nn.functional.pad(later, (1, 0), value=1.0)


def expected_accepted(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] or None (one-hot draft)
    target_probs: torch.Tensor,  # [B, K+1, V]
    rule: str,
    num_verified: torch.Tensor | None = None,  # [B] int64
    *,
    validate: bool = True,
) -> torch.Tensor:
    """E[num_accepted | drafted block] under ``rule``, as [B] float."""
    survival = acceptance_survival(draft_tokens, draft_probs, target_probs, rule, num_verified, validate=validate)
    return survival[:, 1:].sum(-1)


def accepted_length_law(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    rule: str,
    num_verified: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """P(tau = i | drafted block) for i = 0..K, as [B, K+1]; each row sums to 1."""
    survival = acceptance_survival(draft_tokens, draft_probs, target_probs, rule, num_verified, validate=validate)
    return survival - torch.nn.functional.pad(survival[:, 1:], (0, 1), value=0.0)


def final_distributions(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    rule: str,
    num_verified: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """[B, K+1, V]: row i is the normalised law of the token emitted after tau = i (meaningful for i <= n)."""
    final_log_weight = get_rule(rule).final_log_weight
    if final_log_weight is None:
        raise _no_closed_form(rule, "final distributions")
    num_verified = prepare(draft_tokens, draft_probs, target_probs, num_verified, None, validate)
    log_w = final_log_weight(draft_tokens, draft_probs, target_probs, num_verified)  # [B, K+1]
    rows = []
    for i in range(draft_tokens.shape[1] + 1):
        tau = torch.minimum(torch.full_like(num_verified, i), num_verified)
        dist = final_distribution(draft_tokens, draft_probs, target_probs, num_verified, tau, log_w[:, i].exp())
        rows.append(dist / dist.sum(-1, keepdim=True))
    return torch.stack(rows, dim=1)


def draft_distributions(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """The draft's distributions [B, K, V]: ``draft_probs``, or one-hot at ``draft_tokens`` [B, K] for a one-hot
    draft (None: greedy, or a prompt lookup proposal)."""
    if draft_probs is not None:
        return draft_probs
    return torch.nn.functional.one_hot(draft_tokens, vocab).float()


def position_gains(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor,  # [B, K, V] (``draft_distributions`` for a one-hot draft)
    other: torch.Tensor,  # [B, >=K, V]: the target's distributions (exact gains) or a stand-in's (a guess)
    rule: str,
) -> torch.Tensor:
    """g_i [B, K]: what verifying x_i adds to E[tau] once x_<i are drafted, so that E[tau] = sum of the first n.

        token:  g_i = prod_{j<i} min(1, ratio_j) * sum_v min(draft_i(v), other_i(v))
        block:  g_i = sum_v min(draft_i(v), w_{i-1} other_i(v))      (w as in ``block_weights``; Sun et al.)

    Column i depends on x_<i and the distributions at position i, never on x_i: a length policy that decides
    on position i from it is a stopping rule, so verification stays lossless whatever ``other`` is.
    """
    gains = get_rule(rule).gains
    if gains is None:
        raise _no_closed_form(rule, "position gains")
    return gains(draft_tokens, draft_probs, other[:, : draft_tokens.shape[1]])


def _no_closed_form(rule: str, form: str) -> ValueError:
    return ValueError(f"the {rule!r} rule has no closed form for its {form}")
