"""``blockspec generate``: parse the options into a GenerateConfig, load the models, decode, stream the text."""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

from .. import defaults
from ..defaults import BACKENDS, DTYPES, LLAMACPP_QUANTS, PATH_DRAWINGS, QUANTS
from . import sv
from .common import (
    ALLOW_DOWNLOAD_HELP,
    BACKEND_HELP,
    DEVICE_HELP,
    NO_CHAT_HELP,
    int_at_least,
    rule_name,
    tree_shape,
)
from .progress import PrefillProgress, Streamer, watch_prefill

DRAFTERS = ("auto", "model", "lookup", "lookup+model")
LOOKUP_PROBE = "step latency of the target for prompt lookup (measured on the first run, then cached)"
NO_DRAFT = "none"  # --draft none: decode with the target alone

EXAMPLES = """examples:
  blockspec generate "Write a Python function that reverses a string."
  blockspec generate --rule token --max-draft 8 --temperature 0 "def fib(n):"
  blockspec generate --target smollm2-135m --draft none --max-new-tokens 32 "Hello"
  blockspec generate --tree 2,1,1 --temperature 0 "def fib(n):"   # a tree of 6 drafted tokens per step
  blockspec generate --paths 3 --max-draft 4 "def fib(n):"   # 3 paths of 4 drafted tokens per step
  blockspec sv profile && blockspec sv calibrate    # once per models and machine, then:
  blockspec generate --policy sv --max-draft 8 "first prompt" "second prompt"   # Speculative Verification
  blockspec models          # bundled presets: installed or not, cache state
  blockspec env             # versions, threads and device, for bug reports
"""


@dataclass(frozen=True)
class GenerateConfig:
    prompts: tuple[str, ...]
    target: str
    draft: str | None  # None: no draft model (the target alone, or prompt lookup alone)
    draft_given: bool  # False: the default draft, dropped with a note where its vocabulary is not the target's
    rule: str
    max_draft: int | None  # None: the policy's default
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    seed: int | None
    dtype: str
    device: str
    chat: bool
    stop: tuple[str, ...]
    policy: str = "auto"
    drafter: str = "auto"  # one of DRAFTERS; auto: lookup+model under --policy auto with a chain, else model
    draft_quant: str = "auto"  # "auto", "none" or one of QUANTS
    target_quant: str = "none"
    companion: str | None = None  # None: SV's default on the backend (sv.resolve_companion)
    sv_predictor: str = "draft"
    sv_profile: Path | None = None
    latency: Path | None = None
    allow_download: bool = False
    backend: str = "auto"  # "auto" or one of BACKENDS
    # a tree drafted each step, children per node at each depth; None: a chain. Its shape is fixed: it replaces the
    # length policy (auto and fixed both draft it as given), on either backend. "auto" (--policy auto only):
    # each step drafts the chain or tree of at most resolved_max_draft nodes predicted fastest (policy.AdaptiveShape)
    tree: tuple[int, ...] | str | None = None
    # k paths of max_draft tokens drafted each step (None: one chain), drawn as paths_drawn says; as a tree, their
    # length is fixed (resolved_max_draft)
    paths: int | None = None
    paths_drawn: str = defaults.PATHS_DRAWN

    @property
    def resolved_max_draft(self) -> int:
        """--max-draft, or the policy's default: the most a step drafts under auto, the length under fixed and sv
        (and of every path with --paths, whose length does not adapt)."""
        if self.max_draft is not None:
            return self.max_draft
        return defaults.ADAPTIVE_MAX_DRAFT if self.policy == "auto" and self.paths is None else defaults.MAX_DRAFT


