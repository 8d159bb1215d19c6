"""What the engine refuses, before any forward where it can: bad arguments, prompts, seeds and stop strings, and
model outputs that are not finite. Each message names what to change."""

from __future__ import annotations

import operator
import re
import secrets
import threading
from collections.abc import Iterator, Mapping, Sequence, Set
from contextlib import contextmanager

import torch

from .defaults import DRAFT_LIMIT, PATH_DRAWINGS, PATHS_DRAWN
from .models.base import LanguageModel, model_name
from .models.chat import encode_prompt
from .policy import FixedLength, LengthPolicy
from .policy.shapes import AdaptiveShape, tree_nodes
from .sampling import NonFiniteLogitsError, SamplingParams, is_int, process
from .verify import get_rule


def check_decoder(rule: str, draft, policy, max_draft, lookup) -> None:
    """The arguments of ``SpeculativeDecoder``, before any model is wrapped."""
    from .drafting import PromptLookup  # deferred: the drafting package imports this module

    get_rule(rule)
    if isinstance(policy, str) and policy != "sv":
        raise ValueError(f"policy must be a LengthPolicy, 'sv' or None, got {policy!r}")
    if policy is not None and not isinstance(policy, str | LengthPolicy):
        raise TypeError(f"policy {type(policy).__name__} lacks some of the hooks of blockspec.policy.LengthPolicy")
    drafting = draft is not None or lookup is not None
    if drafting and not isinstance(policy, LengthPolicy) and not (is_int(max_draft) and max_draft >= 1):
        raise ValueError(f"max_draft must be an int >= 1, got {max_draft!r}")
    if policy is not None and draft is None:
        raise ValueError(
            "a length policy needs a draft model: without one the target decodes alone, and prompt lookup takes "
            "its lengths from its own settings"
        )
    if lookup is not None:
        if not isinstance(lookup, PromptLookup):
            raise TypeError(f"lookup must be a PromptLookup, got {type(lookup).__name__}")
        if policy is not None and not isinstance(policy, FixedLength):
            raise ValueError(
                "prompt lookup combines only with FixedLength and its subclasses (AdaptiveLength), not with "
                f"{policy if isinstance(policy, str) else type(policy).__name__}: SV's per-position predictions "
                "model the draft model's drafts"
            )
    built_for = getattr(policy, "rule", None)
    if built_for is not None and built_for != rule and rule != "greedy":
        raise ValueError(
            f"the length policy was built for the {built_for} rule but rule={rule!r}: its predicted gains would be "
            "those of another rule"
        )


def draft_shape(
    tree, paths, paths_drawn, max_draft, draft, policy, companion, lookup
) -> tuple[int, ...] | AdaptiveShape | None:
    """The slots a ``SpeculativeDecoder`` drafts each step, as a tree shape (children per node at each depth): its
    ``tree`` as a tuple, or (k, 1, .., 1) for ``paths`` = k paths of ``max_draft`` tokens (``path_layout``); an
    ``AdaptiveShape`` as it is (it chooses each step's); None for chains. Refused without a draft model, and with
    what this step does not combine it with yet (length policies, SV, lookup)."""
    if paths is None:
        if paths_drawn != PATHS_DRAWN:
            raise ValueError(f"paths_drawn={paths_drawn!r} says how paths=... are drawn: pass paths too")
        if tree is None:
            return None
        shape, what = tree if isinstance(tree, AdaptiveShape) else tree_levels(tree), "tree"
    else:
        if tree is not None:
            raise ValueError("tree and paths both shape a step's draft: pass one of them")
        shape, what = path_layout(paths, max_draft, paths_drawn), "paths"
    drafting = "a tree is" if what == "tree" else "paths are"
    if draft is None:
        raise ValueError(f"{drafting} drafted by a draft model: pass draft=... with {what}=...")
    if policy is not None or companion is not None:
        raise ValueError(
            f"{drafting} drafted with a shape of its own: it combines with no length policy (nor SV's companion); "
            f"pass {what}=... without policy= and companion="
        )
    if lookup is not None:
        raise ValueError(f"{drafting} not drafted with prompt lookup yet; pass {what}=... without lookup=")
    return shape


def path_layout(paths, length, drawn) -> tuple[int, ...]:
    """The slots of ``paths`` paths of ``length`` tokens as a tree shape, (k, 1, .., 1): the root's k children, then
    one child under each, down to depth ``length``. ``drawn`` (one of ``PATH_DRAWINGS``) and the node count, at most
    DRAFT_LIMIT, are checked here too. (The command line checks ``--paths`` with it.)"""
    if not (is_int(paths) and paths >= 1):
        raise ValueError(f"paths must be an int >= 1, the paths drafted per step, got {paths!r}")
    if not (is_int(length) and length >= 1):
        raise ValueError(f"the length of a path (max_draft) must be an int >= 1, got {length!r}")
    if drawn not in PATH_DRAWINGS:
        raise ValueError(f"paths_drawn must be one of {PATH_DRAWINGS}, got {drawn!r}")
    if paths * length > DRAFT_LIMIT:
        raise ValueError(
            f"{paths} paths of {length} tokens draft up to {paths * length} nodes per step, more than {DRAFT_LIMIT} "
            "(the bound of --max-draft: every node is a token the target scores each step)"
        )
    return (int(paths),) + (1,) * (int(length) - 1)


