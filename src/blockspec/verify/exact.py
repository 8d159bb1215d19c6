"""Closed forms given a drafted block: acceptance survival, the law of tau, the emitted token's distribution.

They integrate exactly over the random part of a verifier, so two rules can be compared on the SAME drafts
with no sampling noise, and losslessness can be checked by enumeration (tests/test_exact_law.py).
"""

from __future__ import annotations

import torch

from .base import final_distribution, positive_part_mass, prepare, renamed
from .block import block_acceptance, block_weights
from .token import token_acceptance

METHODS = ("token", "block")


@renamed(num_draft="num_verified")
def acceptance_survival(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] or None (one-hot draft)
    target_probs: torch.Tensor,  # [B, K+1, V]
    method: str,
    num_verified: torch.Tensor | None = None,  # [B] int64
    *,
    validate: bool = True,
) -> torch.Tensor:
    """P(tau >= i | drafted block) for i = 0..K, as [B, K+1] (column 0 is 1).

    token: prod_{k <= i} min(1, ratio_k).   block: 1 - prod_{j >= i} (1 - h_j) (tau is the LAST hit).
    """
    _check_method(method)
    num_verified = prepare(draft_tokens, draft_probs, target_probs, num_verified, None, validate)
    if method == "token":
        accept = token_acceptance(draft_tokens, draft_probs, target_probs, num_verified)
        survival = accept.cumprod(-1)
    else:
        h, _ = block_acceptance(draft_tokens, draft_probs, target_probs, num_verified)
        # prod_{j >= i} (1 - h_j): a cumulative product over the reversed positions.
        none_from = (1.0 - h).flip(-1).cumprod(-1).flip(-1)
        survival = 1.0 - none_from
    return torch.nn.functional.pad(survival, (1, 0), value=1.0)


@renamed(num_draft="num_verified")
def expected_accepted(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] or None (one-hot draft)
    target_probs: torch.Tensor,  # [B, K+1, V]
    method: str,
    num_verified: torch.Tensor | None = None,  # [B] int64
    *,
    validate: bool = True,
) -> torch.Tensor:
    """E[num_accepted | drafted block] under ``method`` ("token" or "block"), as [B] float."""
    survival = acceptance_survival(draft_tokens, draft_probs, target_probs, method, num_verified, validate=validate)
    return survival[:, 1:].sum(-1)


@renamed(num_draft="num_verified")
def accepted_length_law(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    method: str,
    num_verified: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """P(tau = i | drafted block) for i = 0..K, as [B, K+1]; each row sums to 1."""
    survival = acceptance_survival(draft_tokens, draft_probs, target_probs, method, num_verified, validate=validate)
    return survival - torch.nn.functional.pad(survival[:, 1:], (0, 1), value=0.0)


@renamed(num_draft="num_verified")
def final_distributions(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    method: str,
    num_verified: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """[B, K+1, V]: row i is the normalised law of the token emitted after tau = i (meaningful for i <= n)."""
    _check_method(method)
    num_verified = prepare(draft_tokens, draft_probs, target_probs, num_verified, None, validate)
    batch, width = draft_tokens.shape
    if method == "block":
        _, log_w = block_acceptance(draft_tokens, draft_probs, target_probs, num_verified)
    else:
        log_w = torch.zeros(batch, width + 1, dtype=target_probs.dtype, device=target_probs.device)
    rows = []
    for i in range(width + 1):
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


def agreement(draft_probs: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """sum_v min(draft_probs[..., v], other[..., v]) per position, [B, K] from two [B, K, V]: the probability that
    the token rule accepts position i's draft once the ones before it were, when ``other`` is the target."""
    ones = torch.ones(draft_probs.shape[:2], dtype=draft_probs.dtype, device=draft_probs.device)
    return 1.0 - positive_part_mass(ones, other, draft_probs)


def position_gains(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor,  # [B, K, V] (``draft_distributions`` for a one-hot draft)
    other: torch.Tensor,  # [B, >=K, V]: the target's distributions (exact gains) or a stand-in's (a guess)
    method: str,
) -> torch.Tensor:
    """g_i [B, K]: what verifying x_i adds to E[tau] once x_<i are drafted, so that E[tau] = sum of the first n.

        token:  g_i = prod_{j<i} min(1, ratio_j) * sum_v min(draft_i(v), other_i(v))
        block:  g_i = sum_v min(draft_i(v), w_{i-1} other_i(v))      (w as in ``block_weights``; Sun et al.)

    Column i depends on x_<i and the distributions at position i, never on x_i: a length policy that decides
    on position i from it is a stopping rule, so verification stays lossless whatever ``other`` is.
    """
    _check_method(method)
    other = other[:, : draft_tokens.shape[1]]
    index = draft_tokens[..., None]
    draft_at = draft_probs.gather(-1, index).squeeze(-1).clamp(min=torch.finfo(draft_probs.dtype).tiny)
    log_ratio = other.gather(-1, index).squeeze(-1).log() - draft_at.log()  # [B, K]; -inf where other is 0
    if method == "token":
        shifted = torch.nn.functional.pad(log_ratio.clamp(max=0.0), (1, 0))[:, :-1]  # column i: log min(1, ratio_{i-1})
        return shifted.cumsum(-1).exp() * agreement(draft_probs, other)  # prod_{j<i} min(1, ratio_j) * overlap_i
    w = block_weights(log_ratio)[:, :-1].exp()  # w_0 .. w_{K-1}
    return w - positive_part_mass(w, other, draft_probs)  # sum_v min(draft_i, w_{i-1} other_i)


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