def add_parser(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text with speculative decoding, streamed as tokens are accepted",
        description="Generate text with speculative decoding: the output law is exactly the target's, the draft\n"
        "only changes the speed. A model is a preset (`blockspec models`), a GGUF file, a local directory\n"
        "or a cached hub id. Every option is explained in docs/guide/cli.md.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("prompts", nargs="*", help="prompt texts (default: one prompt read from stdin)")
    gen.add_argument(
        "--target", default=defaults.TARGET, help="the model whose distribution is kept (default: %(default)s)"
    )
    gen.add_argument(
        "--draft",
        help=f"the small model that proposes tokens; {NO_DRAFT}: the target alone (default: {defaults.DRAFT}, "
        "left out where its vocabulary is not the target's)",
    )
    gen.add_argument(
        "--rule",
        default=defaults.RULE,
        type=rule_name(),
        metavar="RULE",
        help="verification rule, a name in blockspec.verify.RULES (default: %(default)s)",
    )
    gen.add_argument(
        "--drafter",
        default="auto",
        choices=DRAFTERS,
        help="who proposes tokens: the draft model, prompt lookup, or lookup where a match is expected to beat the "
        "model's draft and the model elsewhere; auto: lookup+model under --policy auto (a chain), the model with "
        "--policy fixed or sv, --tree or --paths (default: %(default)s)",
    )
    gen.add_argument(
        "--policy",
        default="auto",
        choices=["auto", "fixed", "sv"],
        help="draft length: measured best per step, --max-draft every step, or Speculative Verification; with "
        "--tree or --paths, auto and fixed both draft them as given (default: %(default)s)",
    )
    gen.add_argument(
        "--max-draft",
        type=int_at_least(1, defaults.DRAFT_LIMIT),
        help=f"K, tokens drafted per step (fixed), or the most a step drafts; with --paths, the tokens of each path "
        f"(default: {defaults.MAX_DRAFT}; auto without --paths: {defaults.ADAPTIVE_MAX_DRAFT})",
    )
    gen.add_argument(
        "--tree",
        type=tree_or_auto,
        metavar="SHAPE",
        help="draft a tree instead of a chain, the same shape every step: children per node at each depth, e.g. "
        "2,1,1 (two children of the root, then one under each, twice: 6 drafted tokens); at most "
        f"{defaults.DRAFT_LIMIT} nodes; --policy auto and fixed both draft it as given, "
        "--max-draft does not apply; auto: each step the chain or tree of at most --max-draft nodes predicted "
        "fastest from this machine's measured costs and the acceptance so far (default: a chain)",
    )
    gen.add_argument(
        "--paths",
        type=int_at_least(1, defaults.DRAFT_LIMIT),
        metavar="K",
        help="draft K paths of --max-draft tokens each step instead of one chain, verified jointly (the rule's tree "
        f"form on the tree the paths form); at most {defaults.DRAFT_LIMIT} tokens in all; "
        "--policy auto and fixed both draft them as given (default: a chain)",
    )
    gen.add_argument(
        "--paths-drawn",
        default=defaults.PATHS_DRAWN,
        choices=PATH_DRAWINGS,
        help="how --paths are drawn: distinct, their first tokens without replacement, each path then on its own; "
        "iid, independent paths, merged where they agree (fewer tokens to score; at temperature 0 all are the "
        "draft's greedy chain) (default: %(default)s)",
    )
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument(
        "--top-k", type=int_at_least(0), default=0, help="keep the k most likely tokens, 0 = all (default: 0)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, 1 = all (default: 1.0)")
    gen.add_argument("--max-new-tokens", type=int_at_least(1), default=128, help="per prompt (default: %(default)s)")
    gen.add_argument("--seed", type=int, help="random seed; prompt i uses seed + i (default: random)")
    gen.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="auto: the fastest on this machine (default: %(default)s)",
    )
    gen.add_argument(
        "--draft-quant",
        default="auto",
        choices=["auto", "none", *QUANTS, *LLAMACPP_QUANTS],
        help=f"quantize the draft (CPU): same output law; {', '.join(QUANTS)} on transformers, "
        f"{', '.join(LLAMACPP_QUANTS)} on llama.cpp (default: %(default)s)",
    )
    gen.add_argument(
        "--target-quant",
        default="none",
        choices=["none", *QUANTS],
        help="quantize the target (CPU): a different, faster model (default: %(default)s)",
    )
    gen.add_argument("--device", default="cpu", help=f"{DEVICE_HELP} (default: %(default)s)")
    gen.add_argument("--backend", default="auto", choices=["auto", *BACKENDS], help=BACKEND_HELP)
    gen.add_argument("--no-chat", dest="chat", action="store_false", help=NO_CHAT_HELP)
    gen.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop a row after this text (repeatable)"
    )
    sv.add_arguments(gen)
    gen.add_argument("--allow-download", action="store_true", help=ALLOW_DOWNLOAD_HELP)
    gen.set_defaults(run=run)


