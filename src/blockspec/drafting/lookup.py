"""Prompt lookup drafting: propose what followed the latest earlier occurrence of the context's last n-gram.

No draft forward: a row whose context repeats itself (code, quoted text, retrieval, edits) proposes the tokens
that followed the same n tokens last time, and the target verifies them like any draft.

Glossary:
    context     a row's prompt and the tokens generated so far (committed tokens only)
    suffix      the context's last n tokens, n from ``min_ngram`` up to ``max_ngram``
    occurrence  an earlier place where the suffix's n tokens appear, ending before the context's last token
                (so at least one token follows it, and the suffix does not match itself)
    match       the longest n whose suffix occurs, and the tokens after its most recent occurrence (at most the
                step's ``limit``; fewer at the context's end; none if no n occurs)
    limit       the most tokens a row may draft this step: ``max_draft``, the room before max_new_tokens and in the
                models' contexts, as for a model draft
    proposal    the first k tokens of the match, k chosen by the match's odds and the target's step costs (below)

How many tokens to propose. A long match is a copy under way and a one-token match is mostly chance, so each prompt
keeps, per match length (1, 2, 3, 4, 5-8, 9 and more: ``ngram_class``), how often a match's tokens were the ones the
target went on to commit: ``first``, the chance its first token is, and ``then``, the chance each later one is,
given the one before it was. ``first`` starts at ``first_prior(c)`` (9/10 for class 9, 1/3 below) and ``then``
at c / (c + 1) for class c (the class of 5-8 is 5, of 9 and more 9), each with ``prior_weight`` tokens' worth of weight.
Every match counts, proposed or not: at the prompt's next step, the match is compared with the tokens committed
since (``LookupState.propose``). A token the target commits has the target's law whatever was drafted, and a one-hot
proposal of x is accepted with probability p(x), the chance the target's own token is x; so a match that was not
proposed tells as much about the next one as a proposal does, and costs nothing. (Were proposals alone counted, a
prompt whose text does not repeat would pay a wasted forward each time a class's prior was tried out.) A proposal of
k tokens is then expected to commit E(k) = 1 + first (1 + then + .. + then^(k-1)) tokens, and its step costs the
target's forward over k + 1 tokens (``costs``): the proposal is the k in 0..len(match) with the most tokens per
second, E(k) / cost(k + 1), where k = 0 (no proposal) commits 1 token in cost(1), or, beside a draft model whose
length policy prices its steps (``AdaptiveLength``), what the model's draft is expected to commit in that time if
more: a proposal must beat the draft it replaces. Where no length pays, the row decodes alone (or drafts with the
model).

Why it stays lossless: a proposal and its length depend on the committed context only (its earlier matches compared
with the tokens committed after them included), never on this step's target distributions (docs/algorithms.md,
"Prompt lookup proposes").
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..defaults import LOOKUP_MAX_DRAFT
from ..policy.base import LatencyTable
from ..sampling import is_int

_TOKEN = struct.calcsize("<I")  # bytes per token id in the searched encoding (ids are < 2**32)
NGRAM_CLASSES = (1, 2, 3, 4, 5, 9)  # a match of n tokens counts in the last class <= n (5: 5-8, 9: 9 and more)


def ngram_class(n: int) -> int:
    """The class whose acceptance counts a match of ``n`` tokens: n up to 4, then 5 (5-8) and 9 (9 and more)."""
    return max(c for c in NGRAM_CLASSES if c <= n)


def first_prior(c: int) -> float:
    """Where the chance that a class-c match's first token is the target's starts. A match of 9 tokens or more is a
    copy under way: in the bundled target's outputs (210 of them, on 7 prompt sets, greedy and sampled) its first
    token was the target's 95-97 % of the time, so it starts at 9/10. Shorter ones start at 1/3: their pooled rates
    (0.2 for class 1 to 0.75 for class 5) mix prompts that copy with prompts that do not, and starting from those,
    replays lost up to 8 % on the latter (median per prompt set 0.92-0.98x the target alone) before each prompt's
    counts caught up; from 1/3 a class is proposed once a few of its matches have continued as the target did."""
    return 0.9 if c >= 9 else 1 / 3


@dataclass(frozen=True)
class PromptLookup:
    """Prompt lookup settings; ``SpeculativeDecoder(..., lookup=PromptLookup(costs=...))`` drafts with it.

    ``costs``: the target's forward seconds over (rows, tokens per row) on this machine
    (``blockspec.auto.lookup_latency`` measures them; ``LatencyTable``); the proposal length is chosen from them
    (module docstring). None prices every width as one step, as on an accelerator that is not yet busy: every match
    is proposed whole, which on a CPU, where a wider forward costs more, can be slower than the target alone.
    """

    max_ngram: int = 12  # the longest suffix looked up
    min_ngram: int = 1  # the shortest: below it, no proposal
    max_draft: int = LOOKUP_MAX_DRAFT  # the most tokens one proposal holds
    costs: LatencyTable | None = None
    prior_weight: float = 2.0  # the proposals' worth of weight each length class's prior odds start with

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram", "max_draft"):
            value = getattr(self, name)
            if not (is_int(value) and value >= 1):
                raise ValueError(f"PromptLookup.{name} must be an int >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))  # a NumPy integer is stored as Python's
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"PromptLookup.min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})")
        weight = self.prior_weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not (0 < weight < math.inf):
            raise ValueError(f"PromptLookup.prior_weight must be a number > 0, got {weight!r}")
        if self.costs is not None and not isinstance(self.costs, LatencyTable):
            raise ValueError(f"PromptLookup.costs must be a LatencyTable or None, got {type(self.costs).__name__}")

    def match(self, context: Sequence[int], length: int) -> tuple[int, list[int]]:
        """The match for ``context`` (see the module's glossary): (n, at most ``length`` tokens), (0, []) if none.

        Whether the suffix of n tokens occurs is monotone in n (the suffix of n - 1 tokens occurs where the longer
        one ends), so the longest n is found by bisection. Each try is one search in C over the context's bytes
        (4 per token), from the end: about 50 us for a context of 4000 tokens, most of it encoding the context.
        """
        if length <= 0 or len(context) < 2:
            return 0, []
        data = struct.pack(f"<{len(context)}I", *context)
        low, high = self.min_ngram, min(self.max_ngram, len(context) - 1)  # n <= len - 1: one token must follow
        found = self._occurrence(data, low) if low <= high else -1
        if found < 0:
            return 0, []
        while low < high:  # the suffix of ``low`` tokens occurs, at ``found``; none longer than ``high`` does
            middle = (low + high + 1) // 2
            start = self._occurrence(data, middle)
            if start >= 0:
                low, found = middle, start
            else:
                high = middle - 1
        follow = found + low  # the first token after the occurrence
        return low, list(context[follow : follow + length])

    @staticmethod
    def _occurrence(data: bytes, n: int) -> int:
        """The token index where the most recent occurrence of the last ``n`` tokens of ``data`` starts, or -1."""
        suffix = data[len(data) - n * _TOKEN :]
        end = len(data) - _TOKEN  # the occurrence must end before the last token
        start = data.rfind(suffix, 0, end)
        while start >= 0 and start % _TOKEN:  # a byte match straddling token boundaries: look further left
            start = data.rfind(suffix, 0, start + len(suffix) - 1)
        return start // _TOKEN if start >= 0 else -1

    def length(self, first: float, then: float, available: int, rows: int, alone: float | None = None) -> int:
        """The proposal length k in 0..``available`` with the most tokens per second at ``rows`` rows: E(k) /
        steps(k + 1), E(k) = 1 + first (1 + then + .. + then^(k-1)) (module docstring), steps(w) = cost(w) / cost(1)
        the forward over w tokens in plain steps' time; the shortest on a tie. k = 0 is worth a plain step, 1, or
        ``alone`` if more: the draft model's expected tokens per plain step's time (``LengthPolicy.expected_rate``),
        when it drafts where lookup does not. Rates in plain steps, not seconds, compare costs measured at different
        times on a machine whose speed drifts."""
        costs = self.costs
        steps = (lambda width: 1.0) if costs is None else (lambda width: costs(rows, width) / costs(rows, 1))
        best, best_rate = 0, max(1.0, alone or 0.0)
        expected, accept_next = 1.0, first
        for k in range(1, available + 1):
            expected += accept_next
            accept_next *= then
            rate = expected / steps(k + 1)
            if rate > best_rate:
                best, best_rate = k, rate
        return best


class Odds:
    """One prompt's counts for one match-length class: (agreed, compared) of first tokens and of later ones, starting
    at ``first_prior(n)`` and n / (n + 1) with ``weight`` comparisons."""

    def __init__(self, n: int, weight: float):
        self.first, self.first_tries = first_prior(n) * weight, weight
        self.then, self.then_tries = n / (n + 1) * weight, weight

    def rates(self) -> tuple[float, float]:
        return self.first / self.first_tries, self.then / self.then_tries

    def observe(self, compared: int, agreed: int) -> None:
        """A match's first ``compared`` tokens held against the target's, of which the first ``agreed`` were equal."""
        self.first += agreed > 0
        self.first_tries += 1
        if agreed > 0:  # tokens 2..agreed agreed, and token agreed + 1 differed if it was compared
            self.then += agreed - 1
            self.then_tries += agreed - 1 + (agreed < compared)


class LookupState:
    """One ``generate`` call's prompt lookup: each prompt's ``Odds`` per match-length class, indexed by prompt
    (rows leave the batch as they finish; the caller passes each batch row's prompt index), and each prompt's last
    match until its next step compares it with what the target committed."""

    def __init__(self, settings: PromptLookup, prompts: int):
        self.settings = settings
        self.odds: list[dict[int, Odds]] = [{} for _ in range(prompts)]
        self.pending: dict[int, tuple[int, list[int], int]] = {}  # prompt -> (class, match, context length then)

    def propose(
        self,
        prompts: Sequence[int],
        contexts: Sequence[Sequence[int]],
        limit: Sequence[int],
        alone: float | None = None,
    ) -> list[list[int]]:
        """One proposal per batch row (prompt ``prompts[b]``), at most ``limit[b]`` tokens (module docstring), each
        worth more than ``alone`` tokens per plain step if given (``PromptLookup.length``), after counting how each
        prompt's last match compares with the tokens committed since."""
        settings, proposals = self.settings, []
        for i, context, room in zip(prompts, contexts, limit):
            self._compare(i, context)
            n, tokens = settings.match(context, min(settings.max_draft, room))
            if tokens:
                matched = ngram_class(n)
                self.pending[i] = (matched, tokens, len(context))
                rates = self._odds(i, matched).rates()
                tokens = tokens[: settings.length(*rates, len(tokens), len(contexts), alone)]
            proposals.append(tokens)
        return proposals

    def _compare(self, prompt: int, context: Sequence[int]) -> None:
        """Count the prompt's last match, if any, against the tokens committed after it (``context`` now)."""
        if prompt not in self.pending:
            return
        matched, match, length = self.pending.pop(prompt)
        committed = context[length:]
        compared = min(len(match), len(committed))
        agreed = 0
        while agreed < compared and match[agreed] == committed[agreed]:
            agreed += 1
        if compared:
            self._odds(prompt, matched).observe(compared, agreed)

    def _odds(self, prompt: int, n: int) -> Odds:
        if n not in self.odds[prompt]:
            self.odds[prompt][n] = Odds(n, self.settings.prior_weight)
        return self.odds[prompt][n]
