"""The ``blockspec`` command: thin subcommands that parse, build a config and call the library.

Heavy imports (torch, transformers) happen inside the subcommands, so ``blockspec --help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from .. import defaults
from ..bench.records import CONFIGS, KNOWN_CONFIGS
from ..defaults import DTYPES, QUANTS
from . import sv as sv_cli

DRAFTERS = ("model", "lookup", "lookup+model")

EXAMPLES = """examples:
  blockspec generate "Write a Python function that reverses a string."
  blockspec generate --verifier token --max-draft 8 --temperature 0 "def fib(n):"
  blockspec generate --target smollm2-135m --verifier none --max-new-tokens 32 "Hello"
  blockspec sv profile && blockspec sv calibrate    # once per models and machine, then:
  blockspec generate --policy sv --max-draft 8 "first prompt" "second prompt"   # Speculative Verification
  blockspec models          # bundled presets: installed or not, cache state
  blockspec env             # versions, threads and device, for bug reports
"""

EXIT_STATUS = """exit status:
  0    done
  2    bad input: an argument, path, device, model or profile that cannot be used (the message says which)
  1    an unexpected error, likely a bug: please report it with `blockspec env` and the `--debug` traceback
  130  interrupted (Ctrl-C)
"""


@dataclass(frozen=True)
class GenerateConfig:
    prompts: tuple[str, ...]
    target: str
    draft: str | None
    verifier: str
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
    drafter: str = "model"  # one of DRAFTERS
    draft_quant: str = "auto"  # "auto", "none" or one of QUANTS
    target_quant: str = "none"
    companion: str | None = None
    sv_predictor: str = "draft"
    sv_profile: Path | None = None
    latency: Path | None = None
    allow_download: bool = False


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; any error ends as one line on stderr and an exit status (see EXIT_STATUS), or, with
    --debug, as the usual traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("\nblockspec: interrupted", file=sys.stderr)  # starts a new line: a streamed text may be half printed
        return 130
    except Exception as error:
        if args.debug:
            raise
        expected = _is_user_error(error)
        message = " ".join(str(error).split())  # library and transformers messages may span lines
        if not expected or not message:
            message = f"{type(error).__name__}: {message}" if message else type(error).__name__
        print(f"blockspec: error: {message} (run with --debug for the traceback)", file=sys.stderr)
        return 2 if expected else 1


def _is_user_error(error: Exception) -> bool:
    """Errors that mean "this input cannot be used" (exit 2) rather than a bug (exit 1): bad values, missing or
    unreadable files and models (transformers reports those as OSError), missing packages, unusable presets."""
    from ..models.presets import PresetError  # stdlib only: cheap, and only on the error path

    return isinstance(error, (ValueError, OSError, ImportError, PresetError))


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors in one line (the usage of `generate` alone is a screen long), and --debug
    accepted after any subcommand too, where a user adds it after reading the error's hint."""

    def __init__(self, *args, top: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        # A subcommand's --debug defaults to SUPPRESS so that it never overwrites the top-level value.
        self.add_argument(
            "--debug",
            action="store_true",
            default=False if top else argparse.SUPPRESS,
            help="on an error, show the traceback instead of a one-line message",
        )

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="blockspec",
        description="Lossless speculative decoding with token and block verification.",
        epilog=EXAMPLES + "\n" + EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        top=True,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (model loading, cache)")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate text with speculative decoding, streamed as tokens are accepted",
        description="Generate text with speculative decoding. The output law is exactly the target's: the "
        "draft only changes the speed. Models: a bundled preset name (see `blockspec models`), a GGUF file, "
        "a local directory or a hub id already in the local Hugging Face cache (see --allow-download).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("prompts", nargs="*", help="prompt texts (default: read one prompt from stdin)")
    gen.add_argument(
        "--target", default=defaults.TARGET, help="the model whose distribution is kept (default: %(default)s)"
    )
    gen.add_argument(
        "--draft", default=defaults.DRAFT, help="the small model that proposes tokens (default: %(default)s)"
    )
    gen.add_argument(
        "--verifier",
        default="block",
        choices=["block", "token", "greedy", "none"],
        help="verification rule; 'none' decodes with the target alone (default: %(default)s)",
    )
    gen.add_argument(
        "--drafter",
        default="model",
        choices=DRAFTERS,
        help="who proposes tokens: the draft model; prompt lookup (the tokens that followed the last "
        "earlier occurrence of the context's last 1-3 tokens, no forward: pays when the answer repeats "
        "the prompt, as in code editing); or lookup where it matches and the model elsewhere (its "
        "lengths set by --policy auto or fixed). Lookup proposals adapt their own length "
        "(default: %(default)s)",
    )
    sv_cli.renamed_flag(
        gen,
        "--draft-len",
        gen.add_argument(
            "--max-draft",
            type=sv_cli.int_at_least(1),
            default=None,
            help=f"tokens drafted per step, K, with --policy fixed (default: {defaults.MAX_DRAFT}); the most a step "
            f"drafts with --policy auto (default: {defaults.ADAPTIVE_MAX_DRAFT}) or sv (default: {defaults.MAX_DRAFT})",
        ),
    )
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default: %(default)s)")
    gen.add_argument(
        "--top-k", type=sv_cli.int_at_least(0), default=0, help="keep the k most likely tokens, 0 = all (default: 0)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, 1 = all (default: 1.0)")
    gen.add_argument("--max-new-tokens", type=sv_cli.int_at_least(1), default=128, help="(default: %(default)s)")
    gen.add_argument("--seed", type=int, default=None, help="random seed; prompt i uses seed + i (default: random)")
    gen.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="weights and activations; auto: what a probe measured fastest on this machine (cached; "
        "`blockspec env` shows it) (default: %(default)s)",
    )
    gen.add_argument(
        "--draft-quant",
        default="auto",
        choices=["auto", "none", *QUANTS],
        help="quantize the draft's linear layers (CPU): a cheaper draft forward, the same output law; "
        "auto: int8 where the probe measured it faster (not with --policy sv, whose profiles are "
        "measured unquantized) (default: %(default)s)",
    )
    gen.add_argument(
        "--target-quant",
        default="none",
        choices=["none", *QUANTS],
        help="quantize the target too (CPU): a different, faster model, whose law is then the one kept; "
        "compare against --verifier none with the same flag (default: %(default)s)",
    )
    gen.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    gen.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        help="send the raw prompt instead of wrapping it in the model's chat template",
    )
    gen.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop a row after this text (repeatable)"
    )
    gen.add_argument(
        "--policy",
        default="auto",
        choices=["auto", "fixed", "sv"],
        help="auto: each step drafts the length with the most expected tokens per second, from this "
        "machine's measured step latency (measured once, cached) and the acceptance seen so far, or "
        "decodes with the target alone where speculation cannot pay; "
        "fixed: draft and verify --max-draft tokens every step; sv: Speculative Verification, "
        "verify per row only the drafted tokens predicted to pay for their cost, at most --max-draft "
        "(needs `blockspec sv profile` and `blockspec sv calibrate` first) (default: %(default)s)",
    )
    sv_cli.add_arguments(gen)
    gen.add_argument("--allow-download", action="store_true", help=sv_cli.ALLOW_DOWNLOAD_HELP)
    gen.set_defaults(run=run_generate)

    bench = sub.add_parser(
        "bench",
        help="compare target-only, token and block verification, Speculative Verification and "
        "transformers' assisted generation, at one or more batch sizes",
        description="Decode the same prompts with the same seeds through every configuration (interleaved, "
        "warm-up excluded), write one JSONL record per prompt (or batch) and configuration, then the report: block "
        "efficiency (1 + mean accepted per step) of token and block verification with bootstrap intervals, "
        "the paired analytic gain, tokens/s and speedups, and plots; with batch sizes above 1, SV "
        "configurations, or only one of token and block (e.g. at temperature 0, where they coincide), also a "
        "batch table (tokens/s of every configuration per batch size, speedups over target-only and over the "
        "best fixed K, rejected fraction of verified tokens, verified tokens per "
        "emitted token) and a tokens/s vs batch size plot. At batch size B a run decodes B consecutive prompts "
        "of a dataset together; hf-assisted runs at batch size 1 only. Resumable: records already written are "
        "skipped, so an interrupted or time-boxed run continues where it stopped.",
        epilog="examples:\n  blockspec bench                        # the quick preset\n"
        "  blockspec bench --preset paper --time-budget 3600   # run again to resume\n"
        "  blockspec bench --datasets gsm8k --max-draft 2 4 --prompts 5 --out results/mine\n"
        "  blockspec sv profile && blockspec sv calibrate      # once, then the SV grid (hours; resumable):\n"
        "  blockspec bench --preset sv --out results/bench-sv",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--preset",
        default="quick",
        choices=["quick", "paper", "sv", "align"],
        help="quick: 3 datasets, a few prompts, K in {4, 8}, T=1; paper: the full token-vs-block grid; "
        "sv: target-only, token, block (K in {2, 4, 8}) and SV at batch sizes 1 to 64; align: the "
        "alignment sweep of `blockspec align` (default: quick)",
    )
    bench.add_argument("--target", help="target model (default: the preset's, the bundled 1.5B)")
    bench.add_argument("--draft", help="draft model (default: the preset's, the bundled 0.5B)")
    bench.add_argument("--datasets", nargs="+", help="prompt sets (see blockspec.bench.datasets.DATASETS)")
    bench.add_argument("--prompts", type=sv_cli.int_at_least(1), dest="prompts_per_dataset", help="prompts per dataset")
    sv_cli.renamed_flag(
        bench,
        "--draft-lens",
        bench.add_argument(
            "--max-draft",
            type=sv_cli.int_at_least(1),
            nargs="+",
            dest="max_drafts",
            help="draft lengths K to compare (the most a step drafts for auto, lookup+model and SV: the largest)",
        ),
    )
    bench.add_argument("--temperatures", type=float, nargs="+", help="sampling temperatures (0 = greedy)")
    bench.add_argument(
        "--draft-temperatures",
        type=float,
        nargs="+",
        help="the draft's own sampling temperatures T_d, each run by token, block and block-int8 at "
        "batch size 1 (the alignment sweep; see `blockspec align`) (default: the preset's; align: "
        f"{' '.join(f'{t:g}' for t in defaults.ALIGN['draft_temperatures'])}; others: none, the draft "
        "samples at the target's temperature)",
    )
    bench.add_argument(
        "--configs",
        nargs="+",
        choices=KNOWN_CONFIGS,
        metavar="CONFIG",
        help="configurations to run, any of " + ", ".join(KNOWN_CONFIGS) + "; token, block and "
        "block-int8 (the draft quantized to int8) at each K; auto: what `generate` runs by default; "
        "lookup: prompt lookup alone; lookup+model: lookup, else auto's draft; hf-assisted / "
        "hf-lookup: transformers' assisted generation / prompt lookup; sv-token / sv-block: "
        "Speculative Verification with the companion predictor (token / block rule), sv-draft: with "
        "the draft-only predictor (block rule); auto, lookup+model and SV draft at most "
        "max(--max-draft) tokens (default: the preset's; quick and paper: " + " ".join(CONFIGS) + ")",
    )
    bench.add_argument(
        "--batch-sizes",
        type=sv_cli.int_at_least(1),
        nargs="+",
        help="prompts decoded together per run, e.g. 1 4 16 32 64 (default: the preset's; quick: 1)",
    )
    bench.add_argument(
        "--companion",
        help="SV companion: prefix:K (the target's first K layers) or a model sharing "
        "the target's tokenizer (default: the same as `blockspec sv`)",
    )
    bench.add_argument(
        "--sv-profile",
        type=Path,
        help="SV calibration profile (default: the one `blockspec sv "
        "calibrate` saved for these models and each temperature)",
    )
    bench.add_argument(
        "--latency",
        type=Path,
        help="SV latency profile (default: the one `blockspec sv profile` saved for these models, dtype and device)",
    )
    bench.add_argument("--max-new-tokens", type=sv_cli.int_at_least(1), help="new tokens per prompt")
    bench.add_argument(
        "--time-budget", type=sv_cli.positive_float, help="seconds; stop scheduling runs after this (resume later)"
    )
    bench.add_argument(
        "--precision",
        type=sv_cli.positive_float,
        help="stop the batch-1 runs once the paired analytic block-vs-token gain is known to +- this "
        "(paper: 0.01); batched runs go on",
    )
    bench.add_argument("--seed", type=int, help="base seed: prompt i of a set uses seed + i in every configuration")
    bench.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        help="auto: what a probe measured fastest on this machine, as for generate (default: auto)",
    )
    bench.add_argument(
        "--target-quant",
        choices=QUANTS,
        help="quantize the target (CPU); every configuration, target-only included, decodes it",
    )
    bench.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    bench.add_argument("--out", type=Path, help="output directory for records, report and plots")
    # default None, not False: only the flags given override the preset
    bench.add_argument("--allow-download", action="store_true", default=None, help=sv_cli.ALLOW_DOWNLOAD_HELP)
    bench.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        default=None,
        help="send the raw prompts instead of wrapping them in the model's chat template",
    )
    bench.add_argument(
        "--retry-failed",
        action="store_true",
        default=None,
        help="rerun the runs a previous call recorded as failed (default: keep their failure records)",
    )
    bench.set_defaults(run=run_bench)

    align = sub.add_parser(
        "align",
        help="alignment sweep: block-vs-token gain against draft-target overlap, the draft sampling at "
        "several temperatures of its own",
        description="How does the gain of block over token verification depend on draft quality? The draft samples "
        "at its own temperature T_d (still lossless: verification sees the distribution the draft actually sampled "
        "from, so T_d only changes how well the draft matches the target) while the target keeps --temperature. "
        "For every prompt and T_d, one block-verification run (same seed at every T_d) records per step the exact "
        "expected accepted length of that same draft under the token and the block rule, and the draft-target "
        "overlap sum_v min(draft, target) at the verified positions. Measured and reported per T_d, pooled over "
        "datasets and per dataset: mean overlap, analytic block efficiency of each rule (1 + mean expected "
        "accepted per step) and the paired analytic gain (BE block / BE token - 1) with a bootstrap interval over "
        'prompts; a table (alignment.md), a JSON summary (the last stdout line, under "alignment") and a plot of '
        "gain vs overlap (alignment_gain_vs_overlap.png). No wall clock is measured. This is `blockspec bench "
        "--preset align`: resumable (records already written are skipped; round n runs prompt n of every dataset "
        "at every T_d, so a time-boxed run covers every T_d), failed runs recorded and listed. Defaults: the align "
        "preset's (blockspec.bench.runner.PRESETS).",
        epilog="examples:\n  blockspec align --time-budget 1200      # bundled pair, 3 datasets x 5 T_d\n"
        "  blockspec align --draft-temperatures 0.5 1 2 --prompts 8 --out results/align-8   # run again to resume\n"
        "  python -m blockspec.bench.report --records results/align/records.jsonl --out results/align  # re-report",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # default None: only the flags given override the align preset
    align.add_argument("--target", help="the model whose distribution is kept (default: the bundled 1.5B)")
    align.add_argument("--draft", help="the small model that proposes tokens (default: the bundled 0.5B)")
    align.add_argument(
        "--datasets", nargs="+", help="prompt sets (see blockspec.bench.datasets.DATASETS) (default: the bench's)"
    )
    align.add_argument(
        "--prompts",
        type=sv_cli.int_at_least(1),
        dest="prompts_per_dataset",
        help=f"prompts per dataset (default: {defaults.ALIGN['prompts_per_dataset']})",
    )
    align.add_argument(
        "--draft-temperatures",
        type=float,
        nargs="+",
        help="the draft's own sampling temperatures T_d; 0 = its argmax (default: "
        f"{' '.join(f'{t:g}' for t in defaults.ALIGN['draft_temperatures'])})",
    )
    align.add_argument(
        "--temperature", type=float, help="the target's sampling temperature, > 0 (default: the bench's)"
    )
    sv_cli.renamed_flag(
        align,
        "--draft-len",
        align.add_argument(
            "--max-draft",
            type=sv_cli.int_at_least(1),
            help=f"tokens drafted per step, K (default: {defaults.ALIGN['max_drafts'][0]})",
        ),
    )
    align.add_argument(
        "--max-new-tokens", type=sv_cli.int_at_least(1), help="new tokens per prompt (default: the bench's)"
    )
    align.add_argument(
        "--seed", type=int, help="base seed: prompt n of a set uses seed + n at every T_d (default: the bench's)"
    )
    align.add_argument("--dtype", choices=DTYPES, help=f"(default: {defaults.ALIGN['dtype']})")
    align.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: the bench's)")
    align.add_argument(
        "--no-chat",
        dest="chat",
        action="store_false",
        default=None,
        help="send the raw prompts instead of wrapping them in the model's chat template",
    )
    align.add_argument("--allow-download", action="store_true", default=None, help=sv_cli.ALLOW_DOWNLOAD_HELP)
    align.add_argument(
        "--time-budget", type=sv_cli.positive_float, help="seconds; stop scheduling runs after this (resume later)"
    )
    align.add_argument(
        "--out",
        type=Path,
        help=f"output directory for records, tables, summary and plot (default: {defaults.ALIGN['out']})",
    )
    align.set_defaults(run=run_bench, preset="align")

    models = sub.add_parser("models", help="list the bundled model presets, installed or not, and their cache state")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")
    models.add_argument(
        "--verify",
        action="store_true",
        help="hash every cached file (each GGUF and converted copy) in full and report any mismatch; "
        "slow: it reads every cached byte (a load checks sizes and fingerprints only)",
    )
    models.set_defaults(run=run_models)

    sv_cli.add_parsers(sub)

    env = sub.add_parser(
        "env",
        help="versions, threads, device, CPU flags and the arithmetic chosen for this machine, "
        "to paste into a bug report",
    )
    env.add_argument("--json", action="store_true", help="print JSON instead of lines")
    env.set_defaults(run=run_env)
    return parser


def run_generate(args) -> int:
    prompts = tuple(args.prompts) or (sys.stdin.read(),)
    config = GenerateConfig(
        prompts=prompts,
        target=args.target,
        draft=None if args.verifier == "none" or args.drafter == "lookup" else args.draft,
        drafter=args.drafter,
        verifier=args.verifier,
        max_draft=args.max_draft,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        chat=args.chat,
        stop=tuple(args.stop),
        policy=args.policy,
        companion=args.companion,
        sv_predictor=args.sv_predictor,
        sv_profile=args.sv_profile,
        latency=args.latency,
        allow_download=args.allow_download,
        draft_quant=args.draft_quant,
        target_quant=args.target_quant,
    )
    return generate(config)


def generate(config: GenerateConfig) -> int:
    from ..engine import SpeculativeDecoder
    from ..lookup import PromptLookup
    from ..models.chat import encode_prompt
    from ..models.hf import load_model, resolve_device
    from ..sampling import SamplingParams

    # Everything that can be checked without a model is checked first: a bad value costs a second, not the minutes
    # a large model takes to load.
    sampling = SamplingParams(config.temperature, config.top_k, config.top_p)
    device = resolve_device(config.device)
    if config.policy == "sv" and config.verifier == "none":
        raise ValueError("--policy sv needs a draft: use --verifier token, block or greedy")
    if config.drafter != "model":
        if config.policy == "sv" or config.verifier == "none":
            raise ValueError(f"--drafter {config.drafter} needs --policy fixed or auto and a verifier other than none")
        if config.drafter == "lookup":  # no draft model: the lengths of lookup proposals adapt on their own
            config = replace(config, policy="fixed")
    if config.max_draft is None:  # the most a step drafts under auto; the length itself under fixed and sv
        most = defaults.ADAPTIVE_MAX_DRAFT if config.policy == "auto" else defaults.MAX_DRAFT
        config = replace(config, max_draft=most)
    config = _resolve_arithmetic(config, device)
    models = {}
    for role, name, quant in (
        ("target", config.target, config.target_quant),
        ("draft", config.draft, config.draft_quant),
    ):
        if name:
            quant = None if quant == "none" else quant
            _status(f"loading {role} {name} ({quant or config.dtype}, {device})")
            models[role] = load_model(
                name, dtype=config.dtype, device=config.device, quant=quant, allow_download=config.allow_download
            )
    target, draft = models["target"], models.get("draft")
    policy, companion, verifier = None, None, config.verifier
    if config.policy == "sv":
        policy, companion = sv_cli.build_policy(config, target, sampling)
    elif config.policy == "auto" and draft is not None:
        policy = _adaptive_policy(config, target, draft)
        if policy is None:
            draft, verifier = None, verifier if config.drafter == "lookup+model" else "none"
    lookup = PromptLookup() if config.drafter != "model" else None
    decoder = SpeculativeDecoder(
        target, draft, verifier=verifier, max_draft=config.max_draft, policy=policy, companion=companion, lookup=lookup
    )
    if decoder.tokenizer is None:
        raise ValueError(f"{config.target} has no tokenizer: the CLI needs one to read and print text")
    ids = [encode_prompt(decoder.tokenizer, p, chat=config.chat) for p in config.prompts]

    # Before the first token the models read the whole prompt, minutes for thousands of tokens on a CPU: say so.
    total = sum(len(i) for i in ids)
    _status(f"prefilling {total} prompt tokens" + (f" ({len(ids)} prompts)" if len(ids) > 1 else ""))
    for role, model in (("target", target), ("draft", draft), ("companion", companion)):
        if model is not None:
            watch_prefill(model, PrefillProgress(role))
    stream = _Streamer(decoder.tokenizer) if len(ids) == 1 else None
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
        for i, text in enumerate(result.texts):
            print(f"--- prompt {i}\n{text}")
    print(
        f"[{verifier}, {config.policy} K={decoder.max_draft}, {_drafted_per_step(result)} drafted per step] "
        f"{result.new_tokens} tokens in "
        f"{result.wall_time:.1f} s = "
        f"{result.tokens_per_second:.2f} tokens/s; acceptance length (1 + accepted/steps) "
        f"{result.block_efficiency:.2f}; acceptance rate (accepted/drafted) {result.acceptance_rate:.2f}",
        file=sys.stderr,
    )
    return 0


def _resolve_arithmetic(config: GenerateConfig, device) -> GenerateConfig:
    """``config`` with ``dtype="auto"`` and ``draft_quant="auto"`` replaced by what this machine runs fastest
    (``blockspec.auto``: a probe measured once per machine and cached)."""
    from ..auto import choose_arithmetic

    if config.dtype != "auto" and (config.draft_quant != "auto" or config.draft is None):
        return config
    arithmetic = choose_arithmetic(device)
    _status(f"arithmetic: {arithmetic.reason}")
    # SV's latency and calibration profiles are measured on the unquantized draft
    quant = arithmetic.draft_quant if config.policy != "sv" else None
    return replace(
        config,
        dtype=arithmetic.dtype if config.dtype == "auto" else config.dtype,
        draft_quant=(quant or "none") if config.draft_quant == "auto" else config.draft_quant,
    )


def _adaptive_policy(config: GenerateConfig, target, draft):
    """``policy.AdaptiveLength`` over this machine's measured step latency, or None (after saying so) where no
    draft length is expected to beat the target alone."""
    from ..auto import adaptive_policy, latency_probe

    batch = len(config.prompts)
    _status("step latency of these models on this machine (measured on the first run, then cached)")
    latency = latency_probe(target, draft, batch)
    policy = adaptive_policy(latency, batch, config.max_draft)
    if policy is None:
        step, wider = latency.target(batch, 1), latency.target(batch, 2)
        _status(
            f"speculation cannot pay here: a target step costs {1e3 * step:.0f} ms and verifying one drafted "
            f"token {1e3 * wider:.0f} ms on this machine, so "
            + (
                "drafting by prompt lookup alone"
                if config.drafter == "lookup+model"
                else "decoding with the target alone"
            )
            + " (--policy fixed speculates anyway; --target-quant int8 makes verification cheaper)"
        )
        return None
    return policy


def _drafted_per_step(result) -> str:
    """Mean drafted tokens verified per row and step."""
    return f"{sum(sum(s.verified) for s in result.stats) / max(result.row_steps, 1):.1f}"


def _status(message: str) -> None:
    """What generate is doing, on stderr: stdout carries the generated text alone."""
    print(message, file=sys.stderr, flush=True)


LONG_PROMPT = 512  # tokens: prefill progress is shown for prompts this long even when stderr is not a terminal


class PrefillProgress:
    """Prefill progress of one model, on stderr: rewritten in place on a terminal; elsewhere (a pipe, a log file)
    one line per tenth of the prompt, and only for prompts of at least LONG_PROMPT tokens, so that short runs,
    pipes and tests stay clean."""

    def __init__(self, label: str, stream=None):
        self.label, self.stream = label, stream
        self.shown = -1  # the last tenth printed (not on a terminal)

    def __call__(self, done_tokens: int, total_tokens: int) -> None:
        stream = self.stream or sys.stderr
        terminal = stream.isatty()
        if not terminal and total_tokens < LONG_PROMPT:
            return
        line = f"prefilling {self.label}: {done_tokens}/{total_tokens} tokens ({100 * done_tokens // total_tokens}%)"
        if terminal:
            stream.write("\r" + line + ("\n" if done_tokens >= total_tokens else ""))
        else:
            tenth = 10 * done_tokens // max(total_tokens, 1)
            if tenth == self.shown:
                return
            self.shown = tenth
            stream.write(line + "\n")
        stream.flush()


def watch_prefill(model, progress: PrefillProgress) -> None:
    """Route ``model``'s prefill progress to ``progress``, for models that report it (HFModel's ``on_prefill``,
    called after each prefill forward as on_prefill(done_tokens, total_tokens)); other models prefill silently."""
    if hasattr(model, "on_prefill"):
        model.on_prefill = progress


class _Streamer:
    """Prints a single row's text as its tokens are accepted (decoding the whole row keeps multi-byte
    characters split across tokens intact)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.shown = tokenizer, [], ""

    def __call__(self, row: int, tokens: list[int]) -> None:
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next tokens
            return
        sys.stdout.write(text[len(self.shown) :])
        sys.stdout.flush()
        self.shown = text

    def close(self) -> None:
        sys.stdout.write("\n")


# `blockspec align` takes one target temperature and one K: the BenchConfig fields its flags set
ALIGN_FIELDS = {"temperature": "temperatures", "max_draft": "max_drafts"}


def bench_config(args):
    """The BenchConfig `blockspec bench` (or `align`) runs: the preset's, with every flag given in its place."""
    from dataclasses import fields

    from ..bench import runner

    preset = runner.PRESETS[args.preset]
    given = {ALIGN_FIELDS.get(name, name): value for name, value in vars(args).items() if value is not None}
    overrides = {}
    for field in fields(preset):
        if field.name in given:
            value = given[field.name]
            if isinstance(getattr(preset, field.name), tuple):  # the lists (one value for align's single flags)
                value = tuple(value) if isinstance(value, list) else (value,)
            overrides[field.name] = value
    return replace(preset, **overrides)


def run_bench(args) -> int:
    from ..bench import report, runner
    from ..models.hf import resolve_device
    from ..sampling import SamplingParams

    config = bench_config(args)
    for temperature in (*config.temperatures, *config.draft_temperatures):  # refused here, not after the models load
        SamplingParams(temperature=temperature)
    resolve_device(config.device)
    records_file = runner.run(config)
    return report.main(["--records", str(records_file), "--out", str(config.out)])


def run_models(args) -> int:
    from ..models import presets

    rows = presets.status_all()
    # one message per file that differs, naming it and the fix
    problems = {s.name: presets.verify(s.name, progress=sys.stderr.isatty()) for s in rows} if args.verify else {}
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": s.name,
                        "role": s.role,
                        "installed": s.installed,
                        "missing": list(s.missing),
                        "cache_state": s.cache_state,
                        "converted": list(s.converted),
                        "cache_dir": str(s.cache_dir),
                        **({"mismatches": problems[s.name]} if args.verify else {}),
                    }
                    for s in rows
                ],
                indent=1,
            )
        )
        return _verified(problems, rows)
    print(f"{'preset':<22} {'role':<7} {'installed':<10} {'cache':<10} cache directory")
    for s in rows:
        cache = s.cache_state + (f" ({', '.join(s.converted)})" if s.converted else "")
        print(f"{s.name:<22} {s.role:<7} {'yes' if s.installed else 'no':<10} {cache:<10} {s.cache_dir}")
    if not all(s.installed for s in rows):
        print(f"install the missing ones with: {presets.INSTALL_HINT}")
    for problem in (p for found in problems.values() for p in found):
        print(f"mismatch: {problem}")
    return _verified(problems, rows)