def run(args) -> int:
    return generate(config_from(args))


def config_from(args) -> GenerateConfig:
    """The ``GenerateConfig`` of parsed ``generate`` arguments (the prompt from stdin if none is given)."""
    given = {f.name for f in fields(GenerateConfig)} - {"prompts", "draft", "draft_given", "stop"}  # flags as fields
    draft = defaults.DRAFT if args.draft is None else args.draft
    return GenerateConfig(
        prompts=tuple(args.prompts) or (sys.stdin.read(),),
        draft=None if draft == NO_DRAFT else draft,
        draft_given=args.draft is not None,
        stop=tuple(args.stop),
        **{name: getattr(args, name) for name in given},
    )


def generate(config: GenerateConfig) -> int:
    from ..checks import check_stop_strings, check_text, row_seeds
    from ..models.base import check_shared_vocabulary, target_vocabulary
    from ..models.chat import encode_prompt
    from ..models.load import load_model, refuse_model_code, resolve_backend, resolve_device
    from ..policy.shapes import AdaptiveShape
    from ..sampling import SamplingParams
    from ..verify import RULES, SAMPLED_RULES

    # Everything that can be checked without a model is checked first: a bad value costs a second, not the minutes
    # a large model takes to load.
    sampling = SamplingParams(config.temperature, config.top_k, config.top_p)
    device = resolve_device(config.device)
    for n, prompt in enumerate(config.prompts):
        check_text(prompt, f"prompt {n}" if len(config.prompts) > 1 else "the prompt")
    check_stop_strings(config.stop)
    row_seeds(config.seed, len(config.prompts))
    for folder in (config.target, config.draft):
        if folder and os.path.isdir(folder):  # a draft with code is refused before the target takes minutes to load
            refuse_model_code(folder)
    if not RULES[config.rule].sampled and not sampling.greedy:
        raise ValueError(f"--rule {config.rule} needs --temperature 0; to sample use one of {', '.join(SAMPLED_RULES)}")
    config = replace(config, drafter=_resolve_drafter(config))
    flag = _refuse_with_shape(config)
    if config.policy == "sv" and config.draft is None:
        raise ValueError(f"--policy sv needs a draft model (--draft {NO_DRAFT} decodes with the target alone)")
    if config.drafter != "model":
        if config.policy == "sv" or config.draft is None:
            raise ValueError(f"--drafter {config.drafter} needs --policy fixed or auto, and no --draft {NO_DRAFT}")
        if config.drafter == "lookup":  # no draft model: the lengths of lookup proposals adapt on their own
            config = replace(config, draft=None, policy="fixed")
    config = replace(config, backend=resolve_backend(config.backend, config.device, config.target, config.draft))
    if flag is not None and config.backend == "llamacpp":
        _refuse_past_llamacpp_sequences(config)
    sv_run = config.policy == "sv"
    quant = draft_quant_on(config.backend, config.draft_quant, sv=sv_run, target_quant=config.target_quant)
    config = replace(config, draft_quant=quant)
    if sv_run:  # the companion SV's profiles were made with: none on llama.cpp
        config = replace(config, companion=sv.resolve_companion(config.companion, config.backend, config.sv_predictor))
    if config.backend == "hf":
        config = _resolve_arithmetic(config, device)
    models, known = {}, None  # known: a cached step latency by which the draft cannot pay, so it is not loaded
    for role, name, quant in (
        ("target", config.target, config.target_quant),
        ("draft", config.draft, config.draft_quant),
    ):
        if name:
            quant = None if quant in ("none", "auto") else quant
            if role == "draft" and flag is None and (known := _cannot_pay_known(config, models["target"], quant)):
                break
            arithmetic = quant or config.dtype
            if config.backend == "llamacpp":
                arithmetic = f"llama.cpp, the GGUF requantized to {quant}" if quant else "llama.cpp, the GGUF as it is"
            _status(f"loading {role} {name} ({arithmetic}, {device})")
            models[role] = load_model(
                name,
                dtype=config.dtype,
                device=config.device,
                quant=quant,
                allow_download=config.allow_download,
                backend=config.backend,
            )
    target, draft = models["target"], models.get("draft")
    if draft is not None:  # before its costs are measured: a draft of another vocabulary is never of use
        try:
            check_shared_vocabulary(target, draft, target_vocabulary(target), "draft")
        except ValueError as error:  # the default draft is left out where the run needs no draft model
            if config.draft_given or config.policy == "sv" or config.tree is not None or config.paths is not None:
                raise ValueError(f"{error}; --draft {NO_DRAFT} decodes with the target alone") from error
            _status(f"the default draft {config.draft} does not share the vocabulary of {config.target}: left out")
            draft = None
    if config.policy == "auto" and (draft is not None or known is not None) and flag is None:
        decoder = _default_decoder(config, target, draft, known)
    else:
        decoder = _decoder(config, target, draft, sampling)
    if decoder.tokenizer is None:
        raise ValueError(f"{config.target} has no tokenizer: the CLI needs one to read and print text")
    ids = [encode_prompt(decoder.tokenizer, p, chat=config.chat) for p in config.prompts]

    # Before the first token the models read the whole prompt, minutes for thousands of tokens on a CPU: say so.
    total = sum(len(i) for i in ids)
    _status(f"prefilling {total} prompt tokens" + (f" ({len(ids)} prompts)" if len(ids) > 1 else ""))
    for role, model in (("target", decoder.target), ("draft", decoder.draft), ("companion", decoder.companion)):
        if model is not None:
            watch_prefill(model, PrefillProgress(role))
    stream = Streamer(decoder.tokenizer) if len(ids) == 1 else None
    result = decoder.generate(
        ids,
        max_new_tokens=config.max_new_tokens,
        sampling=sampling,
        seed=config.seed,
        stop_strings=config.stop,
        on_tokens=stream,
    )
    if stream is not None:
        stream.close()
    else:
        assert result.texts is not None  # the decoder has a tokenizer (checked above)
        for i, text in enumerate(result.texts):
            print(f"--- prompt {i}\n{text}")
    mode = decoder.rule if decoder.draft is not None or decoder.lookup is not None else "target alone"
    tree = decoder.tree
    if isinstance(tree, AdaptiveShape):  # the alpha it learnt decides each step's shape
        alpha = " ".join(f"{a:.2f}" for a in tree.alpha.tolist())
        shape = f"tree auto (up to {decoder.max_draft} nodes; alpha_1..{len(tree.alpha)} {alpha})"
    elif decoder.paths is not None:  # what the engine drafts: at most max_draft nodes (fewer where i.i.d. paths merge)
        assert tree is not None  # the paths' slots, one level per token of a path
        shape = f"{decoder.paths} paths of {len(tree)} ({decoder.paths_drawn}, {decoder.max_draft} nodes)"
    elif tree is not None:  # what the engine drafts: its nodes are the widest step (max_draft)
        shape = f"tree {','.join(map(str, tree))} ({decoder.max_draft} nodes)"
    elif decoder.draft is None and decoder.lookup is not None:  # lookup alone: --drafter lookup, or no K paid
        shape = f"lookup alone, up to {decoder.lookup.max_draft}"
    else:  # the model's K; lookup, where it is beside the model, proposes up to its own limit
        shape = f"{config.policy} K={decoder.policy.max_draft}"
        if decoder.lookup is not None:
            shape += f" or lookup up to {decoder.lookup.max_draft}"
    if decoder.lookup is not None:  # the share of row steps that verified a lookup proposal instead of a draft
        shape += f", prompt lookup in {result.lookup_rate:.0%} of steps"
    rate = result.acceptance_rate  # nan where no step verified a drafted token
    print(
        f"[{mode}, {shape}, {_drafted_per_step(result)} drafted per step] "
        f"{result.new_tokens} tokens in {result.wall_time:.1f} s = {result.tokens_per_second:.2f} tokens/s; "
        f"acceptance length (1 + accepted/steps) {result.block_efficiency:.2f}; "
        + ("nothing drafted" if math.isnan(rate) else f"acceptance rate (accepted/drafted) {rate:.2f}"),
        file=sys.stderr,
    )
    return 0