def tree_levels(tree) -> tuple[int, ...]:
    """A tree shape's own rules, whatever it is combined with: a non-empty sequence of ints >= 1, the children of
    every node at each depth, of at most DRAFT_LIMIT nodes (``tree_nodes``); returned as a tuple of Python ints.
    (The command line checks ``--tree`` with it.)"""
    if isinstance(tree, str | bytes) or not isinstance(tree, Sequence) or len(tree) == 0:
        raise ValueError(f"tree must be a non-empty sequence of ints (children per node at each depth), got {tree!r}")
    if not all(is_int(k) and k >= 1 for k in tree):
        raise ValueError(
            f"tree must hold ints >= 1, the children of every node at each depth, e.g. (2, 1, 1); got {tree!r}"
        )
    shape = tuple(int(k) for k in tree)
    nodes = tree_nodes(shape)
    if nodes > DRAFT_LIMIT:
        raise ValueError(
            f"the tree {','.join(map(str, shape))} drafts {nodes} nodes per step, more than {DRAFT_LIMIT} (the bound "
            "of --max-draft: every node is a token the target scores each step)"
        )
    return shape


def parse_tree(text: str) -> tuple[int, ...]:
    """A tree shape as the command line and the bench's configuration names write it, the children per node at each
    depth separated by commas: "2,1,1" -> (2, 1, 1), held to ``tree_levels``'s rules."""
    parts = text.split(",")
    if not all(re.fullmatch(r"-?[0-9]+", part) for part in parts):
        raise ValueError(
            f"a tree shape is the children per node at each depth, integers separated by commas (e.g. 2,1,1), "
            f"got {text!r}"
        )
    return tree_levels(tuple(int(part) for part in parts))


def refuse_shared_adapters(*models: LanguageModel | None) -> None:
    """One adapter object in two roles would share one KV cache between them: each role's forwards would
    corrupt the other's. (The same transformers model wrapped in two adapters is fine: two caches.)"""
    present = [m for m in models if m is not None]
    if len({id(m) for m in present}) < len(present):
        raise ValueError(
            "target, draft and companion must be different model objects (each keeps its own KV cache); to draft "
            "with the target's own weights, wrap them again: HFModel(model)"
        )


