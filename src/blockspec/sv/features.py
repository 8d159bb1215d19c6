"""Per drafted position, what is known before the drafted token is sampled, and the exact value to predict.

Position i (1-based) of a drafted block x_1..x_K. The *gain* g_i of verifying x_i is what it adds to the
expected accepted length, given x_<i (ALGORITHMS.md, SV section):

    token rule:  g_i = prod_{j<i} min(1, p_j(x_j)/q_j(x_j)) * sum_v min(q_i(v), p_i(v))
    block rule:  g_i = sum_v min(q_i(v), w_{i-1} p_i(v)),   w_0 = 1,  w_j = min(1, w_{j-1} p_j(x_j)/q_j(x_j))

(for the block rule E[tau] = sum_i E[w_i], Sun et al.; its survival is not a product of per-token terms). With the
target p these are the exact labels; with a companion c in place of p they are the companion's *plug-in* guess,
whose column i uses S_i = sum_v min(q_i, c_i) and A_j = min(1, c_j(x_j)/q_j(x_j)) for j < i only. Every column i
of every function here depends on x_<i and the distributions at position i, never on x_i: a policy built on
them is a stopping rule, hence lossless.
"""

from __future__ import annotations

import torch

from ..verify.base import positive_part_mass, row_chunks

DRAFT_FEATURES = ("bias", "log_position", "entropy", "log_max_prob", "log_prefix_prob")
COMPANION_FEATURES = DRAFT_FEATURES + ("logit_plugin_gain", "log_overlap")
_TINY = 1e-6


def as_probs(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, vocab: int) -> torch.Tensor:
    """The draft's distributions [B, K, V]; a greedy draft (None) is one-hot at its tokens."""
    if draft_probs is not None:
        return draft_probs
    return torch.nn.functional.one_hot(draft_tokens, vocab).float()


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
    return torch.stack([
        torch.ones_like(entropy), position.expand(batch, positions), entropy,
        probs.amax(-1).float().clamp(min=_TINY).log(), prefix.float(),
    ], dim=-1)


def gains(draft_tokens: torch.Tensor, draft_probs: torch.Tensor, other: torch.Tensor, method: str) -> torch.Tensor:
    """g_i [B, K] of the module docstring, with ``other`` [B, >=K, V] as the target (exact) or a companion (plug-in)."""
    gains, _ = _gains_and_overlap(draft_tokens, draft_probs, other[:, : draft_tokens.shape[1]], method)
    return gains


def overlap(draft_probs: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """sum_v min(q_i(v), other_i(v)) per position [B, K]: draft-target agreement, or S_i with a companion."""
    return 1.0 - positive_part_mass(torch.ones(draft_probs.shape[:2], dtype=draft_probs.dtype,
                                               device=draft_probs.device), other, draft_probs)


def companion_features(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor, companion_probs: torch.Tensor, method: str,
    draft_part: torch.Tensor,
) -> torch.Tensor:
    """``draft_part`` (the draft-only features [B, K, .]) plus the companion's plug-in gain and overlap S_i."""
    plugin, overlap = _gains_and_overlap(draft_tokens, draft_probs, companion_probs[:, : draft_tokens.shape[1]], method)
    plugin = plugin.float().clamp(_TINY, 1 - _TINY)
    return torch.cat([draft_part, (plugin.log() - (-plugin).log1p())[..., None],
                      overlap.float().clamp(min=_TINY).log()[..., None]], dim=-1)


def _gains_and_overlap(draft_tokens, draft_probs, other, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    ratio = other.gather(-1, draft_tokens[..., None]).squeeze(-1) / draft_probs.gather(
        -1, draft_tokens[..., None]).squeeze(-1).clamp(min=torch.finfo(draft_probs.dtype).tiny)
    ones = torch.ones_like(ratio[:, :1])
    agreement = overlap(draft_probs, other)
    if method == "token":
        survival = torch.cat([ones, ratio.clamp(max=1.0)[:, :-1]], dim=1).cumprod(1)  # prod_{j<i} min(1, r_j)
        return survival * agreement, agreement
    if method != "block":
        raise ValueError(f"method must be 'token' or 'block', got {method!r}")
    weights = [ones[:, 0]]  # w_0 .. w_{K-1}
    for i in range(ratio.shape[1] - 1):
        weights.append(torch.minimum(weights[-1] * ratio[:, i], ones[:, 0]))
    w = torch.stack(weights, dim=1)
    return w - positive_part_mass(w, other, draft_probs), agreement  # sum_v min(q_i, w_{i-1} other_i)