def _default_decoder(config: GenerateConfig, target, draft, latency=None):
    """``auto.default_decoder``: the draft under ``policy.AdaptiveLength`` over this machine's measured step latency
    (``latency``, where it was known before the draft loaded: then ``draft`` is None), with prompt lookup beside it
    unless ``--drafter model``; where no draft length is expected to beat the target alone, it says so and decodes
    with lookup alone, or the target alone."""
    from ..auto import default_decoder

    batch, lookup = len(config.prompts), config.drafter != "model"
    if latency is None:
        latency = _latency(target, draft, batch)
    if lookup:
        _status(LOOKUP_PROBE)
    decoder = default_decoder(
        target,
        draft,
        batch_size=batch,
        lookup=lookup,
        latency=latency,
        rule=config.rule,
        max_draft=config.resolved_max_draft,
    )
    if decoder.draft is None:
        fallback = "drafting by prompt lookup alone" if lookup else "decoding with the target alone"
        _cannot_pay(latency, batch, fallback, "--policy fixed speculates anyway", config.backend)
    return decoder


def _cannot_pay_known(config: GenerateConfig, target, quant: str | None):
    """The default decoder's draft on llama.cpp (``--policy auto``, a chain), before it loads: its step latency where
    the cache holds it (``auto.cached_latency``) and no length of it pays at this batch size, as ``_default_decoder``
    would find once it had loaded the draft; else None (the draft loads)."""
    from ..auto import adaptive_policy, cached_latency
    from ..models.llamacpp import adapter_name

    if config.backend != "llamacpp" or config.policy != "auto" or config.draft is None:
        return None
    batch = len(config.prompts)
    latency = cached_latency(target, adapter_name(config.draft, quant), batch)
    if latency is None or adaptive_policy(latency, batch, config.resolved_max_draft) is not None:
        return None
    return latency