def check_generate(max_new_tokens, rule: str, sampling: SamplingParams, draft_sampling) -> None:
    if not (is_int(max_new_tokens) and max_new_tokens >= 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not get_rule(rule).sampled and not sampling.greedy:
        raise ValueError(f"rule={rule!r} needs temperature 0; use 'block' or 'token' to sample")
    if draft_sampling is not None and sampling.greedy:
        raise ValueError("draft_sampling needs a sampled target: at temperature 0 the draft proposes its argmax")


def stop_strings_of(stop_strings, tokenizer) -> tuple[str, ...]:
    """``stop_strings`` as a tuple, read once (a generator is consumed by reading it), then checked."""
    strings = check_stop_strings(stop_strings)
    if strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to decode the generated text")
    return strings


def check_stop_strings(stop_strings) -> tuple[str, ...]:
    """``stop_strings`` as a tuple, checked as far as that is possible without a tokenizer."""
    if isinstance(stop_strings, str):
        raise TypeError(
            f"stop_strings must be a list of strings, got {stop_strings!r} (a single stop string: [{stop_strings!r}])"
        )
    strings = tuple(stop_strings)
    if not all(isinstance(s, str) for s in strings):
        raise TypeError(f"stop_strings must be a list of strings, got {strings!r}")
    if any(s == "" for s in strings):
        raise ValueError("stop_strings holds an empty string, which would end every row after one token")
    for n, string in enumerate(strings):
        check_text(string, f"stop string {n}")
    return strings


def encode_prompts(prompts, tokenizer, vocab: int, chat: bool) -> list[list[int]]:
    """Token ids of each prompt: a string (tokenized, through the chat template if ``chat``) or a sequence of ints
    (a list, tuple, 1-d array or tensor). Bytes, mappings and sets are refused: their items are not token ids."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
    sequences = []
    for b, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            check_text(prompt, f"prompt {b}")
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass token ids, or models with tokenizers")
            prompt = encode_prompt(tokenizer, prompt, chat=chat)
        elif isinstance(prompt, bytes | bytearray | memoryview | Mapping | Set) or not (
            isinstance(prompt, Sequence) or getattr(prompt, "ndim", None) == 1
        ):
            raise TypeError(
                f"prompt {b} is a {type(prompt).__name__}: give a string or a list of int token ids (a tuple, "
                "a 1-d array or tensor also works)"
            )
        prompt = [token_id(t, b) for t in prompt]
        if not prompt:
            raise ValueError(f"prompt {b} is empty: give at least one token (for example the BOS token)")
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt {b} has token ids outside the vocabulary [0, {vocab})")
        sequences.append(prompt)
    return sequences


def check_text(text: str, what: str) -> None:
    """Refuse a string that is not valid Unicode text: a lone surrogate (from a file or an argument that was not
    valid UTF-8, which Python reads as U+DC80..U+DCFF) would reach the tokenizer as something else."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        character = text[error.start]
        raise ValueError(
            f"{what} is not valid UTF-8 text: character {error.start} is U+{ord(character):04X}, a lone surrogate "
            "(a byte that is not UTF-8, or half of a UTF-16 pair); give the text as UTF-8"
        ) from None


def token_id(token, row: int) -> int:
    """An int token id (Python, NumPy or 0-d torch integer); a float, str or bool would be silently converted."""
    if isinstance(token, bool):
        raise TypeError(f"prompt {row} holds a bool ({token!r}), not a token id")
    try:
        return operator.index(token)
    except TypeError:
        raise TypeError(f"prompt {row} holds {token!r} ({type(token).__name__}): token ids must be ints") from None


def check_context(sequences: list[list[int]], max_new_tokens: int, target: LanguageModel) -> None:
    """Refuse, before any forward, a row that cannot fit in the target's context with its new tokens."""
    context = target.max_length
    for b, prompt in enumerate(sequences):
        if context is not None and len(prompt) + max_new_tokens > context:
            raise ValueError(
                f"prompt {b} has {len(prompt)} tokens and max_new_tokens is {max_new_tokens}: {len(prompt)} + "
                f"{max_new_tokens} = {len(prompt) + max_new_tokens} exceeds the context of {context} tokens of "
                f"the target ({model_name(target)}); shorten the prompt or lower max_new_tokens"
            )


SEEDS = 2**64  # torch.Generator takes seeds in [0, 2**64); it would alias a negative seed with seed + 2**64


def row_seeds(seed, batch: int) -> list[int]:
    """One seed per row: ``seed + b`` for an int, the given ones for a list, random ones for None; each in
    [0, 2**64)."""
    if seed is None:
        return [secrets.randbits(63) for _ in range(batch)]
    # an int, a NumPy integer or a 0-d array or tensor is one seed; a list, an array or a tensor holds one per prompt
    scalar = not hasattr(seed, "__iter__") or getattr(seed, "ndim", None) == 0
    usable = hasattr(seed, "__index__") if scalar else hasattr(seed, "__iter__")
    if isinstance(seed, str | bytes | bool) or not usable:
        raise TypeError(f"seed must be an int or one int per prompt, got {seed!r} ({type(seed).__name__})")
    if scalar:
        first = operator.index(seed)
        if not 0 <= first <= SEEDS - batch:
            raise ValueError(
                f"seed {first} is out of range: row b uses seed + b, so for {batch} prompt(s) the seed must lie in "
                f"[0, 2**64 - {batch}] = [0, {SEEDS - batch}]"
            )
        return [first + b for b in range(batch)]
    if any(isinstance(s, bool) or not hasattr(s, "__index__") for s in seed):
        raise TypeError(f"seed must be an int or one int per prompt, got {seed!r}")
    seeds = [operator.index(s) for s in seed]
    if len(seeds) != batch:
        raise ValueError(f"seed must be an int or one int per prompt ({batch}), got {len(seeds)}")
    for b, row_seed in enumerate(seeds):
        if not 0 <= row_seed < SEEDS:
            raise ValueError(f"the seed of prompt {b}, {row_seed}, is out of range: seeds lie in [0, 2**64 - 1]")
    return seeds


_IN_USE: set[int] = set()  # id() of every model adapter a generate call is running on, in any thread
_IN_USE_LOCK = threading.Lock()


@contextmanager
def exclusive(*models: LanguageModel | None) -> Iterator[None]:
    """Hold ``models`` for one generate call: a model adapter keeps one call's rows in its KV cache, so a second
    call on it (another thread, or a callback of the first) is refused instead of corrupting both."""
    ids = {id(m) for m in models if m is not None}
    with _IN_USE_LOCK:
        if ids & _IN_USE:
            raise RuntimeError(
                "these models are already generating (another thread, or a callback of a running generate): a "
                "model's KV cache holds one call's rows; give each thread its own SpeculativeDecoder and models"
            )
        _IN_USE.update(ids)
    try:
        yield
    finally:
        with _IN_USE_LOCK:
            _IN_USE.difference_update(ids)


def probabilities(
    model: LanguageModel, role: str, logits: torch.Tensor, sampling: SamplingParams, vocab: int
) -> torch.Tensor:
    """``process`` over the shared vocabulary ([..., V] float32), naming the model whose logits are not finite."""
    try:
        return process(logits[..., :vocab], sampling)
    except NonFiniteLogitsError as error:
        raise NonFiniteLogitsError(
            f"the {role} model ({model_name(model)}) returned {error}: a float16 overflow or a broken checkpoint? "
            "Try another dtype (bfloat16 or float32)"
        ) from None
