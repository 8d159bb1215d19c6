"""What a step verifies, and who proposes it: the draft model, prompt lookup, or both, under a length policy.

Glossary: B rows, W the step's widest verified proposal, V the target's vocabulary; ``room`` [B] = the most
tokens a row may draft this step (before its token limit; the step's last token is the target's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..checks import probabilities
from ..models.base import LanguageModel, left_pad
from ..policy import LengthPolicy
from ..sampling import SamplingParams, draw
from ..verify import VerifyOutput, draft_distributions
from .block import PAD, draft_block
from .lookup import LookupState


@dataclass(frozen=True)
class Proposal:
    """The drafts one step verifies: a chain per row, or a tree per row when ``parents`` is given (then W = N nodes in
    verify/tree_inputs.py's layout, ``probs`` [B, N+1, V] with row a the law node a's children were drawn from, and
    ``drafted`` the levels drafted). Past ``verified[b]`` row b holds PAD, which nothing reads."""

    tokens: torch.Tensor  # [B, W] int64
    probs: torch.Tensor | None  # [B, W, V] float32: the law each token was drawn from; None: one-hot at ``tokens``
    verified: torch.Tensor  # [B] int64 in [0, W]: drafted tokens row b verifies (0: a plain target step)
    looked_up: torch.Tensor  # [B] bool: row b's tokens are a prompt lookup proposal
    drafted: int  # positions the draft model drafted (a length policy may verify fewer)
    parents: torch.Tensor | None = None  # [B, N] int64: a tree's parent of each node (0: the root); None: chains


class Proposer(Protocol):
    """Makes each step's ``Proposal`` and keeps the caches of the models it drafts with in step with the rows."""

    def prefill(self, prompts: list[list[int]]) -> None: ...

    def propose(self, rows: list[int], contexts: list[list[int]], room: torch.Tensor, uniforms) -> Proposal: ...

    def observe(self, rows: list[int], proposal: Proposal, target_probs: torch.Tensor, out: VerifyOutput): ...

    def roll_back(self, lengths: torch.Tensor) -> None: ...

    def select(self, keep: torch.Tensor) -> None: ...