def _decoder(config: GenerateConfig, target, draft, sampling):
    """Any decoder but the default: a fixed length, SV, a tree (``--tree auto`` over this machine's measured step
    latency) or paths, prompt lookup alone. With neither a draft model nor lookup it decodes with the target alone."""
    from ..auto import lookup_latency
    from ..drafting import PromptLookup
    from ..engine import SpeculativeDecoder

    policy, companion, tree, lookup = None, None, config.tree, None
    if config.policy == "sv":
        policy, companion = sv.build_policy(config, target, sampling)
    if isinstance(tree, str):  # auto: each step's shape chosen from measured costs
        tree = _adaptive_shape(config, target, draft)
        if tree is None:
            draft = None
    if config.drafter != "model":
        _status(LOOKUP_PROBE)
        lookup = PromptLookup(costs=lookup_latency(target, len(config.prompts)))
    return SpeculativeDecoder(
        target,
        draft,
        rule=config.rule,
        max_draft=config.resolved_max_draft,
        policy=policy,
        companion=companion,
        lookup=lookup,
        tree=tree,
        paths=config.paths,
        paths_drawn=config.paths_drawn,
    )


def _resolve_drafter(config: GenerateConfig) -> str:
    """``--drafter auto``: prompt lookup beside the draft model where the policy prices the model's steps (``--policy
    auto``, a chain), so that a proposal is made only where it is expected to beat the model's draft; the model
    alone otherwise (a fixed K, SV, a tree or paths: none combines with lookup, or prices it against the model)."""
    if config.drafter != "auto":
        return config.drafter
    chain = config.tree is None and config.paths is None
    return "lookup+model" if config.policy == "auto" and config.draft is not None and chain else "model"


