"""The speculative decoding loop: draw -> propose -> score -> verify -> observe -> commit -> roll back.

Glossary: B rows still decoding, W the step's widest verified proposal, V the target's vocabulary. Every row
keeps its own tokens, random stream and cache positions, so rows accept different numbers of tokens each step
and leave the batch when they finish. With no draft model and no prompt lookup the target decodes alone through
the same loop (steps that propose nothing), so comparisons are fair.

A tree step (a static tree, or several paths: ``paths=k``) runs the same stages: its proposal carries each node's
parent (W = N nodes), the target scores the pending token as node 1 and drafted node a as node a + 1 in one
``forward_tree``, a tree rule verifies it, and the caches commit the accepted path before they roll back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import cast

import torch

from . import checks
from .batch import Batch, Draws
from .defaults import MAX_DRAFT, PATHS_DRAWN, RULE
from .drafting import DraftProposer, LookupState, PathProposer, PromptLookup, Proposal, Proposer, TreeProposer
from .drafting.tree import SCHEME, tree_slots
from .models.adapt import as_model
from .models.base import TreeLanguageModel, check_shared_vocabulary, model_name, target_vocabulary
from .outputs import GenerationResult, StepStats
from .policy import FixedLength, LengthPolicy, SVPolicy
from .policy.shapes import AdaptiveShape
from .sampling import SamplingParams, check_unsupported, draw
from .stopping import Stopper
from .verify import Randomness, Rule, TreeVerifyOutput, VerifyOutput, get_rule
from .verify.base import verified_mask
from .verify.multipath import TREE_SCHEME
from .verify.tree import verify_tree_block, verify_tree_greedy, verify_tree_token
from .verify.tree_inputs import node_mask

log = logging.getLogger(__name__)

# The tree form of each rule in blockspec.verify.RULES (verify/tree.py)
TREE_VERIFIERS = {"block": verify_tree_block, "token": verify_tree_token, "greedy": verify_tree_greedy}

# on_step(stats, proposal, target_probs [B, W+1, V]): called after each step is committed, before the roll back
StepObserver = Callable[[StepStats, Proposal, torch.Tensor], None]


class SpeculativeDecoder:
    """Lossless speculative decoding of ``target`` with proposals from ``draft`` and/or prompt ``lookup``.

    ``rule``: a name in ``blockspec.verify.RULES`` ("block", the default; "token"; "greedy", temperature 0 only);
    at temperature 0 the greedy rule runs whatever ``rule`` says (the others coincide with it there). ``policy``
    sets each step's draft and verification lengths: ``FixedLength(max_draft)`` by default, ``"sv"`` for
    Speculative Verification from saved profiles, or any ``blockspec.policy.LengthPolicy``. ``companion`` scores
    drafts for a policy that needs it. Models are ``LanguageModel`` adapters or transformers models, distinct
    objects (each keeps its own KV cache); the target's vocabulary is the one kept. docs/guide/library.md has it all.

    ``tree``: draft a tree of this static shape instead of a chain, children per node at each depth ((2, 1, 1): two
    children of the root, then a chain of one under each, 6 nodes, 3 levels; ``max_draft`` is then unused), with
    siblings drawn without replacement and verified by the rule's tree form (``TREE_VERIFIERS``). Both models must
    be ``TreeLanguageModel`` (HFModel and LlamaCppModel are); no length policy, companion or lookup with it yet. A
    ``blockspec.policy.AdaptiveShape`` instead chooses each step's shape, tree or chain, from measured forward costs
    and the acceptance seen so far (its docstring says why the output law stays the target's).

    ``paths``: draft k paths of ``max_draft`` tokens each step instead of one chain, verified jointly by the rule's
    tree form on their prefix tree (verify/multipath.py), with what ``tree`` needs and refuses (one or the other).
    ``paths_drawn``: "distinct" (the default: the first tokens without replacement, each path then going on alone,
    which is the tree (k, 1, .., 1)) or "iid" (k independent paths, merged into their prefix tree as they are drawn,
    so agreeing paths cost the target fewer nodes; at temperature 0 they are all the draft's greedy chain).
    """

    def __init__(
        self,
        target,
        draft=None,
        *,
        rule: str = RULE,
        max_draft: int = MAX_DRAFT,
        policy: LengthPolicy | str | None = None,
        companion=None,
        lookup: PromptLookup | None = None,
        tree: tuple[int, ...] | AdaptiveShape | None = None,
        paths: int | None = None,
        paths_drawn: str = PATHS_DRAWN,
    ):
        checks.check_decoder(rule, draft, policy, max_draft, lookup)
        # the slots drafted each step as a tree shape: the tree's, or the paths' (k, 1, .., 1); None: a chain
        self.tree = checks.draft_shape(tree, paths, paths_drawn, max_draft, draft, policy, companion, lookup)
        self.paths, self.paths_drawn = (None, None) if paths is None else (int(paths), paths_drawn)
        self.target = as_model(target)
        self.draft = as_model(draft) if draft is not None else None
        self.companion = as_model(companion) if companion is not None and self.draft is not None else None
        checks.refuse_shared_adapters(self.target, self.draft, self.companion)
        self.rule, self.lookup = rule, lookup
        if lookup is not None and lookup.costs is None and torch.device(self.target.device).type == "cpu":
            log.warning(
                "prompt lookup without costs proposes every match whole, which a CPU's wider forwards can make slower "
                "than the target alone: pass PromptLookup(costs=blockspec.auto.lookup_latency(target, batch_size))"
            )
        self.sv = policy == "sv"  # resolved per call: an SV calibration is specific to the call's sampling
        self.policy: LengthPolicy = (
            policy if isinstance(policy, LengthPolicy) else FixedLength(max_draft if self.draft is not None else 0)
        )
        # the widest step, what each step draws randomness for: the model's drafts or the longest lookup proposal
        self.max_draft = max(self.policy.max_draft if self.draft else 0, lookup.max_draft if lookup else 0)
        deepest = self.max_draft
        if isinstance(self.tree, AdaptiveShape):  # randomness for the widest shape it may choose, whichever it does
            self.max_draft, deepest = self.tree.max_nodes, self.tree.max_depth
        elif self.tree is not None:  # one uniform per slot of the tree for drafting, and one per node for verifying
            self.max_draft, deepest = len(tree_slots(self.tree)), len(self.tree)
        if self.tree is not None:
            assert self.draft is not None  # checks.draft_shape refuses a tree without a draft model
            for role, model in (("target", self.target), ("draft", self.draft)):
                if not isinstance(model, TreeLanguageModel):
                    raise ValueError(
                        f"{'drafting paths' if self.paths else 'tree drafting'} needs a {role} that scores trees "
                        "(blockspec.models.base.TreeLanguageModel, as HFModel and LlamaCppModel do); the "
                        f"{role} {model_name(model)} does not"
                    )
        context = self.target.max_length
        if context is not None and deepest >= context:
            raise ValueError(f"max_draft {deepest} is not below the target's context of {context} tokens")
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
        on_tokens: Callable[[int, list[int]], None] | None = None,
        on_step: StepObserver | None = None,
        draft_sampling: SamplingParams | None = None,
        chat: bool = False,
        **options,
    ) -> GenerationResult:
        """Up to ``max_new_tokens`` new tokens for each prompt: a string (tokenized as it is, or as a user message
        through the chat template if ``chat``) or a list of token ids.

        ``seed``: one int (row b uses seed + b) or one per prompt; each row draws from its own stream, so its law
        never depends on its neighbours. ``stop_strings``: a row ends right after the first of them appears in its
        text. ``on_tokens(i, tokens)`` streams the tokens of prompt i as they are committed; ``on_step`` observes
        each step (``StepObserver``). ``draft_sampling``: the draft's own temperature / top-k / top-p (default:
        ``sampling``); any choice stays lossless. One call at a time runs on a decoder's models (a RuntimeError
        says so otherwise): a thread needs its own decoder and models. docs/guide/library.md says more.
        """
        check_unsupported(options)
        checks.check_generate(max_new_tokens, self.rule, sampling, draft_sampling)
        if self.tree is not None and draft_sampling is not None and draft_sampling.greedy:
            raise ValueError(
                "a tree or paths drafted at temperature 0 (ranked, not drawn) are verified at temperature 0 only: "
                "a sampled target needs a sampled draft_sampling"
            )
        max_new_tokens = int(max_new_tokens)  # a NumPy integer is stored as Python's
        stop_strings = checks.stop_strings_of(stop_strings, self.tokenizer)
        sequences = checks.encode_prompts(prompts, self.tokenizer, self.vocab, chat)
        checks.check_context(sequences, max_new_tokens, self.target)
        batch = Batch(sequences, checks.row_seeds(seed, len(sequences)))
        eos = self.target.eos_token_ids if stop_on_eos else ()
        stopper = Stopper(eos, self.tokenizer, stop_strings, max_new_tokens)
        with checks.exclusive(self.target, self.draft, self.companion):
            proposer = self._proposer(len(sequences), sampling, draft_sampling or sampling)
            return self._decode(batch, proposer, stopper, sampling, on_tokens, on_step)

    def _decode(
        self,
        batch: Batch,
        proposer: Proposer,
        stopper: Stopper,
        sampling: SamplingParams,
        on_tokens: Callable[[int, list[int]], None] | None,
        on_step: StepObserver | None,
    ) -> GenerationResult:
        """The loop, from the prefill of ``batch``'s prompts until every row has ended."""
        max_new_tokens = stopper.limit
        sequences = batch.contexts()
        rule = get_rule("greedy" if sampling.greedy else self.rule)
        device = self.target.device  # sampling and verification run where the target's logits are

        start = time.perf_counter()
        self.target.prefill([s[:-1] for s in sequences])  # the last prompt token stays pending
        proposer.prefill(sequences)
        prefill_s = time.perf_counter() - start
        stats: list[StepStats] = []
        while batch.rows:
            contexts = batch.contexts()
            # 1. draw: each row's uniforms [B, W] for drafting and verifying, and [B] for a row that verifies nothing
            draws = batch.draw(self.max_draft, sampling, device)
            # 2. propose: tokens [B, W], probs [B, W, V] or None (one-hot), verified [B]
            room = batch.remaining(max_new_tokens) - 1  # the step's last token is the target's own
            proposal = proposer.propose(batch.rows, contexts, room, None if draws is None else draws.drafting)
            # 3. score: the target reads [pending, x_1..x_W] (a tree: pending, then the nodes), up to each row's own
            target_probs = self._score(contexts, proposal, sampling)  # [B, W+1, V]
            # 4. verify: out.tokens [B, W+1], out.num_accepted [B] (tau)
            out = self._verify(rule, proposal, target_probs, batch, draws)
            # 5. observe: the length policy and lookup learn from this step's outcome (a tree proposer: its path)
            proposer.observe(batch.rows, proposal, target_probs, out)
            # 6. commit: each row keeps tau + 1 tokens, less what its end cuts
            emitted, finished = batch.commit(out.tokens, out.num_accepted, stopper, on_tokens)
            step = StepStats(
                rows=list(batch.rows),
                verified=proposal.verified.tolist(),
                accepted=out.num_accepted.tolist(),
                emitted=emitted,
                drafted=proposal.drafted,
                lookup=proposal.looked_up.tolist() if self.lookup is not None else None,
            )
            stats.append(step)
            if on_step is not None:
                on_step(step, proposal, target_probs)
            # 7. roll back: the caches keep the committed tokens less the pending one (a tree step's commit its
            # accepted path first); finished rows leave
            self._roll_back(batch, proposer, finished, out)

        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(g, skip_special_tokens=True) for g in batch.generated]
        reasons = cast(list[str], batch.finish_reasons)  # the loop ends when every row has a reason to end
        return GenerationResult(batch.generated, texts, reasons, stats, time.perf_counter() - start, prefill_s)

    def _proposer(self, rows: int, sampling: SamplingParams, draft_sampling: SamplingParams) -> Proposer:
        """A fresh proposer for one call: the SV policy for this call's sampling, a reset policy, fresh lookup; or
        the tree proposer (i.i.d. paths: the path proposer, which merges them as it draws them)."""
        if self.tree is not None:
            assert isinstance(self.target, TreeLanguageModel) and isinstance(self.draft, TreeLanguageModel)
            if isinstance(self.tree, AdaptiveShape):
                self.tree.reset()
            drafter = PathProposer if self.paths_drawn == "iid" else TreeProposer
            return drafter(self.target, self.draft, self.tree, draft_sampling, self.vocab)
        if self.sv:
            rule = "token" if self.rule == "token" else "block"
            self.policy = SVPolicy.from_cache(
                self.target, self.draft, sampling=sampling, max_draft=self.max_draft, rule=rule
            )
        self.policy.reset()
        lookup = LookupState(self.lookup, rows) if self.lookup is not None else None
        return DraftProposer(
            self.target, self.draft, self.companion, self.policy, lookup, sampling, draft_sampling, self.vocab
        )

    def _score(self, contexts: list[list[int]], proposal: Proposal, sampling: SamplingParams) -> torch.Tensor:
        """The target's processed distributions [B, W+1, V] after the pending token and each drafted one (a tree:
        after the pending token, then after each node, as the tree verifiers take them)."""
        device = self.target.device
        pending = torch.tensor([c[-1] for c in contexts], device=device)[:, None]  # [B, 1]
        tokens = torch.cat([pending, proposal.tokens.to(device)], 1)  # [B, W+1]
        valid = torch.ones_like(pending, dtype=torch.bool)
        if proposal.parents is None:
            drafts = verified_mask(proposal.verified.to(device), proposal.tokens.shape[1])  # [B, W]
            logits = self.target.forward(tokens, torch.cat([valid, drafts], dim=1))
        else:  # the pending token is node 1 (under the root, the last cached token), drafted node a is node a + 1
            assert isinstance(self.target, TreeLanguageModel)
            nodes = node_mask(proposal.verified.to(device), proposal.tokens.shape[1])  # [B, N]
            parents = torch.cat([torch.zeros_like(pending), proposal.parents.to(device) + 1], 1)  # [B, N+1]
            logits = self.target.forward_tree(tokens, parents, torch.cat([valid, nodes], dim=1))
        return checks.probabilities(self.target, "target", logits, sampling, self.vocab)

    def _verify(
        self, rule: Rule, proposal: Proposal, target_probs: torch.Tensor, batch: Batch, draws: Draws | None
    ) -> VerifyOutput:
        """The rule's verdict on a chain, or its tree form's on a tree: siblings drawn as ``SCHEME`` says, or i.i.d.
        paths' prefix tree, verified as multipath.py verifies it (``TREE_SCHEME``). A row that verifies nothing
        drafted takes the target's own token (``plain``): the rule's verdict there, without its race."""
        verified = proposal.verified.to(target_probs.device)
        plain_rows = verified == 0  # [B]
        uniforms = None if draws is None else draws.plain
        if proposal.parents is None and bool(plain_rows.all()):  # a plain target step (a tree step must commit)
            return plain(target_probs, uniforms)
        randomness = None
        if draws is not None:
            exponentials = batch.exponentials((~plain_rows).tolist(), self.vocab, target_probs.device)
            randomness = Randomness(draws.verifying[:, : proposal.tokens.shape[1]], exponentials)
        if proposal.parents is None:
            out = rule.verify(
                proposal.tokens,
                proposal.probs,
                target_probs,
                num_verified=verified,
                randomness=randomness,
                validate=False,
            )
        else:
            out = TREE_VERIFIERS[rule.name](
                proposal.tokens,
                proposal.parents,
                proposal.probs,
                target_probs,
                scheme=TREE_SCHEME if self.paths_drawn == "iid" else SCHEME,
                num_nodes=verified,
                randomness=randomness,
                validate=False,
            )
        if uniforms is not None and bool(plain_rows.any()):  # their race ran on ones: not a draw of their law
            out.tokens[plain_rows, 0] = plain(target_probs[plain_rows], uniforms[plain_rows]).tokens[:, 0]
        return out

    def _roll_back(self, batch: Batch, proposer: Proposer, finished: list[int], out: VerifyOutput) -> None:
        lengths = batch.lengths()  # [B]
        if isinstance(out, TreeVerifyOutput):  # the target keeps node 1 (the pending token), then the accepted path
            assert isinstance(self.target, TreeLanguageModel)
            path = out.accepted_nodes  # [B, D]: verifier nodes 1..N, -1 after
            pending = torch.ones_like(path[:, :1])
            self.target.commit(torch.cat([pending, torch.where(path >= 0, path + 1, -1)], 1).to(self.target.device))
        self.target.rollback(lengths.to(self.target.device))
        proposer.roll_back(lengths)
        if finished:
            keep = torch.tensor([b for b in range(len(batch.rows)) if b not in finished], dtype=torch.long)
            self.target.select(keep)
            proposer.select(keep)
            batch.drop(finished)


def plain(target_probs: torch.Tensor, uniforms: torch.Tensor | None) -> VerifyOutput:
    """The verdict on rows that verify nothing drafted (``target_probs`` [B, W+1, V]): tau = 0 and the target's own
    token after the pending one, drawn by inversion from each row's plain uniform ``uniforms`` [B]
    (``sampling.sample``), or without them (temperature 0: one-hot probabilities) its argmax. Every rule's verdict
    there is a draw of that law; this one costs one uniform where the rules' race takes V exponentials."""
    row = target_probs[:, 0]  # [B, V]
    last = draw(row, uniforms)
    return VerifyOutput(tokens=last[:, None], num_accepted=torch.zeros_like(last))
