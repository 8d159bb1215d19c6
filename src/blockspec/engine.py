"""The speculative decoding loop: draft -> score -> verify -> commit and roll back -> stats.

Every row of the batch keeps its own token sequence, its own random stream and its own cache positions, so
rows of different lengths accept different numbers of tokens each step and leave the batch when they finish.
``verifier="none"`` runs plain target-only decoding through the same loop (a step with zero drafted tokens),
so comparisons are fair. With ``lookup=PromptLookup()`` rows whose context repeats itself draft by prompt lookup
(``blockspec.lookup``) instead of with the draft model, or without any draft model.
"""

from __future__ import annotations

import logging
import operator
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .defaults import MAX_DRAFT
from .drafting import PAD, draft_block
from .lookup import LookupState, PromptLookup
from .models.base import LanguageModel, as_model, check_shared_vocabulary, left_pad, model_name, target_vocabulary
from .models.chat import encode_prompt
from .policy import FixedLength, LengthPolicy, SVPolicy
from .sampling import NonFiniteLogitsError, SamplingParams, check_unsupported, is_int, process, sample
from .verify import VERIFIERS, Randomness, agreement, draft_distributions, expected_accepted
from .verify.base import draw_exponentials, renamed, verified_mask

log = logging.getLogger(__name__)

VERIFIER_CHOICES = ("block", "token", "greedy", "none")


@dataclass(frozen=True)
class StepStats:
    """One step of the loop. Lists hold one entry per row active in that step (``rows`` = prompt indices)."""

    rows: list[int]
    verified: list[int]  # drafted tokens verified per row (0 = a plain target step)
    accepted: list[int]  # tau per row
    emitted: list[int]  # tokens kept per row (tau + 1, less anything cut by EOS, stop strings or the length cap)
    draft_s: float  # drafting (forwards of the draft and its sampling) and the companion's scoring, if any
    target_s: float  # the target's scoring forward and its processing into probabilities
    verify_s: float
    total_s: float  # the whole step, bookkeeping included
    forward_s: float  # model forwards alone (draft, companion and target)
    drafted: int = 0  # positions the draft model drafted (a length policy may verify fewer; lookup runs no forward)
    expected_token: list[float] | None = None  # E[tau | this draft] under each rule, outside the timed region
    expected_block: list[float] | None = None
    overlap: list[float] | None = None  # mean over verified positions of sum_v min(draft, target), per row
    lookup: list[bool] | None = None  # per row: its draft was a prompt lookup proposal (None without lookup)