def _refuse_past_llamacpp_sequences(config: GenerateConfig) -> None:
    """On llama.cpp each prompt and each leaf of its tree beyond the first take one of a context's sequence ids: where
    the prompts times the widest tree's leaves pass them, refused before any model loads (the adapter would refuse
    at the first step, after minutes of loading)."""
    from ..models.llamacpp import MAX_ROWS
    from ..policy.shapes import level_sizes, tree_shapes

    if config.paths is not None:
        leaves = config.paths
    elif config.tree == "auto":  # the widest shape it may choose
        nodes = config.resolved_max_draft
        leaves = max(level_sizes(shape)[-1] for shape in tree_shapes(nodes, nodes))
    else:
        assert isinstance(config.tree, tuple)  # a shape: _refuse_with_shape returned its flag
        leaves = level_sizes(config.tree)[-1]
    if len(config.prompts) * leaves > MAX_ROWS:
        raise ValueError(
            f"on llama.cpp {len(config.prompts)} prompts with {leaves} leaves per tree need "
            f"{len(config.prompts) * leaves} sequence ids, more than the {MAX_ROWS} of a llama.cpp context: pass at "
            f"most {MAX_ROWS // leaves} prompts at once, a tree with fewer leaves, or --backend hf"
        )


def _refuse_with_shape(config: GenerateConfig) -> str | None:
    """What ``--tree`` and ``--paths`` do not combine with, refused before any model loads (the engine refuses the
    same, after); returns the flag given, None for a chain."""
    from ..checks import path_layout, tree_nodes

    if config.paths is None and config.paths_drawn != defaults.PATHS_DRAWN:
        raise ValueError(f"--paths-drawn {config.paths_drawn} says how --paths are drawn: pass --paths too")
    if config.tree is None and config.paths is None:
        return None
    if config.tree is not None and config.paths is not None:
        raise ValueError("--tree and --paths both shape a step's draft: pass one of them")
    flag, what = ("--tree", "the tree") if config.tree is not None else ("--paths", "the paths")
    if config.draft is None:
        raise ValueError(
            f"{flag} needs a draft model, which drafts {what} (--draft {NO_DRAFT} decodes with the target alone)"
        )
    if config.drafter != "model":
        raise ValueError(f"{flag} does not combine with --drafter {config.drafter} yet: the draft model drafts {what}")
    if config.policy == "sv":
        raise ValueError(
            f"{flag} does not combine with --policy sv: {flag} drafts a fixed shape, SV chooses the length of a "
            "chain; --policy auto or fixed both draft it as given"
        )
    if isinstance(config.tree, str):  # auto: the shape adapts, --max-draft bounds its nodes
        if config.policy != "auto":
            raise ValueError(
                f"--tree auto chooses each step's shape from measured costs, as --policy auto a chain's length: it "
                f"needs --policy auto, not {config.policy}; give a shape (--tree 2,1,1) to draft it every step"
            )
        return flag
    if config.tree is not None and config.max_draft is not None:
        raise ValueError(
            f"--max-draft does not apply with --tree: the shape sets what a step drafts "
            f"({','.join(map(str, config.tree))}: {tree_nodes(config.tree)} nodes)"
        )
    if config.paths is not None:  # at most DRAFT_LIMIT nodes
        path_layout(config.paths, config.resolved_max_draft, config.paths_drawn)
    return flag


def _resolve_arithmetic(config: GenerateConfig, device) -> GenerateConfig:
    """``config`` with ``dtype="auto"`` and ``draft_quant="auto"`` replaced by what this machine runs fastest
    (``blockspec.auto``: a probe measured once per machine and cached)."""
    from ..auto import choose_arithmetic

    if config.dtype != "auto" and (config.draft_quant != "auto" or config.draft is None):
        return config
    arithmetic = choose_arithmetic(device)
    _status(f"arithmetic: {arithmetic.reason}")
    return replace(
        config,
        dtype=arithmetic.dtype if config.dtype == "auto" else config.dtype,
        draft_quant=(arithmetic.draft_quant or "none") if config.draft_quant == "auto" else config.draft_quant,
    )


