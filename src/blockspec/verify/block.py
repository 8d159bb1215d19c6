"""Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding", arXiv 2403.10444)."""

from __future__ import annotations

import torch

from .base import (
    Randomness,
    VerifyOutput,
    drafted_log_ratio,
    draw_uniforms,
    emit,
    positive_part_mass,
    prepare,
    probs_of_drafted,
    sample_final,
    verified_mask,
)


def block_weights(log_ratio: torch.Tensor) -> torch.Tensor:
    """log w_i [B, K+1] from log ratio_i [B, K]: w_0 = 1, w_i = min(1, w_{i-1} * ratio_i), capped at EVERY step.

    Kept in log space: a product of ratios over- or underflows where its capped running value does not.
    """
    log_w = torch.zeros(log_ratio.shape[0], log_ratio.shape[1] + 1, dtype=log_ratio.dtype, device=log_ratio.device)
    for i in range(log_ratio.shape[1]):
        log_w[:, i + 1] = (log_w[:, i] + log_ratio[:, i]).clamp(max=0.0)
    return log_w


def block_acceptance(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] or None (one-hot draft)
    target_probs: torch.Tensor,  # [B, K+1, V]
    num_verified: torch.Tensor,  # [B] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic part of Algorithm 2: (h [B, K], log_w [B, K+1]).

        w_0 = 1,  w_i = min(1, w_{i-1} * ratio_i)          capped at EVERY step, kept in log space
        Z_i = sum_v max(w_i * target_probs[i][v] - draft_probs[i][v], 0)
        h_i = Z_i / (Z_i + 1 - w_i)  for i < n,   h_n = w_n,   h_i = 0 on padding (i > n)

    Column i of ``h`` is h_{i+1} (1-based positions); column i of ``log_w`` is log w_i (column 0 is w_0 = 1).
    """
    batch, width = draft_tokens.shape
    verified = verified_mask(num_verified, width)  # [B, K]
    draft_at, target_at = probs_of_drafted(draft_tokens, draft_probs, target_probs)
    # Padding gets ratio 0 (log -inf), so w is 0 past a row's own draft and never NaN.
    log_ratio = (target_at.log() - draft_at.log()).masked_fill(~verified, float("-inf"))  # [B, K]
    log_w = block_weights(log_ratio)
    w = log_w.exp()

    # Z_i for the positions i = 1..m-1 below the longest row's draft m, all at once: [B, m-1].
    inner = slice(1, max(int(num_verified.max()) if batch else 0, 1))
    if draft_probs is None:
        # max(w t - onehot(x_{i+1}), 0) sums to w (1 - t(x_{i+1})) since w t <= 1: no vocabulary pass.
        z = w[:, inner] * (1.0 - target_at[:, inner])
    else:
        z = positive_part_mass(w[:, inner], target_probs[:, inner], draft_probs[:, inner])
    # 1 - w first: exact for w in [1/2, 1] (Sterbenz) and >= 0, so denominator >= z and h <= 1 after rounding
    # too. (z + 1) - w rounds z's low bits away: with w = 1 it gave h above 1 (by up to 2.4e-7 in float32).
    denominator = z + (1.0 - w[:, inner])
    # Guard: the denominator is 0 only if w_i = 1 and the two distributions agree; then P(tau = i) = 0
    # whatever h_i is, and 1 is exact.
    h = torch.where(denominator > 0, z / denominator.clamp(min=torch.finfo(w.dtype).tiny), 1.0)
    h = torch.nn.functional.pad(h, (0, width - h.shape[1]))  # [B, K]: column i - 1 is h_i
    positions = torch.arange(1, width + 1, device=num_verified.device)  # 1-based
    h = torch.where(positions == num_verified[:, None], w[:, 1:], torch.where(verified, h, 0.0))
    return h, log_w


def block_survival(draft_tokens, draft_probs, target_probs, num_verified) -> torch.Tensor:
    """P(tau >= i | drafted block) = 1 - prod_{j >= i} (1 - h_j) for i = 1..K (tau is the LAST hit), [B, K]."""
    h, _ = block_acceptance(draft_tokens, draft_probs, target_probs, num_verified)
    none_from = (1.0 - h).flip(-1).cumprod(-1).flip(-1)  # prod_{j >= i} (1 - h_j): over the reversed positions
    return 1.0 - none_from


def block_final_log_weight(draft_tokens, draft_probs, target_probs, num_verified) -> torch.Tensor:
    """log w_i for i = 0..K, [B, K+1]: after tau = i the residual is max(w_i * target - draft, 0)."""
    return block_acceptance(draft_tokens, draft_probs, target_probs, num_verified)[1]


def block_gains(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """g_i = sum_v min(draft_i(v), w_{i-1} other_i(v)), [B, K] (``exact.position_gains``; Sun et al.)."""
    w = block_weights(drafted_log_ratio(draft_tokens, draft_probs, other))[:, :-1].exp()  # w_0 .. w_{K-1}
    return w - positive_part_mass(w, other, draft_probs)


def verify_block(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] float32/64, or None for a one-hot draft
    target_probs: torch.Tensor,  # [B, K+1, V] same dtype
    *,
    num_verified: torch.Tensor | None = None,  # [B] int64 in [0, K]; default K
    generator: torch.Generator | None = None,
    randomness: Randomness | None = None,
    validate: bool = True,
) -> VerifyOutput:
    """Sun et al. Algorithm 2: tau = the LARGEST i with u_i < h_i (no early stop), then one more token.

    The extra token comes from normalize(max(w_tau * target_probs[tau] - draft_probs[tau], 0)), or from
    target_probs[n] after all n drafted tokens. Lossless like token verification, and optimal in expected
    accepted tokens (so never worse than token verification on average over drafts), at the cost of K - 1
    vocabulary reductions instead of one.
    """
    num_verified = prepare(draft_tokens, draft_probs, target_probs, num_verified, randomness, validate)
    uniforms = draw_uniforms(randomness, generator, target_probs, draft_tokens.shape[1])  # [B, K]
    h, log_w = block_acceptance(draft_tokens, draft_probs, target_probs, num_verified)
    positions = torch.arange(1, draft_tokens.shape[1] + 1, device=h.device)
    hits = uniforms < h  # [B, K]; P(u < h) = h, and h = 0 (padding) never hits
    tau = torch.nn.functional.pad(hits * positions, (1, 0)).amax(-1)  # [B]: the last hit, 0 if none
    weight = log_w.gather(1, tau[:, None]).squeeze(1).exp()  # w_tau, with w_0 = 1
    last = sample_final(draft_tokens, draft_probs, target_probs, num_verified, tau, weight, randomness, generator)
    return emit(draft_tokens, tau, last)
