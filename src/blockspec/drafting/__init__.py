"""Who proposes the tokens a step verifies: the draft model one position at a time (``block``), prompt lookup
(``lookup``), the ``Proposer`` that combines them under a length policy (``proposer``), and the draft model's trees
of a static shape, level by level (``tree``), and its i.i.d. paths merged as they are drawn (``paths``)."""

from .block import PAD, draft_block
from .lookup import LookupState, PromptLookup
from .paths import PathProposer
from .proposer import DraftProposer, Proposal, Proposer
from .tree import TreeProposer

__all__ = [
    "PAD",
    "DraftProposer",
    "LookupState",
    "PathProposer",
    "PromptLookup",
    "Proposal",
    "Proposer",
    "TreeProposer",
    "draft_block",
]