class DraftProposer:
    """Drafts with ``draft`` (if any) under ``policy``, and by prompt lookup (if ``lookup``) where a row's context
    repeats itself: such a row verifies its lookup proposal and is a hole in the draft's forward (its cache
    catches up the next time it drafts with the model). ``companion`` scores drafted blocks for a policy that
    needs it. One proposer serves one ``generate`` call."""

    def __init__(
        self,
        target: LanguageModel,
        draft: LanguageModel | None,
        companion: LanguageModel | None,
        policy: LengthPolicy,
        lookup: LookupState | None,
        sampling: SamplingParams,
        draft_sampling: SamplingParams,
        vocab: int,
    ):
        self.target, self.draft, self.companion, self.policy, self.lookup = target, draft, companion, policy, lookup
        self.sampling, self.draft_sampling, self.vocab = sampling, draft_sampling, vocab
        self.scorer = companion if policy.needs_companion else None  # the companion reads drafts only then

    def models(self) -> list[LanguageModel]:
        return [m for m in (self.draft, self.companion) if m is not None]

    def prefill(self, prompts: list[list[int]]) -> None:
        """The prompts less their pending last token; a prompt longer than a model's context leaves that model's
        row empty: that row never drafts."""
        for model in self.models():
            model.prefill([p[:-1] if room_in(model, p) > 0 else [] for p in prompts])

    def propose(self, rows: list[int], contexts: list[list[int]], room: torch.Tensor, uniforms) -> Proposal:
        """Draft, let the companion score, and let the policy pick each row's verification length, at most
        ``room[b]`` and what fits in every model's context. ``rows`` are the rows' prompt indices (for lookup);
        ``uniforms`` [B, >=W] float64, one per drafted position, or None for greedy drafts."""
        # what the draft has not read: 1 token, 2 after a fully accepted step, more after steps without drafting
        seen = self.draft.lengths.tolist() if self.draft is not None else [len(c) for c in contexts]
        unseen = [c[n:] for c, n in zip(contexts, seen)]
        limit = room.minimum(torch.tensor([self._draft_room(c) for c in contexts])).clamp(min=0)  # [B]
        proposals = [[] for _ in rows]
        if self.lookup is not None:  # a proposal must beat what the model's draft is expected to commit
            alone = self.policy.expected_rate(len(contexts), max((len(u) for u in unseen), default=1))
            proposals = self.lookup.propose(rows, contexts, limit.tolist(), alone)
        looked_up = torch.tensor([len(p) > 0 for p in proposals], dtype=torch.bool)  # [B]
        limit = limit.masked_fill(looked_up, 0)  # lookup rows are holes in the draft's forward
        catch_up = behind(contexts, seen, limit.tolist())
        # without a draft model the policy is FixedLength(0): no row drafts with a model
        limit = limit.clamp(max=self.policy.draft_budget(len(contexts), catch_up))
        tokens, probs = self._draft(unseen, limit, uniforms)  # [B, K], [B, K, V]
        drafted = tokens.shape[1]
        verified = limit.to(tokens.device).clamp(max=drafted)  # each row's drafts; the policy may verify fewer
        if drafted:
            companion_probs = self._score(contexts, tokens, verified)  # [B, K, V] or None
            verified = self.policy.lengths(tokens, probs, companion_probs, verified)
        width = int(verified.max())
        tokens, probs = tokens[:, :width], None if self.draft_sampling.greedy else probs[:, :width]
        if looked_up.any():
            tokens, probs, verified = with_proposals(proposals, tokens, probs, verified)
        return Proposal(tokens, probs, verified, looked_up, drafted)

    def observe(self, rows: list[int], proposal: Proposal, target_probs: torch.Tensor, out: VerifyOutput):
        """The policy learns from the model's drafts only (a lookup row's acceptance says nothing about them).
        Lookup learns from the committed tokens, at its next proposal."""
        accepted = out.num_accepted  # [B]
        looked_up = proposal.looked_up.to(proposal.verified.device)
        model_rows = proposal.verified.masked_fill(looked_up, 0)
        self.policy.observe(rows, proposal.tokens, proposal.probs, target_probs, model_rows, accepted)

    def roll_back(self, lengths: torch.Tensor) -> None:
        """The draft and the companion never read a step's last drafted token: keep what they read of the
        committed tokens ``lengths`` [B]."""
        for model in self.models():
            model.rollback(torch.minimum(model.lengths, lengths.to(model.device)))

    def select(self, keep: torch.Tensor) -> None:
        for model in self.models():
            model.select(keep)

    def _draft_room(self, context: list[int]) -> int:
        """Tokens a row may draft before some model's context is full: the target scores [pending, x_1..x_k]
        at positions len - 1 .. len - 1 + k; the draft and the scoring companion read x_1..x_{k-1} after it."""
        readers = [m for m in (self.draft, self.scorer) if m is not None]
        return min([room_in(self.target, context) - 1] + [room_in(m, context) for m in readers])

    def _draft(self, unseen: list[list[int]], limit: torch.Tensor, uniforms) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``limit[b]`` tokens in row b after the ``unseen`` tokens the draft reads first, fewer if the policy
        stops drafting: (tokens [B, K], probs [B, K, V])."""
        device = self.target.device

        def next_probs(drafted: torch.Tensor, drafting: torch.Tensor) -> torch.Tensor:
            assert self.draft is not None  # draft_block asks only while some row drafts: never without a model
            if drafted.shape[1] == 0:  # the first forward reads what the draft has not seen, in drafting rows only
                tokens, valid = left_pad([u if d else [] for u, d in zip(unseen, drafting.tolist())])
            else:
                tokens, valid = drafted[:, -1:], drafting[:, None]
            logits = self.draft.forward(tokens.to(self.draft.device), valid.to(self.draft.device), last=True)[:, -1]
            return probabilities(self.draft, "draft", logits.to(device), self.draft_sampling, self.vocab)  # [B, V]

        def choose(position: int, probs: torch.Tensor) -> torch.Tensor:
            return draw(probs, None if uniforms is None else uniforms[:, position - 1])

        return draft_block(self.policy, limit.to(device), next_probs, choose, self.vocab)

    def _score(self, contexts: list[list[int]], tokens: torch.Tensor, own: torch.Tensor) -> torch.Tensor | None:
        """The companion's distributions at the K drafted positions [B, K, V] (one forward over what it has not
        read plus x_1..x_{K-1}; a row reads only its own ``own[b]`` drafts, the rest are holes); None when the
        policy needs no companion."""
        if self.scorer is None:
            return None
        drafted = tokens.shape[1]
        # A row drafting none reads nothing (what it has not seen waits, as in the draft); the others read their
        # unseen context and x_1..x_{K-1}, of which a row drafting k < K tokens keeps x_1..x_{k-1}: the last K - 1
        # columns hold x_1..x_{K-1} (x_j in column j - 1 of those), the rest are holes.
        own = own.cpu()
        seen = self.scorer.lengths.tolist()
        rows = [
            c[n:] + d if k else []
            for c, n, d, k in zip(contexts, seen, tokens[:, : drafted - 1].tolist(), own.tolist())
        ]
        padded, valid = left_pad(rows)
        if drafted > 1:
            valid[:, -(drafted - 1) :] &= torch.arange(drafted - 1)[None] < (own[:, None] - 1)
        logits = self.scorer.forward(padded.to(self.scorer.device), valid.to(self.scorer.device))
        target_device = self.target.device
        return probabilities(
            self.scorer, "companion", logits[:, -drafted:].to(target_device), self.sampling, self.vocab
        )


def behind(contexts: list[list[int]], seen: list[int], limit: list[int]) -> int:
    """The most tokens a draft that has read ``seen[b]`` of row b's context has still to read, over the rows that may
    draft (``limit[b]`` > 0); 1 where none may: what the policy prices a step's catch-up at."""
    return max((len(c) - n for c, n, k in zip(contexts, seen, limit) if k > 0), default=1)


