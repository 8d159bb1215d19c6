"""Broken verifiers the exact and statistical tests must catch, and the pieces they are built from."""

from __future__ import annotations

import torch

from blockspec.verify import Randomness, VerifyOutput, block_acceptance, final_distributions


def draw_randomness(target_probs, width, generator) -> Randomness:
    batch, _, vocab = target_probs.shape
    return Randomness.draw(batch, width, vocab, dtype=target_probs.dtype, generator=generator)


def emit(draft_tokens, tau, final, exponentials) -> VerifyOutput:
    """x_1..x_tau then the token drawn from ``final`` [B, V] by the exponential race; -1 after."""
    batch, width = draft_tokens.shape
    last = (final / exponentials).argmax(-1)  # P(v) = final_v / sum(final)
    padded = torch.nn.functional.pad(draft_tokens, (0, 1), value=-1)  # [B, K+1]
    tokens = torch.where(torch.arange(width + 1) < tau[:, None], padded, -1)
    tokens[torch.arange(batch), tau] = last
    return VerifyOutput(tokens=tokens, num_accepted=tau)


def all_verified(draft_tokens):
    return torch.full((draft_tokens.shape[0],), draft_tokens.shape[1], dtype=torch.long)


def verify_block_unscaled_residual(draft_tokens, draft_probs, target_probs, *, generator=None):
    """BROKEN: Algorithm 2, but the correction comes from max(target - draft, 0), dropping w_tau."""
    width = draft_tokens.shape[1]
    randomness = draw_randomness(target_probs, width, generator)
    h, _ = block_acceptance(draft_tokens, draft_probs, target_probs, all_verified(draft_tokens))
    hits = randomness.uniforms < h
    tau = torch.nn.functional.pad(hits * torch.arange(1, width + 1), (1, 0)).amax(-1)  # the last hit
    finals = final_distributions(draft_tokens, draft_probs, target_probs, "token")  # THE BREAK: not "block"
    return emit(draft_tokens, tau, finals[torch.arange(len(tau)), tau], randomness.exponentials)