@dataclass
class GenerationResult:
    sequences: list[list[int]]  # new token ids per prompt
    texts: list[str] | None  # decoded sequences, when a tokenizer is known
    finish_reasons: list[str]  # "eos", "stop" or "length"
    stats: list[StepStats] = field(repr=False)
    wall_time: float = 0.0
    prefill_s: float = 0.0  # the prompts' forwards through both models, before the first step

    @property
    def new_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def row_steps(self) -> int:
        return sum(len(s.rows) for s in self.stats)

    @property
    def block_efficiency(self) -> float:
        """Tokens per target forward per row: 1 + mean accepted per step (before any EOS/length cut)."""
        return 1.0 + sum(sum(s.accepted) for s in self.stats) / max(self.row_steps, 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens / verified drafted tokens."""
        verified = sum(sum(s.verified) for s in self.stats)
        return sum(sum(s.accepted) for s in self.stats) / verified if verified else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time else float("nan")

    @property
    def lookup_rate(self) -> float:
        """Fraction of row steps whose draft was a prompt lookup proposal (nan without lookup)."""
        flags = [f for s in self.stats if s.lookup is not None for f in s.lookup]
        return sum(flags) / len(flags) if flags else float("nan")


class SpeculativeDecoder:
    """Lossless speculative decoding of ``target`` with proposals from ``draft``.

    ``target`` and ``draft`` are LanguageModel adapters or plain transformers PreTrainedModels (wrapped in
    HFModel). ``verifier``: "block" (Sun et al. 2024, the default), "token" (standard speculative sampling),
    "greedy" (temperature 0 only) or "none" (target-only decoding, no draft needed). At temperature 0 the
    greedy rule is used whatever ``verifier`` says: token and block verification coincide with it there.
    ``policy`` decides how many tokens each step drafts and verifies (a ``blockspec.policy.LengthPolicy``): by
    default ``FixedLength(max_draft)``; ``"sv"`` is Speculative Verification with at most ``max_draft`` drafted
    tokens, from the profiles ``blockspec sv profile`` and ``blockspec sv calibrate`` saved for these models and
    each call's sampling (``SVPolicy.from_cache``; a missing profile raises an error naming the command that
    makes it). A policy object sets its own maximum (its ``max_draft``) and this one is not used. Each
    ``generate`` call starts with ``policy.reset()``: what a policy learnt online is forgotten, unless it was built
    with ``carry_over=True``. ``companion`` is the model an SV policy with companion features scores drafted
    blocks with (``blockspec.models.companion``).

    ``lookup`` (a ``blockspec.lookup.PromptLookup``) drafts by prompt lookup: each step, a row whose context's last
    n-gram occurred before proposes what followed it, with no forward. Without ``draft`` a row with no match makes
    a plain target step; with ``draft`` it drafts with the model in the same step, and lookup rows are holes in the
    draft's forward (its cache catches up on their tokens the next time they draft with it). A proposal's law is
    one-hot at its tokens, and the verifier is handed exactly that: ``draft_probs=None`` (which the verifiers read
    as one-hot) when no row of the step drafted with the model, else the model's rows with one-hot rows for the
    lookup rows in the step's [B, K, V] tensor. Lookup combines with ``FixedLength`` and ``AdaptiveLength``: the
    policy sets the model rows' lengths and observes only them.

    Target, draft and companion must be distinct adapter objects (each keeps its own KV cache); one transformers
    model wrapped twice is fine. The target defines the vocabulary (its logits, cut to its tokenizer's length):
    a draft or companion with fewer logits is refused, since the target's other tokens could never be emitted.
    """

    @renamed(draft_len="max_draft")
    def __init__(
        self,
        target,
        draft=None,
        *,
        verifier: str = "block",
        max_draft: int = MAX_DRAFT,
        policy: LengthPolicy | str | None = None,
        companion=None,
        lookup: PromptLookup | None = None,
    ):
        if verifier not in VERIFIER_CHOICES:
            raise ValueError(f"verifier must be one of {VERIFIER_CHOICES}, got {verifier!r}")
        if verifier != "none" and draft is None and lookup is None:
            raise ValueError(
                f"verifier={verifier!r} needs a draft model or prompt lookup (lookup=PromptLookup()), "
                "or use verifier='none'"
            )
        if isinstance(policy, str) and policy != "sv":
            raise ValueError(f"policy must be a LengthPolicy, 'sv' or None, got {policy!r}")
        if policy is not None and not isinstance(policy, (str, LengthPolicy)):
            raise TypeError(f"policy {type(policy).__name__} lacks some of the hooks of blockspec.policy.LengthPolicy")
        if verifier != "none" and not isinstance(policy, LengthPolicy) and not (is_int(max_draft) and max_draft >= 1):
            raise ValueError(f"max_draft must be an int >= 1, got {max_draft!r}")
        if policy is not None and (verifier == "none" or draft is None):
            raise ValueError(
                "a length policy needs a draft model: verifier='none' decodes with the target alone, "
                "and prompt lookup without a draft takes its lengths from its own settings"
            )
        if lookup is not None:
            if not isinstance(lookup, PromptLookup):
                raise TypeError(f"lookup must be a PromptLookup, got {type(lookup).__name__}")
            if verifier == "none":
                raise ValueError(
                    "prompt lookup drafts tokens for verification: use verifier 'block', 'token' or "
                    "'greedy' with it (verifier='none' decodes with the target alone)"
                )
            if policy is not None and not isinstance(policy, FixedLength):
                raise ValueError(
                    f"prompt lookup combines only with FixedLength and its subclasses (AdaptiveLength), "
                    f"not with {policy if isinstance(policy, str) else type(policy).__name__}: SV's "
                    "per-position predictions model the draft model's drafts"
                )
        method = getattr(policy, "method", None)
        if method in ("token", "block") and verifier in ("token", "block") and method != verifier:
            raise ValueError(
                f"the length policy was built for the {method} rule but verifier={verifier!r}: its "
                "predicted gains would be those of another rule"
            )
        self.target = as_model(target)
        self.draft = as_model(draft) if verifier != "none" and draft is not None else None
        self.companion = as_model(companion) if companion is not None and self.draft is not None else None
        _refuse_shared_adapters(self.target, self.draft, self.companion)
        self.verifier = verifier
        self.sv = policy == "sv"  # resolved per call: an SV calibration is specific to the call's sampling
        fixed = FixedLength(max_draft if self.draft is not None else 0)
        self.policy: LengthPolicy = policy if isinstance(policy, LengthPolicy) else fixed
        self.lookup = lookup
        # the widest step, what _draw draws for: the model's drafts or the longest lookup proposal
        self.max_draft = max(self.policy.max_draft if self.draft is not None else 0, lookup.max_draft if lookup else 0)
        context = self.target.max_length
        if context is not None and self.max_draft >= context:
            raise ValueError(f"max_draft {self.max_draft} is not below the target's context of {context} tokens")
        if self.policy.needs_companion and companion is None:
            raise ValueError("this length policy needs a companion model (companion=...)")
        self.vocab = target_vocabulary(self.target)
        for role, model in (("draft", self.draft), ("companion", self.companion)):
            if model is not None:
                check_shared_vocabulary(self.target, model, self.vocab, role)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        seed: int | Sequence[int] | None = None,
        stop_on_eos: bool = True,
        stop_strings: Sequence[str] = (),
        expected: bool = False,
        on_tokens: Callable[[int, list[int]], None] | None = None,
        draft_sampling: SamplingParams | None = None,
        chat: bool = False,
        **options,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` new tokens for each prompt (strings need a tokenizer).

        String prompts are tokenized as they are (with the tokenizer's special tokens) unless ``chat=True``: then
        each is sent as a user message through the tokenizer's chat template, with the assistant's turn opened,
        which is what ``blockspec generate`` does by default. Token-id prompts are used as given.

        ``seed``: one int (row b then uses seed + b) or one per prompt; each row draws from its own stream, so
        its output law does not depend on its neighbours. Its tokens do not either in float32; in bfloat16 or
        float16 a batched forward rounds differently from a forward of the row alone, so a row's tokens can
        differ between the two (the law is the target's in both); under a length policy such as SV the batch
        shares one verification width, so how many of a row's drafts are verified, hence its tokens, depend on
        its neighbours even in float32 (its law does not).
        ``stop_strings``: a list of strings; a row ends right after the first of them appears in its text.
        ``expected=True`` records, per step and row, the exact expected accepted length under both the token
        and the block rule for the same draft (computed outside the timed region). ``on_tokens(i, tokens)``
        is called as tokens of prompt i are committed (for streaming). ``draft_sampling``: the draft's own
        temperature / top-k / top-p (default: ``sampling``); verification sees the distribution the draft
        actually sampled from, so any choice stays lossless and only changes the acceptance rate.
        """
        check_unsupported(options)
        if not (is_int(max_new_tokens) and max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if self.verifier == "greedy" and not sampling.greedy:
            raise ValueError("verifier='greedy' needs temperature 0; use 'block' or 'token' to sample")
        if draft_sampling is not None and sampling.greedy:
            raise ValueError("draft_sampling needs a sampled target: at temperature 0 the draft proposes its argmax")
        draft_sampling = draft_sampling or sampling
        sequences = self._encode(prompts, chat)
        self._check_context(sequences, max_new_tokens)
        generators = [torch.Generator().manual_seed(s) for s in _row_seeds(seed, len(sequences))]
        if self.sv:
            self.policy = SVPolicy.from_cache(
                self.target,
                self.draft,
                sampling=sampling,
                max_draft=self.max_draft,
                method="token" if self.verifier == "token" else "block",
            )
        self.policy.reset()
        lookup = LookupState(self.lookup, len(sequences)) if self.lookup is not None else None  # fresh per call
        stop = _Stopper(self, stop_on_eos, stop_strings, max_new_tokens)
        verify = VERIFIERS["greedy" if sampling.greedy else ("token" if self.verifier == "none" else self.verifier)]

        device = self.target.device  # sampling and verification run where the target's logits are
        start = time.perf_counter()
        models = [m for m in (self.target, self.draft, self.companion) if m is not None]
        for model in models:  # the last prompt token stays pending: every step scores [pending, drafts]
            # a prompt longer than a draft's (or companion's) context leaves that model's row empty: it never drafts
            model.prefill([s[:-1] if model is self.target or _room(model, s) > 0 else [] for s in sequences])
        prefill_s, untimed = time.perf_counter() - start, 0.0
        generated: list[list[int]] = [[] for _ in sequences]
        reasons: list[str | None] = [None] * len(sequences)
        active = list(range(len(sequences)))  # prompt index of each batch row
        stats: list[StepStats] = []
        while active:
            t0 = time.perf_counter()
            remaining = torch.tensor([max_new_tokens - len(generated[i]) for i in active])
            draft_u, verify_u, exponentials = self._draw([generators[i] for i in active], sampling)
            draft_tokens, draft_probs, verified, drafted, looked_up, forward_s = self._plan(
                active,
                [sequences[i] + generated[i] for i in active],
                remaining.sub(1),
                sampling,
                draft_sampling,
                draft_u,
                lookup,
            )
            t1 = time.perf_counter()
            pending = torch.tensor([(sequences[i] + generated[i])[-1] for i in active], device=device)[:, None]
            valid = torch.cat(
                [torch.ones_like(pending, dtype=torch.bool), verified_mask(verified.to(device), draft_tokens.shape[1])],
                dim=1,
            )
            logits = self.target.forward(torch.cat([pending, draft_tokens], 1), valid)
            forward_s += time.perf_counter() - t1
            target_probs = self._process(self.target, logits, sampling)  # [B, K+1, V]
            t2 = time.perf_counter()
            randomness = None if sampling.greedy else Randomness(verify_u[:, : draft_tokens.shape[1]], exponentials)
            out = verify(
                draft_tokens,
                draft_probs,
                target_probs,
                num_verified=verified.to(device),
                randomness=randomness,
                validate=False,
            )
            t3 = time.perf_counter()

            # the policy learns from the model's drafts only: a lookup row's acceptance says nothing about them
            model_rows = verified.masked_fill(looked_up.to(verified.device), 0)
            self.policy.observe(active, draft_tokens, draft_probs, target_probs, model_rows, out.num_accepted)
            tau = out.num_accepted.cpu()
            if lookup is not None:  # a prompt's next proposal length follows what was accepted of this one
                lookup.observe(active, verified.cpu().masked_fill(~looked_up, 0).tolist(), tau.tolist())
            emitted, finished = self._commit(out.tokens, tau, active, generated, reasons, stop, on_tokens)
            self._roll_back([len(sequences[i]) + len(generated[i]) - 1 for i in active], finished, models)
            step = StepStats(
                rows=list(active),
                verified=verified.tolist(),
                accepted=tau.tolist(),
                emitted=emitted,
                draft_s=t1 - t0,
                target_s=t2 - t1,
                verify_s=t3 - t2,
                total_s=time.perf_counter() - t0,
                forward_s=forward_s,
                drafted=drafted,
                lookup=looked_up.tolist() if lookup is not None else None,
            )
            if expected:  # bookkeeping outside the timed region: taken off the wall clock as well
                t4 = time.perf_counter()
                step = _with_expected(step, draft_tokens, draft_probs, target_probs, verified)
                untimed += time.perf_counter() - t4
            stats.append(step)
            active = [i for b, i in enumerate(active) if b not in finished]

        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(g, skip_special_tokens=True) for g in generated]
        wall_time = time.perf_counter() - start - untimed
        return GenerationResult(generated, texts, list(reasons), stats, wall_time, prefill_s)

    # --- the pieces of a step ----------------------------------------------------------------------------

    @staticmethod
    def _commit(tokens, tau, active, generated, reasons, stop, on_tokens) -> tuple[list[int], list[int]]:
        """Append each row's emitted tokens (cut at EOS, stop strings or the length cap); returns the number
        kept per row and the batch positions of the rows that finished."""
        emitted, finished = [], []
        for b, i in enumerate(active):
            kept, reasons[i] = stop.cut(generated[i], tokens[b, : int(tau[b]) + 1].tolist())
            generated[i] += kept
            emitted.append(len(kept))
            if on_tokens is not None and kept:
                on_tokens(i, kept)
            if reasons[i] is not None:
                finished.append(b)
        return emitted, finished

    def _roll_back(self, lengths: list[int], finished: list[int], models) -> None:
        """Cut the caches back to the committed tokens (less the pending last one) and drop finished rows."""
        lengths = torch.tensor(lengths)
        self.target.rollback(lengths.to(self.target.device))
        for model in (self.draft, self.companion):  # they never saw the last drafted token: keep the rest
            if model is not None:
                model.rollback(torch.minimum(model.lengths, lengths.to(model.device)))
        if finished:
            keep = torch.tensor([b for b in range(len(lengths)) if b not in finished], dtype=torch.long)
            for model in models:
                model.select(keep)

    def _draw(self, generators: list[torch.Generator], sampling: SamplingParams):
        """Each row's randomness for one step, from its own stream and always the same amount of it, so a row's
        draws never depend on its neighbours: max_draft uniforms for drafting (float64), max_draft for
        verification (float32) and V exponentials for the step's last token."""
        if sampling.greedy:
            return None, None, None
        draft_u = torch.stack([torch.rand(self.max_draft, dtype=torch.float64, generator=g) for g in generators])
        verify_u = torch.stack([torch.rand(self.max_draft, generator=g) for g in generators])
        exponentials = torch.cat(
            [draw_exponentials(1, self.vocab, dtype=torch.float32, device="cpu", generator=g) for g in generators]
        )
        device = self.target.device
        return draft_u.to(device), verify_u.to(device), exponentials.to(device)

    def _plan(
        self,
        rows: list[int],
        contexts: list[list[int]],
        room: torch.Tensor,
        sampling: SamplingParams,
        draft_sampling: SamplingParams,
        draft_u,
        lookup: LookupState | None,
    ):
        """Draft, let the companion score, and let the policy pick each row's verification length (at most
        ``room``: the step's last token is the target's own; and at most what fits in every model's context).
        With ``lookup`` (``rows`` = the rows' prompt indices) a row with a lookup proposal verifies it and does
        not draft with the model. Returns (draft tokens [B, W] and probs [B, W, V] (None for a one-hot draft) cut
        to the widest verified row W, verification lengths [B], positions the model drafted, which rows used
        lookup [B] bool, forward seconds)."""
        # What the draft has not seen yet: 1 token, 2 after a fully accepted step, more after steps that did not draft
        seen = self.draft.lengths.tolist() if self.draft is not None else [len(c) for c in contexts]
        unseen = [c[n:] for c, n in zip(contexts, seen)]
        limit = room.minimum(torch.tensor([self._draft_room(c) for c in contexts])).clamp(min=0)
        proposals = lookup.propose(rows, contexts, limit.tolist()) if lookup is not None else [[] for _ in rows]
        looked_up = torch.tensor([len(p) > 0 for p in proposals], dtype=torch.bool)  # [B]
        limit = limit.masked_fill(looked_up, 0)  # lookup rows are holes in the draft's forward
        catch_up = max((len(u) for u, n in zip(unseen, limit.tolist()) if n > 0), default=1)
        # without a draft model the policy is FixedLength(0): no row drafts with a model
        limit = limit.clamp(max=self.policy.draft_budget(len(contexts), catch_up))
        draft_tokens, draft_probs, forward_s = self._propose(unseen, limit, draft_sampling, draft_u)
        drafted = draft_tokens.shape[1]
        verified = limit.to(draft_tokens.device).clamp(max=drafted)  # each row's drafts; the policy may verify fewer
        if drafted:
            companion_probs, companion_s = self._score(contexts, draft_tokens, verified, sampling)
            verified = self.policy.lengths(draft_tokens, draft_probs, companion_probs, verified)
            forward_s += companion_s
        width = int(verified.max())
        draft_tokens, draft_probs = draft_tokens[:, :width], None if draft_sampling.greedy else draft_probs[:, :width]
        if looked_up.any():
            draft_tokens, draft_probs, verified = _with_proposals(proposals, draft_tokens, draft_probs, verified)
        return draft_tokens, draft_probs, verified, drafted, looked_up, forward_s

    def _draft_room(self, context: list[int]) -> int:
        """Tokens a row may draft before some model's context is full: the target scores [pending, x_1..x_k]
        at positions len - 1 .. len - 1 + k; the draft and the companion (if the policy scores with it) read
        x_1..x_{k-1} after the context."""
        scorer = self.companion if self.policy.needs_companion else None
        return min(
            [_room(self.target, context) - 1] + [_room(m, context) for m in (self.draft, scorer) if m is not None]
        )

    def _propose(self, unseen: list[list[int]], limit: torch.Tensor, sampling: SamplingParams, uniforms):
        """Draft up to ``limit[b]`` tokens in row b after the ``unseen`` tokens the draft reads first, fewer if the
        policy stops drafting: (tokens [B, K], probs [B, K, V], forward seconds)."""
        forward_s, device = 0.0, self.target.device

        def next_probs(drafted: torch.Tensor, drafting: torch.Tensor) -> torch.Tensor:
            nonlocal forward_s
            if drafted.shape[1] == 0:  # the first forward reads what the draft has not seen, in drafting rows only
                tokens, valid = left_pad([u if d else [] for u, d in zip(unseen, drafting.tolist())])
            else:
                tokens, valid = drafted[:, -1:], drafting[:, None]
            t0 = time.perf_counter()
            logits = self.draft.forward(tokens.to(self.draft.device), valid.to(self.draft.device))[:, -1]
            forward_s += time.perf_counter() - t0
            return self._process(self.draft, logits.to(device), sampling)  # [B, V]

        def choose(position: int, probs: torch.Tensor) -> torch.Tensor:
            return probs.argmax(-1) if uniforms is None else sample(probs, uniforms[:, position - 1])

        tokens, probs = draft_block(self.policy, limit.to(device), next_probs, choose, self.vocab)
        return tokens, probs, forward_s

    def _score(
        self, contexts: list[list[int]], draft_tokens: torch.Tensor, own: torch.Tensor, sampling: SamplingParams
    ):
        """The companion's processed distributions at the K drafted positions [B, K, V] (one forward over what it
        has not seen plus x_1..x_{K-1}; a row reads only its own ``own[b]`` drafts, the rest are holes) and
        the forward's seconds; (None, 0) when the policy needs no companion."""
        drafted = draft_tokens.shape[1]
        if self.companion is None or not self.policy.needs_companion:
            return None, 0.0
        # A row drafting none reads nothing (what it has not seen waits, as in the draft); the others read their
        # unseen context and x_1..x_{K-1}, of which a row drafting k < K tokens keeps x_1..x_{k-1}: the last K - 1
        # columns hold x_1..x_{K-1} (x_j in column j - 1 of those), the rest are holes.
        own = own.cpu()
        seen = self.companion.lengths.tolist()
        rows = [
            c[n:] + d if k else []
            for c, n, d, k in zip(contexts, seen, draft_tokens[:, : drafted - 1].tolist(), own.tolist())
        ]
        tokens, valid = left_pad(rows)
        if drafted > 1:
            valid[:, -(drafted - 1) :] &= torch.arange(drafted - 1)[None] < (own[:, None] - 1)
        t0 = time.perf_counter()
        logits = self.companion.forward(tokens.to(self.companion.device), valid.to(self.companion.device))
        seconds = time.perf_counter() - t0
        return self._process(self.companion, logits[:, -drafted:].to(self.target.device), sampling), seconds

    def _process(self, model: LanguageModel, logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
        """``process`` over the shared vocabulary, naming the model whose logits are not finite."""
        try:
            return process(logits[..., : self.vocab], sampling)
        except NonFiniteLogitsError as error:
            role = {id(self.target): "target", id(self.draft): "draft", id(self.companion): "companion"}[id(model)]
            raise NonFiniteLogitsError(
                f"the {role} model ({model_name(model)}) returned {error}: a float16 overflow or a broken checkpoint? "
                "Try another dtype (bfloat16 or float32)"
            ) from None

    def _check_context(self, sequences: list[list[int]], max_new_tokens: int) -> None:
        """Refuse, before any forward, a row that cannot fit in the target's context with its new tokens."""
        context = self.target.max_length
        for b, prompt in enumerate(sequences):
            if context is not None and len(prompt) + max_new_tokens > context:
                raise ValueError(
                    f"prompt {b} has {len(prompt)} tokens and max_new_tokens is {max_new_tokens}: {len(prompt)} + "
                    f"{max_new_tokens} = {len(prompt) + max_new_tokens} exceeds the context of {context} tokens of "
                    f"the target ({model_name(self.target)}); shorten the prompt or lower max_new_tokens"
                )

    def _encode(self, prompts, chat: bool) -> list[list[int]]:
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        sequences = []
        for b, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("string prompts need a tokenizer: pass token ids, or models with tokenizers")
                prompt = encode_prompt(self.tokenizer, prompt, chat=chat)
            prompt = [_token_id(t, b) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {b} is empty: give at least one token (for example the BOS token)")
            if not all(0 <= t < self.vocab for t in prompt):
                raise ValueError(f"prompt {b} has token ids outside the vocabulary [0, {self.vocab})")
            sequences.append(prompt)
        return sequences


class _Stopper:
    """Where a row ends: at its first EOS (kept), at the end of a stop string, or at max_new_tokens.

    Stop strings are looked for in the text of a window: the new tokens and, before them, as many generated
    tokens as the longest stop string has UTF-8 bytes, plus 3 (a token carries at least one byte, and the
    window's first character may be cut: a UTF-8 character spans at most 4 bytes). A stop string that ends in
    the new tokens lies inside that window, so a step decodes a bounded number of tokens however long the row.
    """

    def __init__(self, decoder: SpeculativeDecoder, stop_on_eos: bool, stop_strings: Sequence[str], limit: int):
        if isinstance(stop_strings, str) or not all(isinstance(s, str) for s in stop_strings):
            raise TypeError(
                f"stop_strings must be a list of strings, got {stop_strings!r} (a single stop string: "
                f"[{stop_strings!r}])"
                if isinstance(stop_strings, str)
                else f"stop_strings must be a list of strings, got {stop_strings!r}"
            )
        if any(s == "" for s in stop_strings):
            raise ValueError("stop_strings holds an empty string, which would end every row after one token")
        if stop_strings and decoder.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer to decode the generated text")
        self.eos = set(decoder.target.eos_token_ids) if stop_on_eos else set()
        self.stop_strings, self.limit, self.tokenizer = tuple(stop_strings), limit, decoder.tokenizer
        self.window = max((len(s.encode("utf-8")) for s in stop_strings), default=0) + 3

    def cut(self, generated: list[int], new: list[int]) -> tuple[list[int], str | None]:
        """The part of ``new`` that is kept, and why the row finished (None if it goes on)."""
        reason = None
        for n, token in enumerate(new):
            if token in self.eos:
                new, reason = new[: n + 1], "eos"
                break
        if self.stop_strings:
            before = generated[-self.window :]
            for n in range(1, len(new) + 1):  # the shortest prefix whose text completes a stop string
                text = self.tokenizer.decode(before + new[:n])
                if any(s in text for s in self.stop_strings):
                    new, reason = new[:n], "stop"
                    break
        if len(generated) + len(new) >= self.limit:
            new, reason = new[: self.limit - len(generated)], reason or "length"
        return new, reason


def _refuse_shared_adapters(*models: LanguageModel | None) -> None:
    """One adapter object in two roles would share one KV cache between them: each role's forwards would
    corrupt the other's. (The same transformers model wrapped in two adapters is fine: two caches.)"""
    present = [m for m in models if m is not None]
    if len({id(m) for m in present}) < len(present):
        raise ValueError(
            "target, draft and companion must be different model objects (each keeps its own KV "
            "cache); to draft with the target's own weights, wrap them again: HFModel(model)"
        )


def _room(model: LanguageModel, context: list[int]) -> int:
    """Tokens ``model`` can still take after ``context`` before its context length (a large number if none)."""
    return (model.max_length if model.max_length is not None else 1 << 62) - len(context) + 1


def _token_id(token, row: int) -> int:
    """An int token id (Python, NumPy or 0-d torch integer); a float, str or bool would be silently converted."""
    if isinstance(token, bool):
        raise TypeError(f"prompt {row} holds a bool ({token!r}), not a token id")
    try:
        return operator.index(token)
    except TypeError:
        raise TypeError(f"prompt {row} holds {token!r} ({type(token).__name__}): token ids must be ints") from None


def _row_seeds(seed, batch: int) -> list[int]:
    if seed is None:
        return [secrets.randbits(63) for _ in range(batch)]
    # an int, a NumPy integer or a 0-d array or tensor is one seed; a list, an array or a tensor holds one per prompt
    scalar = not hasattr(seed, "__iter__") or getattr(seed, "ndim", None) == 0
    usable = hasattr(seed, "__index__") if scalar else hasattr(seed, "__iter__")
    if isinstance(seed, (str, bytes, bool)) or not usable:
        raise TypeError(f"seed must be an int or one int per prompt, got {seed!r} ({type(seed).__name__})")
    if scalar:
        return [operator.index(seed) + b for b in range(batch)]
    if any(isinstance(s, bool) or not hasattr(s, "__index__") for s in seed):
        raise TypeError(f"seed must be an int or one int per prompt, got {seed!r}")
    seeds = [operator.index(s) for s in seed]
    if len(seeds) != batch:
        raise ValueError(f"seed must be an int or one int per prompt ({batch}), got {len(seeds)}")
    return seeds


def _with_proposals(
    proposals: list[list[int]], draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, verified: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The step's drafts (tokens [B, W'], probs [B, W', V] or None, verified [B]) with every row that has a
    lookup proposal verifying it instead: (tokens [B, W], probs [B, W, V] or None, verified [B]).

    A proposal was drafted with probability 1, so its law is one-hot at its tokens. When no row drafted with the
    model (W' = 0) or the model's draft was greedy, ``None`` says one-hot for every row; otherwise the lookup rows
    of the model's tensor are made one-hot (positions past a row's own draft are never verified: zeros there,
    and one-hot at PAD in lookup rows). ``None`` for a mixed step would stay lossless (accepting x with
    probability target(x), else drawing from the target without x, is exact whatever drafted x) but would accept
    the model's tokens less often than min(1, target(x) / draft(x)).
    """
    device = verified.device
    lengths = torch.tensor([len(p) for p in proposals], device=device)
    looked_up = lengths > 0  # [B]
    verified = torch.where(looked_up, lengths, verified)
    width = int(verified.max())
    proposed = torch.tensor([p + [PAD] * (width - len(p)) for p in proposals], dtype=torch.long, device=device)
    model_tokens = torch.nn.functional.pad(draft_tokens, (0, width - draft_tokens.shape[1]), value=PAD)
    tokens = torch.where(looked_up[:, None], proposed, model_tokens)  # [B, W]
    if draft_probs is None or draft_probs.shape[1] == 0:
        return tokens, None, verified
    probs = torch.nn.functional.pad(draft_probs, (0, 0, 0, width - draft_probs.shape[1]))  # [B, W, V], a copy
    probs[looked_up] = draft_distributions(tokens[looked_up], None, probs.shape[-1])
    return tokens, probs, verified


def _with_expected(step: StepStats, draft_tokens, draft_probs, target_probs, verified) -> StepStats:
    values = {
        method: expected_accepted(
            draft_tokens, draft_probs, target_probs, method, verified.to(draft_tokens.device), validate=False
        ).tolist()
        for method in ("token", "block")
    }
    probs = draft_distributions(draft_tokens, draft_probs, target_probs.shape[-1])
    mask = verified_mask(verified.to(draft_tokens.device), draft_tokens.shape[1])
    summed = (agreement(probs, target_probs[:, : draft_tokens.shape[1]]) * mask).sum(1)
    mean = (summed / mask.sum(1).clamp(min=1)).where(mask.any(1), float("nan"))
    return StepStats(
        **{
            **step.__dict__,
            "expected_token": values["token"],
            "expected_block": values["block"],
            "overlap": mean.tolist(),
        }
    )
