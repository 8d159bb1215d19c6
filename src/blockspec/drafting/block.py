"""The drafting loop: one position at a time, asking the length policy before each draft forward and before
each token is sampled, so that its decisions form a stopping rule (docs/algorithms.md).

Glossary: B rows, V tokens; position i = the i-th drafted token x_i (1-based); ``limit`` [B] = the most tokens a
row may draft this step (its room before ``max_new_tokens``, what still fits in each model's context, the
policy's budget). A row whose limit is below i does not draft position i: the draft does not read anything for
it (a hole in its forward), its token is padding and verification never looks at it (what it verifies <= limit).

The engine and the SV policy's exact-law tests both draft through ``draft_block`` (docs/testing.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# next_probs(drafted [B, i-1] int64, drafting [B] bool) -> the draft's processed distribution at position i
#   [B, V] float32. Rows where ``drafting`` is False read nothing: theirs is the output of a hole, finite but no
#   draft distribution; verification never reads it (a length policy is shown it with the other rows).
NextProbs = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# choose(i, probs [B, V]) -> x_i [B] int64: sampled (or the argmax when greedy; a given block in exact tests)
Choose = Callable[[int, torch.Tensor], torch.Tensor]

PAD = 0  # the token of a row past its limit: never read by the draft, never verified


def draft_block(
    policy, limit: torch.Tensor, next_probs: NextProbs, choose: Choose, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft up to ``limit`` [B] int64 tokens per row over ``vocab`` tokens; fewer if the policy stops.

    Returns (tokens [B, n] int64, probs [B, n, V] float32), n = the positions drafted (0 if none). The policy is
    asked, in this order: ``draft_next(i, prefix)`` before the forward of position i > 1 (what it may know:
    x_<i through ``prefix`` [B] float64 = sum_{j<i} log draft(x_j), clamped at 1e-6); ``keep_drafting(i, probs,
    prefix)`` once position i's distribution is known and before x_i is sampled. Neither sees x_i.
    """
    batch, width = len(limit), int(limit.max()) if len(limit) else 0
    drafted = torch.zeros(batch, 0, dtype=torch.long, device=limit.device)
    probs = [torch.zeros(batch, 0, vocab, device=limit.device)]
    prefix = torch.zeros(batch, dtype=torch.float64, device=limit.device)
    for i in range(1, width + 1):
        if i > 1 and not policy.draft_next(i, prefix):  # before paying for the forward of position i
            break
        drafting = limit >= i  # [B]
        step_probs = next_probs(drafted, drafting)  # [B, V]
        if not policy.keep_drafting(i, step_probs, prefix):  # decided before x_i is sampled
            break
        token = choose(i, step_probs).masked_fill(~drafting, PAD)
        logprob = step_probs.gather(1, token[:, None]).squeeze(1).double().clamp(min=1e-6).log()
        prefix = prefix + logprob.masked_fill(~drafting, 0.0)
        drafted = torch.cat([drafted, token[:, None]], dim=1)
        probs.append(step_probs[:, None])
    return drafted, torch.cat(probs, dim=1)
