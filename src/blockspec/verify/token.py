"""Token verification: the standard speculative sampling rule (Leviathan et al. 2023; Chen et al. 2023)."""

from __future__ import annotations

import torch

from .base import (
    Randomness,
    VerifyOutput,
    agreement,
    drafted_log_ratio,
    draw_uniforms,
    emit,
    prepare,
    probs_of_drafted,
    sample_final,
    verified_mask,
)


def token_acceptance(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] or None (one-hot draft)
    target_probs: torch.Tensor,  # [B, K+1, V]
    num_verified: torch.Tensor,  # [B] int64
) -> torch.Tensor:
    """a_i = min(1, ratio_i), the probability of accepting x_i once x_1..x_{i-1} were accepted; [B, K], 0 on padding."""
    draft_at, target_at = probs_of_drafted(draft_tokens, draft_probs, target_probs)
    accept = (target_at / draft_at).clamp(max=1.0)
    return torch.where(verified_mask(num_verified, draft_tokens.shape[1]), accept, 0.0)


def token_survival(draft_tokens, draft_probs, target_probs, num_verified) -> torch.Tensor:
    """P(tau >= i | drafted block) = prod_{k <= i} min(1, ratio_k) for i = 1..K, [B, K] (arguments as above)."""
    return token_acceptance(draft_tokens, draft_probs, target_probs, num_verified).cumprod(-1)


def token_final_log_weight(draft_tokens, draft_probs, target_probs, num_verified) -> torch.Tensor:
    """log w_i = 0 for i = 0..K, [B, K+1]: after a rejection the token rule samples max(target - draft, 0)."""
    batch, width = draft_tokens.shape
    return torch.zeros(batch, width + 1, dtype=target_probs.dtype, device=target_probs.device)


def token_gains(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """g_i = prod_{j<i} min(1, ratio_j) * sum_v min(draft_i(v), other_i(v)), [B, K] (``exact.position_gains``)."""
    log_ratio = drafted_log_ratio(draft_tokens, draft_probs, other)
    shifted = torch.nn.functional.pad(log_ratio.clamp(max=0.0), (1, 0))[:, :-1]  # column i: log min(1, ratio_{i-1})
    return shifted.cumsum(-1).exp() * agreement(draft_probs, other)


def verify_token(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] float32/64, or None for a one-hot draft
    target_probs: torch.Tensor,  # [B, K+1, V] same dtype
    *,
    num_verified: torch.Tensor | None = None,  # [B] int64 in [0, K]; default K
    generator: torch.Generator | None = None,
    randomness: Randomness | None = None,
    validate: bool = True,
) -> VerifyOutput:
    """Accept x_i with probability min(1, ratio_i) and stop at the FIRST rejection; then emit one more token.

    On a rejection at x_{tau+1} the extra token comes from normalize(max(target_probs[tau] - draft_probs[tau], 0)),
    after all n drafted tokens from target_probs[n]. Guarantee: if x_i ~ draft_probs[i-1], the emitted tokens
    are distributed exactly as the target's own samples.
    """
    num_verified = prepare(draft_tokens, draft_probs, target_probs, num_verified, randomness, validate)
    uniforms = draw_uniforms(randomness, generator, target_probs, draft_tokens.shape[1])  # [B, K]
    accept = token_acceptance(draft_tokens, draft_probs, target_probs, num_verified)  # [B, K]
    accepted = uniforms < accept  # P(u < a) = a for u ~ U[0, 1); a = 0 (padding) never accepts
    tau = accepted.long().cumprod(-1).sum(-1)  # [B]: length of the accepted prefix
    weight = torch.ones_like(target_probs[:, 0, 0])
    last = sample_final(draft_tokens, draft_probs, target_probs, num_verified, tau, weight, randomness, generator)
    return emit(draft_tokens, tau, last)
