"""Length policies for the standard rules: a fixed draft length, and one chosen each step from measured latency."""

from __future__ import annotations

import itertools

import torch

from ..defaults import ADAPTIVE_MAX_DRAFT, CATCH_UP_HORIZON
from ..sampling import is_int
from ..verify import agreement, draft_distributions


class FixedLength:
    """Standard speculative decoding: draft ``max_draft`` tokens every step and verify them all (a
    ``LengthPolicy`` that learns nothing)."""

    needs_companion = False

    def __init__(self, max_draft: int):
        if not (is_int(max_draft) and max_draft >= 0):
            raise ValueError(f"max_draft must be an int >= 0, got {max_draft!r}")
        self.max_draft = int(max_draft)  # a NumPy integer is stored as Python's

    def reset(self) -> None:
        pass

    def draft_budget(self, batch: int, catch_up: int) -> int:
        return self.max_draft

    def expected_rate(self, batch: int, catch_up: int) -> float | None:
        return None  # it knows no costs

    def draft_next(self, position: int, prefix: torch.Tensor) -> bool:
        return True

    def keep_drafting(self, position: int, probs: torch.Tensor, prefix: torch.Tensor) -> bool:
        return True

    def lengths(self, draft_tokens, draft_probs, companion_probs, drafted: torch.Tensor) -> torch.Tensor:
        return drafted

    def observe(self, rows, draft_tokens, draft_probs, target_probs, verified, accepted) -> None:
        pass


