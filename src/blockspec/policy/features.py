"""Per drafted position, what a length policy knows before the drafted token is sampled.

Position i (1-based) of a drafted block x_1..x_K. The value to predict is the *gain* g_i of verifying x_i, what
it adds to the expected accepted length given x_<i (``blockspec.verify.position_gains``: exact with the
target's distributions, the labels SV is calibrated on). Its predictors read the features below: the draft's
own (entropy, top probability, the drafted prefix's probability) and, with a companion c standing in for the
target, the companion's *plug-in* gain and overlap S_i = sum_v min(q_i, c_i). Every column i of every function
here depends on x_<i and the distributions at position i, never on x_i: a policy built on them is a stopping
rule, hence lossless.
"""

from __future__ import annotations

import torch

from ..verify import agreement, position_gains, row_chunks

DRAFT_FEATURES = ("bias", "log_position", "entropy", "log_max_prob", "log_prefix_prob")
COMPANION_FEATURES = DRAFT_FEATURES + ("logit_plugin_gain", "log_overlap")
_TINY = 1e-6


def prefix_logprob(draft_tokens: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """sum_{j<i} log q_j(x_j) per position [B, K] (0 at i = 1)."""
    logq = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).clamp(min=_TINY).log()
    return torch.nn.functional.pad(logq.cumsum(-1)[:, :-1], (1, 0))


def draft_features(probs: torch.Tensor, prefix: torch.Tensor, first: int = 1) -> torch.Tensor:
    """Draft-only features [B, N, len(DRAFT_FEATURES)] of positions first..first+N-1.

    probs [B, N, V]: the draft's distributions there; prefix [B, N]: ``prefix_logprob`` at those positions.
    """
    batch, positions, vocab = probs.shape
    entropy = torch.empty(batch, positions, dtype=torch.float32, device=probs.device)
    for rows in row_chunks(batch, positions * vocab):
        entropy[rows] = -torch.special.xlogy(probs[rows], probs[rows]).sum(-1).float()
    position = torch.arange(first, first + positions, device=probs.device, dtype=torch.float32).log()
    return torch.stack(
        [
            torch.ones_like(entropy),
            position.expand(batch, positions),
            entropy,
            probs.amax(-1).float().clamp(min=_TINY).log(),
            prefix.float(),
        ],
        dim=-1,
    )


def companion_features(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    companion_probs: torch.Tensor,
    rule: str,
    draft_part: torch.Tensor,
) -> torch.Tensor:
    """``draft_part`` (the draft-only features [B, K, .]) plus the companion's plug-in gain and overlap S_i."""
    companion_probs = companion_probs[:, : draft_tokens.shape[1]]
    plugin = position_gains(draft_tokens, draft_probs, companion_probs, rule).float().clamp(_TINY, 1 - _TINY)
    return torch.cat(
        [
            draft_part,
            (plugin.log() - (-plugin).log1p())[..., None],
            agreement(draft_probs, companion_probs).float().clamp(min=_TINY).log()[..., None],
        ],
        dim=-1,
    )
