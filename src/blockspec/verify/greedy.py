"""Greedy verification: the temperature-0 rule."""

from __future__ import annotations

import torch

from .base import Randomness, VerifyOutput, argmax, emit, prepare, verified_mask


def verify_greedy(
    draft_tokens: torch.Tensor,  # [B, K] int64
    draft_probs: torch.Tensor | None,  # [B, K, V] or None: not needed by this rule
    target_probs: torch.Tensor,  # [B, K+1, V]
    *,
    num_verified: torch.Tensor | None = None,  # [B] int64 in [0, K]; default K
    generator: torch.Generator | None = None,  # unused: the rule is deterministic
    randomness: Randomness | None = None,  # unused
    validate: bool = True,
) -> VerifyOutput:
    """Accept the longest prefix with x_i == argmax target_probs[i-1]; then emit argmax target_probs[tau].

    The output equals plain greedy decoding of the target token for token; argmax ties go to the lowest id.
    """
    num_verified = prepare(draft_tokens, draft_probs, target_probs, num_verified, randomness, validate)
    choice = argmax(target_probs)  # [B, K+1]
    matches = (draft_tokens == choice[:, :-1]) & verified_mask(num_verified, draft_tokens.shape[1])
    tau = matches.long().cumprod(-1).sum(-1)  # [B]
    return emit(draft_tokens, tau, choice.gather(1, tau[:, None]).squeeze(1))
