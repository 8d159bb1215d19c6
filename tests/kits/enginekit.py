"""The engine's references: plain greedy decoding by transformers, the exact law of the engine's first tokens
(``engine_law``; with tree or multi-path drafts ``engine_tree_law``), a check of the caches after every step
(``CacheCheck``), and a plausible engine bug (``off_by_one``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

import torch

from blockspec import SpeculativeDecoder
from blockspec.models.base import LanguageModel, left_pad
from blockspec.verify import accepted_length_law, final_distributions, tree_law
from blockspec.verify.multipath import paths_to_tree

from . import lawkit, multipathkit, treekit
from .tiny import EOS

Table = Callable[[torch.Tensor], torch.Tensor]  # contexts [N, L] (continuations of the prompt) -> probs [N, V]


def reference_greedy(target, prompt, max_new_tokens, eos: int | None = EOS):
    out = target.generate(
        torch.tensor([prompt], device=target.device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def off_by_one(verify):
    """A plausible engine bug: target distributions shifted one position against the drafts."""

    def broken(draft_tokens, draft_probs, target_probs, **kwargs):
        return verify(draft_tokens, draft_probs, target_probs.roll(1, dims=1), **kwargs)

    return broken


def engine_law(
    vocab: int,
    length: int,
    draft_len: int,
    target: Table,
    draft: Table,
    rule: str,
    *,
    reported: Table | None = None,
    verified: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The exact joint law [vocab] * length of the engine's first ``length`` tokens, step by step as the engine runs
    them. After g tokens a step drafts k = min(draft_len, length - 1 - g) tokens from ``draft`` (the engine leaves
    room for the step's own last token) and verifies them through the rule's closed forms (blockspec.verify), handed
    the draft probabilities of ``reported`` (default: ``draft``) and the target's [N, k+1, V] as ``verified`` turns
    them (default: as they are); k = 0 is a plain target step. Without ``reported`` and ``verified`` this is the
    correct engine and must be the target's law; with them, a subtly wrong one."""
    reported = reported or draft
    law = torch.zeros([vocab] * length, dtype=torch.float64)

    def visit(prefix: tuple[int, ...], mass: float) -> None:
        done = len(prefix)
        if done == length:
            law[prefix] += mass
            return
        context = torch.tensor(prefix, dtype=torch.long).reshape(1, done)
        width = min(draft_len, length - 1 - done)
        if width == 0:
            for token, prob in enumerate(target(context)[0].tolist()):
                if prob > 0:
                    visit(prefix + (token,), mass * prob)
            return
        blocks = lawkit.all_blocks(vocab, width)  # [N, k]
        contexts = [torch.cat([context.expand(len(blocks), -1), blocks[:, :i]], 1) for i in range(width + 1)]
        sampled = torch.stack([draft(contexts[i]) for i in range(width)], 1)  # [N, k, V]
        block_prob = sampled.gather(-1, blocks[..., None]).squeeze(-1).prod(-1)  # [N]
        drafted = block_prob > 0
        blocks, block_prob = blocks[drafted], block_prob[drafted]
        told = torch.stack([reported(contexts[i][drafted]) for i in range(width)], 1)
        target_probs = torch.stack([target(contexts[i][drafted]) for i in range(width + 1)], 1)
        if verified is not None:
            target_probs = verified(target_probs)
        # A drafted token the reported draft gives 0 would make the verifier divide 0 by 0 where the target gives 0
        # too: the controls are chosen so that it never happens (their law is then well defined).
        assert bool((told.gather(-1, blocks[..., None]) > 0).all()), "a drafted token is reported impossible"
        tau_law = accepted_length_law(blocks, told, target_probs, rule, validate=False)  # [N, k+1]
        final = final_distributions(blocks, told, target_probs, rule, validate=False)  # [N, k+1, V]
        for b, block in enumerate(blocks.tolist()):
            for tau in range(width + 1):
                step_mass = float(block_prob[b] * tau_law[b, tau])
                if step_mass > 0:
                    for token, prob in enumerate(final[b, tau].tolist()):
                        if prob > 0:
                            visit(prefix + tuple(block[:tau]) + (token,), mass * step_mass * prob)

    visit((), 1.0)
    return law