def room_in(model: LanguageModel, context: list[int]) -> int:
    """Tokens ``model`` can still take after ``context`` before its context length (a large number if none)."""
    return (model.max_length if model.max_length is not None else 1 << 62) - len(context) + 1


def with_proposals(
    proposals: list[list[int]], tokens: torch.Tensor, probs: torch.Tensor | None, verified: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The model's drafts (tokens [B, W'], probs [B, W', V] or None, verified [B]) with every row that has a
    lookup proposal verifying it instead: (tokens [B, W], probs [B, W, V] or None, verified [B]).

    A proposal was drafted with probability 1, so its law is one-hot at its tokens. When no row drafted with the
    model (W' = 0) or the model's draft was greedy, ``None`` says one-hot for every row; otherwise the lookup rows
    of the model's tensor are made one-hot (positions past a row's own draft are never verified: zeros there, and
    one-hot at PAD in lookup rows). ``None`` for a mixed step would stay lossless but would accept the model's
    tokens less often than min(1, target(x) / draft(x)). Example, W' = 1, W = 2:
    proposals [[], [7, 8]], tokens [[5], [PAD]] -> [[5, PAD], [7, 8]], verified [1, 0] -> [1, 2].
    """
    device = verified.device
    lengths = torch.tensor([len(p) for p in proposals], device=device)
    looked_up = lengths > 0  # [B]
    verified = torch.where(looked_up, lengths, verified)
    width = int(verified.max())
    proposed = torch.tensor([p + [PAD] * (width - len(p)) for p in proposals], dtype=torch.long, device=device)
    model_tokens = torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]), value=PAD)
    merged = torch.where(looked_up[:, None], proposed, model_tokens)  # [B, W]
    if probs is None or probs.shape[1] == 0:
        return merged, None, verified
    padded = torch.nn.functional.pad(probs, (0, 0, 0, width - probs.shape[1]))  # [B, W, V], a copy
    padded[looked_up] = draft_distributions(merged[looked_up], None, padded.shape[-1])
    return merged, padded, verified
