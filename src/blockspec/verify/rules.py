"""The verification rules by name: the one registry the engine, the CLI, the benchmarks, the vLLM plugin and the
exact tests read. A new rule is a module and one line in ``RULES``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .base import VerifyOutput
from .block import verify_block
from .greedy import verify_greedy
from .token import verify_token


@dataclass(frozen=True)
class Rule:
    name: str
    verify: Callable[..., VerifyOutput]  # (draft_tokens [B, K], draft_probs [B, K, V] | None, target_probs [B, K+1, V])
    sampled: bool  # lossless at any temperature; False: a temperature-0 rule


RULES: dict[str, Rule] = {
    rule.name: rule
    for rule in (
        Rule("block", verify_block, sampled=True),
        Rule("token", verify_token, sampled=True),
        Rule("greedy", verify_greedy, sampled=False),
    )
}
SAMPLED_RULES = tuple(name for name, rule in RULES.items() if rule.sampled)  # ("block", "token")


def get_rule(name: str) -> Rule:
    """The rule called ``name``; a ValueError naming the known rules otherwise."""
    if name not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {name!r}")
    return RULES[name]