def draft_quant_on(backend: str, draft_quant: str, *, sv: bool = False, target_quant: str = "none") -> str:
    """``--draft-quant`` on the resolved ``backend``, refusing what that backend cannot run (``--target-quant`` too,
    on llama.cpp, where the target runs the GGUF's own types). ``auto`` is q4_0 on llama.cpp (a cheaper draft pays on
    llama.cpp's kernels, docs/results.md); on transformers it stays ``auto`` for the machine's probe
    (``_resolve_arithmetic``), except under SV (``sv``, also what ``blockspec sv profile`` and ``sv calibrate``
    resolve with), where it is ``none``: the draft as loaded, as those commands measure it unless told otherwise,
    with no probe to run before a profile is found."""
    if backend == "hf":
        if draft_quant in LLAMACPP_QUANTS:
            raise ValueError(f"--draft-quant {draft_quant} is llama.cpp's: use --backend llamacpp, or int8 here")
        return "none" if sv and draft_quant == "auto" else draft_quant
    if target_quant != "none":
        raise ValueError(
            f"--target-quant {target_quant} runs on transformers: add --backend hf (on llama.cpp, the default for "
            "presets and GGUF files on a CPU, the target runs the GGUF's own types)"
        )
    if draft_quant not in ("auto", "none", *LLAMACPP_QUANTS):
        raise ValueError(
            f"on llama.cpp --draft-quant is one of {', '.join(('auto', 'none', *LLAMACPP_QUANTS))}; "
            f"{draft_quant} runs on transformers (--backend hf)"
        )
    return LLAMACPP_QUANTS[0] if draft_quant == "auto" else draft_quant


def _latency(target, draft, batch: int):
    """``auto.latency_probe``'s step latency of the two models at this batch size, after saying it is measured."""
    from ..auto import latency_probe

    _status("step latency of these models on this machine (measured on the first run, then cached)")
    return latency_probe(target, draft, batch)


def _cannot_pay(latency, batch: int, instead: str, anyway: str, backend: str) -> None:
    """Says why no draft is expected to beat the target alone, what runs ``instead``, and what speculates ``anyway``
    (and, on transformers, that an int8 target verifies cheaper: llama.cpp runs the GGUF's own types)."""
    step, wider = latency.target(batch, 1), latency.target(batch, 2)
    cheaper = "; --target-quant int8 makes verification cheaper" if backend == "hf" else ""
    _status(
        f"speculation cannot pay here: a target step costs {1e3 * step:.0f} ms and verifying one drafted "
        f"token {1e3 * wider:.0f} ms on this machine, so {instead} ({anyway}{cheaper})"
    )


def _adaptive_shape(config: GenerateConfig, target, draft):
    """``policy.AdaptiveShape`` over this machine's measured step latency (``--tree auto``), or None (after saying
    so) where even its prior acceptance picks no draft, as ``--policy auto`` does for chains."""
    from ..policy.shapes import AdaptiveShape

    batch = len(config.prompts)
    latency = _latency(target, draft, batch)
    shape = AdaptiveShape(latency, max_draft=config.resolved_max_draft)
    if shape.choose(batch):  # at the prior, before any step: the engine starts each call there again
        return shape
    _cannot_pay(latency, batch, "decoding with the target alone", "--tree 2,1,1 drafts a tree anyway", config.backend)
    return None


def tree_or_auto(text: str) -> tuple[int, ...] | str:
    """An argparse type: ``auto``, or a tree shape (``tree_shape``)."""
    return text if text == "auto" else tree_shape(text)


def _drafted_per_step(result) -> str:
    """Mean drafted tokens verified per row and step."""
    return f"{sum(sum(s.verified) for s in result.stats) / max(result.row_steps, 1):.1f}"


def _status(message: str) -> None:
    """What generate is doing, on stderr: stdout carries the generated text alone."""
    print(message, file=sys.stderr, flush=True)
