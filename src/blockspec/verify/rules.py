"""The verification rules by name: the one registry the engine, the CLI, the benchmarks, the vLLM plugin and the
exact tests read. A new rule is a module and one line in ``RULES`` (docs/testing.md says which tests then cover it).

A rule is its batched verifier plus, where it has them, the closed forms of its deterministic part given a drafted
block, which ``exact`` integrates over: the survival P(tau >= i | block), the log weight w of the residual
max(w * target - draft, 0) sampled after tau, and the per-position gains length policies plan with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .base import VerifyOutput
from .block import block_final_log_weight, block_gains, block_survival, verify_block
from .greedy import verify_greedy
from .token import token_final_log_weight, token_gains, token_survival, verify_token

# (draft_tokens [B, K], draft_probs [B, K, V] | None, target_probs [B, K+1, V], num_verified [B]) -> a table
BlockForm = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor], torch.Tensor]
# (draft_tokens [B, K], draft_probs [B, K, V], other [B, K, V]) -> gains [B, K]
GainsForm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Rule:
    name: str
    verify: Callable[..., VerifyOutput]  # (draft_tokens [B, K], draft_probs [B, K, V] | None, target_probs [B, K+1, V])
    sampled: bool  # lossless at any temperature; False: a temperature-0 rule
    survival: BlockForm | None = None  # P(tau >= i | block) for i = 1..K, [B, K]; 0 on padding
    final_log_weight: BlockForm | None = None  # log w_i for i = 0..K, [B, K+1]: the residual's scale after tau = i
    gains: GainsForm | None = None  # g_i: what verifying x_i adds to E[tau] given x_<i (``exact.position_gains``)


RULES: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        Rule("block", verify_block, True, block_survival, block_final_log_weight, block_gains),
        Rule("token", verify_token, True, token_survival, token_final_log_weight, token_gains),
        Rule("greedy", verify_greedy, sampled=False),
    )
}
SAMPLED_RULES = tuple(name for name, rule in RULES.items() if rule.sampled)  # ("block", "token")


def get_rule(name: str) -> Rule:
    """The rule called ``name``; a ValueError naming the known rules otherwise."""
    if name not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {name!r}")
    return RULES[name]
