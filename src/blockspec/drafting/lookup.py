"""Prompt lookup drafting: propose what followed the latest earlier occurrence of the context's last n-gram.

No draft forward: a row whose context repeats itself (code, quoted text, retrieval, edits) proposes the tokens
that followed the same n tokens last time, and the target verifies them like any draft.

Glossary:
    context     a row's prompt and the tokens generated so far (committed tokens only)
    suffix      the context's last n tokens, n from ``max_ngram`` down to ``min_ngram``
    occurrence  an earlier place where the suffix's n tokens appear, ending before the context's last token
                (so at least one token follows it, and the suffix does not match itself)
    proposal    the at most ``length`` tokens after the most recent occurrence of the longest n that occurs
                (fewer at the context's end; empty if no n occurs)
    allowed     a prompt's current proposal length, adapted from what the target accepted of its last proposal
    limit       the most tokens a row may draft this step (room before max_new_tokens and in the models'
                contexts), as for a model draft

Why it stays lossless: docs/algorithms.md ("Prompt lookup proposes").
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..sampling import is_int

_TOKEN = struct.calcsize("<I")  # bytes per token id in the searched encoding (ids are < 2**32)


@dataclass(frozen=True)
class PromptLookup:
    """Prompt lookup settings; ``SpeculativeDecoder(..., lookup=PromptLookup())`` drafts with it.

    Adaptive length, per prompt: the first proposal holds at most ``initial_len`` tokens; after a proposal of
    k tokens of which the target accepted tau, the next may hold ``allowed + grow`` tokens (at most ``max_draft``)
    if tau == k, else tau + 1 (at least 1): the first rejected position is worth one more try, not more.
    """

    max_ngram: int = 3  # the longest suffix looked up
    min_ngram: int = 1  # the shortest: below it, no proposal
    max_draft: int = 10  # the most tokens one proposal holds
    initial_len: int = 4  # a prompt's allowed proposal length before any of its proposals was verified
    grow: int = 2  # added to the allowed length after a fully accepted proposal

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram", "max_draft", "initial_len", "grow"):
            value = getattr(self, name)
            if not (is_int(value) and value >= 1):
                raise ValueError(f"PromptLookup.{name} must be an int >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))  # a NumPy integer is stored as Python's
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"PromptLookup.min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})")
        if self.initial_len > self.max_draft:
            raise ValueError(
                f"PromptLookup.initial_len ({self.initial_len}) must not exceed max_draft ({self.max_draft})"
            )

    def match(self, context: Sequence[int], length: int) -> list[int]:
        """The proposal for ``context`` (see the module's glossary): at most ``length`` tokens, [] if none.

        Each n is one search in C over the context's bytes (4 per token), from the end: about 50 us for a
        context of 4000 tokens, most of it encoding the context; a Python loop over the tokens is slower.
        """
        if length <= 0 or len(context) < 2:
            return []
        data = struct.pack(f"<{len(context)}I", *context)
        # The occurrence must end before the last token: at most len - 1 tokens before it, and n <= len - 1.
        end = len(data) - _TOKEN
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            suffix = data[len(data) - n * _TOKEN :]
            start = data.rfind(suffix, 0, end)
            while start >= 0 and start % _TOKEN:  # a byte match straddling token boundaries: look further left
                start = data.rfind(suffix, 0, start + len(suffix) - 1)
            if start >= 0:
                follow = start // _TOKEN + n  # the first token after the occurrence
                return list(context[follow : follow + length])
        return []

    def next_length(self, allowed: int, proposed: int, accepted: int) -> int:
        """A prompt's allowed length after a proposal of ``proposed`` tokens of which ``accepted`` were accepted."""
        if accepted == proposed:
            return min(allowed + self.grow, self.max_draft)
        return accepted + 1  # the first rejected position, and at least 1


class LookupState:
    """One ``generate`` call's prompt lookup: each prompt's allowed length, indexed by prompt (rows leave the
    batch as they finish; the caller passes each batch row's prompt index)."""

    def __init__(self, settings: PromptLookup, prompts: int):
        self.settings = settings
        self.allowed = [settings.initial_len] * prompts

    def propose(
        self, prompts: Sequence[int], contexts: Sequence[Sequence[int]], limit: Sequence[int]
    ) -> list[list[int]]:
        """One proposal per batch row (prompt ``prompts[b]``), at most min(its allowed length, ``limit[b]``)."""
        return [self.settings.match(c, min(self.allowed[i], n)) for i, c, n in zip(prompts, contexts, limit)]

    def observe(self, prompts: Sequence[int], proposed: Sequence[int], accepted: Sequence[int]) -> None:
        """Adapt the allowed length of each prompt that verified a proposal (``proposed[b]`` > 0 tokens)."""
        for i, k, tau in zip(prompts, proposed, accepted):
            if k > 0:
                self.allowed[i] = self.settings.next_length(self.allowed[i], k, tau)