def table_lookup(table: list[torch.Tensor], vocab: int) -> Table:
    """A ``Table`` from ``table[L]`` [V**L, V], the rows after each continuation of length L in mixed radix order
    (``lawkit.logit_tables``, ``lawkit.processed``)."""

    def at(contexts: torch.Tensor) -> torch.Tensor:
        weights = vocab ** torch.arange(contexts.shape[1] - 1, -1, -1)
        return table[contexts.shape[1]][(contexts * weights).sum(-1)]

    return at


def _tables_after(vocab: int, prefix: tuple[int, ...], depth: int, target: Table, draft: Table) -> lawkit.Tables:
    """The ``lawkit.Tables`` (what treekit and multipathkit draw from) of contexts continuing ``prefix`` by up to
    ``depth`` tokens."""

    def rows(table: Table) -> list[torch.Tensor]:
        contexts = [lawkit.all_blocks(vocab, width) for width in range(depth + 1)]
        start = torch.tensor(prefix, dtype=torch.long).reshape(1, len(prefix))
        return [table(torch.cat([start.expand(len(c), -1), c], 1)) for c in contexts]

    return lawkit.Tables(vocab, rows(target), rows(draft))


# (tables, levels) -> every tree a step drafts down to ``levels`` levels, with the probability it is drafted
Drafts = Callable[[lawkit.Tables, int], treekit.Trees]


def tree_drafts(shape: tuple[int, ...]) -> Drafts:
    """The engine's trees of ``shape`` (siblings without replacement, as ``blockspec.drafting.tree``), cut to the
    levels a step drafts."""
    return lambda tables, levels: treekit.all_trees(tables, shape[:levels], "distinct")


def path_drafts(paths: int, scheme: str) -> Drafts:
    """The prefix trees of ``paths`` paths drawn under ``scheme`` (multipathkit), as long as a step drafts them."""

    def drafts(tables: lawkit.Tables, levels: int) -> treekit.Trees:
        drawn = multipathkit.all_paths(tables, paths, levels, scheme)
        return multipathkit.as_trees(paths_to_tree(*drawn.inputs, num_paths=drawn.num_paths), drawn.prob)

    return drafts


