"""blockspec.verify: exact draft verification rules, pure tensor code (imports torch only).

    verify_token   standard speculative sampling (first rejection stops)
    verify_block   Sun et al., arXiv 2403.10444, Algorithm 2 (jointly verifies the block)
    verify_greedy  temperature 0: longest prefix matching the target's argmax

All three take (draft_tokens [B, K], draft_probs [B, K, V] | None, target_probs [B, K+1, V]) and return a
VerifyOutput. ``RULES`` names them with their closed forms (rules.py; ``SAMPLED_RULES``: valid at temperature > 0).
Glossary: base.py; the law of tau and the gains that length policies and the exact tests build on: exact.py.
tree.py verifies drafted trees, with closed forms ``tree_law``, ``expected_accepted_tree`` (docs/algorithms.md);
multipath.py verifies k drafted paths jointly on their prefix tree (``verify_multipath``, ``multipath_law``,
``expected_accepted_multipath``).
"""

from .base import Randomness, VerifyOutput, agreement, positive_part_mass, row_chunks
from .block import block_acceptance, block_weights, verify_block
from .exact import (
    acceptance_survival,
    accepted_length_law,
    draft_distributions,
    expected_accepted,
    final_distributions,
    position_gains,
)
from .greedy import verify_greedy
from .multipath import (
    MultiPathVerifyOutput,
    PathTree,
    expected_accepted_multipath,
    multipath_law,
    paths_to_tree,
    verify_multipath,
)
from .rules import RULES, SAMPLED_RULES, Rule, get_rule
from .token import token_acceptance, verify_token
from .tree import (
    TreeLaw,
    TreeVerifyOutput,
    expected_accepted_tree,
    tree_law,
    verify_tree_block,
    verify_tree_greedy,
    verify_tree_token,
)

__all__ = [
    "RULES",
    "SAMPLED_RULES",
    "Rule",
    "get_rule",
    "MultiPathVerifyOutput",
    "PathTree",
    "Randomness",
    "TreeLaw",
    "TreeVerifyOutput",
    "VerifyOutput",
    "accepted_length_law",
    "acceptance_survival",
    "agreement",
    "block_acceptance",
    "block_weights",
    "draft_distributions",
    "expected_accepted",
    "expected_accepted_multipath",
    "expected_accepted_tree",
    "final_distributions",
    "multipath_law",
    "paths_to_tree",
    "position_gains",
    "positive_part_mass",
    "row_chunks",
    "token_acceptance",
    "tree_law",
    "verify_block",
    "verify_greedy",
    "verify_multipath",
    "verify_token",
    "verify_tree_block",
    "verify_tree_greedy",
    "verify_tree_token",
]