class AdaptiveLength(FixedLength):
    """Each step drafts the K (0 = a plain target step) that maximises expected tokens per second, from the
    step latency measured on this machine and the acceptance seen so far: the command line's default, so that
    decoding is never planned slower than the target alone. K is decided before the step drafts, from earlier
    steps only, so verification stays lossless whatever it is (docs/algorithms.md). How a step is priced:
    ``best_length``; how the acceptance is learnt: ``observe``.
    """

    def __init__(
        self,
        latency,
        *,
        max_draft: int = ADAPTIVE_MAX_DRAFT,
        prior: float = 0.85,
        memory: float = 0.9,
        horizon: float = CATCH_UP_HORIZON,
        carry_over: bool = False,
    ):
        """``latency``: the step latency (``latency.drafting``, ``latency.target``); ``prior``: the acceptance a
        starts at, and drifts back to while nothing is drafted (0.85: the bundled 0.5B draft's exact per-position
        acceptance from the 1.5B target is 0.875 at temperature 1 on the bench's five prompt sets, docs/results.md,
        "Block verification against llama.cpp's rule, by K"; a little less with the draft in q4_0);
        ``memory``: the weight the acceptance keeps for each position a row verifies (``observe``), and at each
        step that drafts nothing (``draft_budget``); ``horizon``: the steps over which a step that drafts again pays
        back the tokens its draft must read first beyond 2 (``goodputs``; ``math.inf``: never counted)."""
        if not (is_int(max_draft) and max_draft >= 1) or not 0 < prior < 1 or not 0 <= memory < 1 or not horizon >= 1:
            raise ValueError(
                "need max_draft >= 1, 0 < prior < 1, 0 <= memory < 1 and horizon >= 1; "
                f"got {max_draft}, {prior}, {memory}, {horizon}"
            )
        super().__init__(max_draft)
        self.latency, self.memory, self.prior, self.carry_over = latency, memory, prior, carry_over
        self.horizon = horizon
        self.acceptance = prior

    def reset(self) -> None:
        """Back to the prior acceptance at each ``generate`` call, unless built with ``carry_over=True``: then a
        call starts from what earlier calls learnt, so its draft lengths (its speed, never its law) depend on them."""
        if not self.carry_over:
            self.acceptance = self.prior

    def best_length(self, batch: int, catch_up: int = 1) -> int:
        """The K in 0..max_draft with the most expected tokens per second at this batch size when the draft has
        ``catch_up`` tokens to read first (``goodputs``). Where even the prior cannot pay for a draft (a machine on
        which a multi-token forward costs nearly as much per token as a plain step), it is 0 from the first step and
        stays 0 (``draft_budget``'s drift never passes the prior): the caller can say so."""
        goodput = self.goodputs(batch, catch_up)
        return max(range(len(goodput)), key=goodput.__getitem__)

    def goodputs(self, batch: int, catch_up: int = 1) -> list[float]:
        """Expected tokens per second of drafting K at every step, for K in 0..max_draft.

        A step drafting K emits 1 + a + a^2 + ... + a^K tokens in expectation when each drafted token is accepted
        with probability a (``acceptance``) once the ones before it were (the token rule; the block rule accepts at
        least as many), and costs the draft's forwards and the target's forward over K + 1 tokens, from
        ``latency``. The draft's first forward reads the tokens it has not read yet: 2 after a step that accepted
        all its K drafted tokens (chance a^K), else 1; priced at that mix, the rate is that of drafting K step after
        step. Tokens beyond 2 (``catch_up``: after steps without drafts, or prompt lookup's) are read once, when
        drafting resumes: what reading them costs more than reading 2 is spread over ``horizon`` steps
        (``draft_budget`` says why)."""
        a, latency = self.acceptance, self.latency
        behind = latency.behind(batch, catch_up) / self.horizon
        emitted = list(itertools.accumulate(a**i for i in range(self.max_draft + 1)))  # O(K)
        rates = [emitted[0] / latency.target(batch, 1)]
        for k in range(1, self.max_draft + 1):
            full = a**k  # the previous step accepted all its K drafts: its bonus token and the last draft to read
            drafting = full * latency.drafting(batch, k, 2, companion=False) + (1 - full) * latency.drafting(
                batch, k, 1, companion=False
            )
            rates.append(emitted[k] / (drafting + behind + latency.target(batch, 1 + k)))
        return rates

    def expected_rate(self, batch: int, catch_up: int) -> float:
        """The goodput of the step ``draft_budget`` would take now, in tokens per plain target step's time."""
        return max(self.goodputs(batch, catch_up)) * self.latency.target(batch, 1)

    def draft_budget(self, batch: int, catch_up: int) -> int:
        """``best_length`` at this step's ``catch_up``. Two tokens to read are priced into every step, not by the
        step that has them: priced at its own catch-up, a step after a fully accepted one could find that a plain
        step pays more, but a plain step does not spare the draft those tokens, it only adds one to them; and where
        the prior pays after a rejection only, one rejected step would end drafting for the rest of the call
        (docs/results.md, "llama.cpp's AVX2 kernels, on the AMX machine"). More tokens to read are a cost drafting
        pays once, when it resumes, and gains back over the steps it then drafts: ``horizon`` of them. Where the
        draft pays by a hair (the bundled pair on llama.cpp's AVX2 kernels: 0.2 % at the prior), its forward over
        the 20 tokens decoded while it idled costs 1.5 plain steps more than one over 2, which hundreds of steps of
        drafting would not gain back, and it does not resume; where it pays well, the catch-up barely delays it.
        A step that drafts nothing verifies nothing to learn from, so there the acceptance drifts back towards the
        prior (by 1 - ``memory``): after a bad patch the policy drafts again to see whether it ended, once what it
        expects to gain pays for the catch-up, rather than decoding alone for the rest of the call."""
        length = self.best_length(batch, catch_up)
        if length == 0:
            self.acceptance = self.memory * self.acceptance + (1 - self.memory) * self.prior
        return length

    def observe(self, rows, draft_tokens, draft_probs, target_probs, verified, accepted) -> None:
        """``acceptance`` follows the exact acceptance probability sum_v min(draft, target) of the positions each
        step verified, keeping weight ``memory`` per position a row verified (on average over the rows that verified
        any): a step that verified 3 positions moves it as three steps of one position would, so 3 accepted tokens
        take it from 0.8 to 0.85 (weighted per step, to 0.82: too slow to follow a run of accepted drafts where
        drafting pays only a little above the prior, as on llama.cpp's AVX2 kernels)."""
        width = int(verified.max()) if len(verified) else 0
        if width == 0:
            return
        probs = draft_distributions(
            draft_tokens[:, :width], None if draft_probs is None else draft_probs[:, :width], target_probs.shape[-1]
        )
        accept = agreement(probs, target_probs[:, :width])  # [B, width]: P(accept x_i | x_<i accepted), token rule
        mask = torch.arange(width, device=verified.device) < verified[:, None]  # [B, width]
        step = float(accept[mask].mean())
        keep = self.memory ** (float(mask.sum()) / int((verified > 0).sum()))  # rows that verified none teach nothing
        self.acceptance = keep * self.acceptance + (1 - keep) * step