def engine_tree_law(
    vocab: int,
    length: int,
    levels: int,
    drafts: Drafts,
    target: Table,
    draft: Table,
    rule: str,
    *,
    scheme: str = "distinct",
    verified: Callable[[treekit.Trees], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The exact joint law [vocab] * length of the first ``length`` tokens of the engine drafting trees of ``levels``
    levels (``drafts``: ``tree_drafts`` or ``path_drafts``), step by step as the engine runs them. After g tokens a
    step drafts every tree of ``drafts`` cut to min(levels, length - 1 - g) levels and verifies it through the rule's
    closed form ``tree_law``, told ``scheme`` and handed the target rows ``verified(trees)`` [T, N+1, V] (default: the
    trees' own); depth 0 is a plain target step. With the defaults this is the correct engine and must be the target's
    law."""
    return stepwise_tree_law(
        vocab, length, lambda step: (levels, drafts), target, draft, rule, scheme=scheme, verified=verified
    )


def engine_shapes_law(
    vocab: int,
    length: int,
    shapes: Sequence[tuple[int, ...]],
    target: Table,
    draft: Table,
    rule: str,
    *,
    verified: Callable[[treekit.Trees], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``engine_tree_law`` of an engine whose step i (0-based, the batch's, whichever tokens a row has) drafts a tree
    of ``shapes[i]`` (the empty shape: a plain target step), as an adaptive shape does."""

    def at(step: int) -> tuple[int, Drafts]:
        return len(shapes[step]), tree_drafts(shapes[step])

    return stepwise_tree_law(vocab, length, at, target, draft, rule, scheme="distinct", verified=verified)


def stepwise_tree_law(
    vocab: int,
    length: int,
    steps: Callable[[int], tuple[int, Drafts]],
    target: Table,
    draft: Table,
    rule: str,
    *,
    scheme: str,
    verified: Callable[[treekit.Trees], torch.Tensor] | None,
) -> torch.Tensor:
    """``engine_tree_law`` with step i's (levels, drafts) = ``steps(i)``. The law after an emitted prefix at a step
    depends on them only (fresh randomness, caches in step), so it is computed once per (prefix, step)."""

    @cache
    def after(prefix: tuple[int, ...], step: int) -> torch.Tensor:  # [vocab] * (length - len(prefix))
        done = len(prefix)
        out = torch.zeros([vocab] * (length - done), dtype=torch.float64)
        if done == length:
            return out.fill_(1.0)
        levels, drafts = steps(step)
        depth = min(levels, length - 1 - done)
        if depth == 0:
            probs = target(torch.tensor([prefix], dtype=torch.long).reshape(1, done))[0]
            for token, prob in enumerate(probs.tolist()):
                if prob > 0:
                    out[token] += prob * after(prefix + (token,), step + 1)
            return out
        trees = drafts(_tables_after(vocab, prefix, depth, target, draft), depth)
        target_probs = trees.target_probs if verified is None else verified(trees)
        law = tree_law(
            trees.draft_tokens,
            trees.parents,
            trees.draft_probs,
            target_probs,
            rule=rule,
            scheme=scheme,
            num_nodes=trees.num_nodes,
            validate=False,
        )
        mass = trees.prob[:, None, None] * law.node_law[..., None] * law.final  # [T, N+1, V]
        node_depth, code = treekit.node_codes(trees, vocab)
        live = torch.nn.functional.pad(torch.arange(1, code.shape[1]) <= trees.num_nodes[:, None], (1, 0), value=True)
        for tau in range(depth + 1):
            at = (node_depth == tau) & live
            emitted = torch.zeros(vocab ** (tau + 1), dtype=torch.float64)  # (path, y) in base vocab
            emitted.index_add_(0, (code[at][:, None] * vocab + torch.arange(vocab)).flatten(), mass[at].flatten())
            for index in emitted.nonzero().flatten().tolist():
                tokens = tuple(index // vocab**i % vocab for i in range(tau, -1, -1))
                out[tokens] += emitted[index] * after(prefix + tokens, step + 1)
        return out

    return after((), 0)


class CacheCheck:
    """Wraps a decoder's roll back: after every step, each model's cache must hold exactly the committed tokens it
    has read (the target: all but the pending one; the draft: at most those), so a forward of the tokens it has not
    read gives the last logits of transformers' forward of the whole row. The check's own forward is rolled back."""

    def __init__(self, decoder: SpeculativeDecoder, models: dict[str, torch.nn.Module], monkeypatch):
        self.decoder, self.models, self.steps = decoder, models, 0
        real = decoder._roll_back

        def roll_back_and_check(batch, proposer, finished, out):
            real(batch, proposer, finished, out)
            self.check(batch.contexts())

        monkeypatch.setattr(decoder, "_roll_back", roll_back_and_check)

    def check(self, contexts: list[list[int]]) -> None:
        self.steps += 1
        if not contexts:  # every row has finished
            return
        committed = [len(c) - 1 for c in contexts]
        assert self.decoder.target.lengths.tolist() == committed
        for role, adapter in (("target", self.decoder.target), ("draft", self.decoder.draft)):
            assert isinstance(adapter, LanguageModel)
            seen = adapter.lengths.tolist()
            assert all(n <= c for n, c in zip(seen, committed))
            tokens, valid = left_pad([c[n:] for c, n in zip(contexts, seen)])
            logits = adapter.forward(tokens.to(adapter.device), valid.to(adapter.device))[:, -1]
            adapter.rollback(torch.tensor(seen, device=adapter.device))
            with torch.no_grad():
                for b, context in enumerate(contexts):
                    fresh = self.models[role](torch.tensor([context], device=logits.device)).logits[0, -1]
                    torch.testing.assert_close(logits[b], fresh, atol=1e-5, rtol=1e-5, msg=f"{role}, row {b}")
