"""Who proposes the tokens a step verifies: the draft model one position at a time (``block``), prompt lookup
(``lookup``), and the ``Proposer`` that combines them under a length policy (``proposer``)."""

from .block import PAD, draft_block
from .lookup import LookupState, PromptLookup
from .proposer import DraftProposer, Proposal, Proposer

__all__ = ["PAD", "DraftProposer", "LookupState", "PromptLookup", "Proposal", "Proposer", "draft_block"]