def _verified(problems: dict[str, list[str]], rows) -> int:
    """0, or, when `models --verify` found cached files that differ, the usual one-line error (exit 2)."""
    count = sum(len(found) for found in problems.values())
    if count:
        raise ValueError(f"{count} cached file(s) differ from what was recorded: see the mismatch lines")
    if problems:
        cached = [s.name for s in rows if s.cache_state != "empty"]
        print(
            f"verified: the cached files of {', '.join(cached)} match their recorded sha256"
            if cached
            else "verified: nothing is cached yet",
            file=sys.stderr,
        )
    return 0


def run_env(args) -> int:
    import importlib.metadata
    import os

    import torch

    from .. import __version__, machine
    from ..auto import choose_arithmetic, native_bf16

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    info = {
        "blockspec": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": " ".join(machine.cpu_flags()) or "none of avx2, avx512*, amx*",
        "native_bf16": native_bf16(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        **{package: version(package) for package in ("transformers", "accelerate", "gguf", "safetensors")},
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", ""),
    }
    arithmetic = choose_arithmetic("cuda" if torch.cuda.is_available() else "cpu")  # probes once per machine
    info |= {
        "auto_dtype": arithmetic.dtype,
        "auto_draft_quant": arithmetic.draft_quant or "none",
        "auto_reason": arithmetic.reason,
    }
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
