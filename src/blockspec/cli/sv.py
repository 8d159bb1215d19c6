"""``blockspec sv profile``, ``blockspec sv calibrate`` and the SV options of ``blockspec generate``.

Only argparse at import time: torch and the models load inside the commands, so ``--help`` stays instant.
Profiles live by default in ``sv_dir()`` (``sv/`` in the model cache: ~/.cache/blockspec/sv unless
``BLOCKSPEC_CACHE`` says otherwise), named after the models (and the sampling, for the calibration profile), so
``generate --policy sv`` finds the ones measured for its configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..defaults import COMPANION, DRAFT, DTYPES, SV_BATCH_SIZES, SV_PREDICTOR, TARGET
from ..policy.profiles import latency_path, profile_path, sampling_key, sv_dir  # stdlib only: no torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that name an SV configuration (shared by generate and sv calibrate)."""
    parser.add_argument(
        "--companion",
        default=COMPANION,
        help="companion model sharing the target's tokenizer, or prefix:K for the target's own first K "
        "layers (shared weights, no extra memory) (default: %(default)s)",
    )
    parser.add_argument(
        "--sv-predictor",
        default=SV_PREDICTOR,
        choices=["companion", "draft"],
        help="features that predict acceptance: draft only (no companion forward), or draft and "
        "companion (docs/guide/sv.md says when a companion pays) (default: %(default)s)",
    )
    parser.add_argument(
        "--sv-profile",
        type=Path,
        help="calibration profile (default: the one `blockspec sv calibrate` "
        f"saved for these models and sampling under {sv_dir()})",
    )
    parser.add_argument(
        "--latency",
        type=Path,
        help=f"latency profile (default: the one `blockspec sv profile` saved for these models under {sv_dir()})",
    )


ALLOW_DOWNLOAD_HELP = "let hub ids that are not in the local Hugging Face cache be downloaded (default: never download)"


def int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, refused at parse time (before any model loads)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    return parse


class _Renamed(argparse.Action):
    """An old flag kept for one release: stores its value under the new flag's name, with a warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated: use {self.const}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def renamed_flag(parser: argparse.ArgumentParser, old: str, new: argparse.Action) -> None:
    """Accept ``old`` (hidden from --help) as the flag ``new`` that ``add_argument`` returned."""
    parser.add_argument(
        old,
        action=_Renamed,
        const=new.option_strings[0],
        dest=new.dest,
        type=new.type,
        nargs=new.nargs,
        help=argparse.SUPPRESS,
    )


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (time budgets, precisions)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def add_parsers(sub) -> None:
    sv = sub.add_parser(
        "sv",
        help="Speculative Verification: measure latency, calibrate the acceptance predictor",
        description="Speculative Verification (Kim et al., arXiv 2509.24328) verifies, per row and "
        "step, only the drafted tokens predicted to pay for their cost. It needs two profiles for "
        "your models and machine: `sv profile` (step latency by batch size and tokens verified) and "
        "`sv calibrate` (the acceptance predictor, fitted on prompts disjoint from evaluation sets).",
    )
    sv_sub = sv.add_subparsers(required=True, metavar="SV_COMMAND")

    profile = sv_sub.add_parser(
        "profile",
        help="measure target, draft and companion step latency on this machine",
        description="Time the target's forward over a grid of batch sizes and tokens per row, "
        "the draft's forwards over 1, 2 and 4 tokens (a step's first draft forward catches up) "
        "and the companion's forward, each with the processing of its logits into "
        "probabilities; cells take turns so drift is shared; save the table.",
    )
    _model_arguments(profile)
    profile.add_argument("--companion", default=COMPANION, help="(default: %(default)s); 'none' for no companion")
    profile.add_argument(
        "--batch-sizes", type=int_at_least(1), nargs="+", default=list(SV_BATCH_SIZES), help="(default: %(default)s)"
    )
    profile.add_argument(
        "--tokens",
        type=int_at_least(1),
        nargs="+",
        default=[1, 2, 3, 5, 9],
        help="tokens per row in one forward (default: %(default)s)",
    )
    profile.add_argument(
        "--context",
        type=int_at_least(1),
        default=160,
        help="cached tokens per row while timing; the cost of attention grows with it, so match the "
        "prompts you serve (default: %(default)s, a chat prompt and its answer so far)",
    )
    profile.add_argument(
        "--repeats", type=int_at_least(1), default=3, help="timed forwards per cell, median kept (default: %(default)s)"
    )
    profile.add_argument("--out", type=Path, help=f"output JSON (default: under {sv_dir()})")
    profile.set_defaults(run=run_profile)

    calibrate = sv_sub.add_parser(
        "calibrate",
        help="record drafted positions and fit the acceptance predictors",
        description="Run speculative decoding (all drafted tokens verified) on calibration "
        "prompts, record per-position draft and companion features with the exact gain "
        "each token adds to the expected accepted length, fit draft-only and "
        "draft+companion predictors for both rules, and report held-out log-loss and Brier "
        "score (the companion's information gain) with a calibration plot.",
    )
    _model_arguments(calibrate)
    add_arguments(calibrate)
    calibrate.add_argument(
        "--dataset",
        default="sharegpt",
        help="calibration prompts; keep them disjoint from your evaluation sets (default: %(default)s)",
    )
    calibrate.add_argument("--prompts", type=int_at_least(1), default=24, help="(default: %(default)s)")
    calibrate.add_argument("--max-new-tokens", type=int_at_least(1), default=64, help="(default: %(default)s)")
    renamed_flag(
        calibrate,
        "--draft-len",
        calibrate.add_argument(
            "--max-draft",
            type=int_at_least(1),
            default=8,
            help="K drafted and recorded per step (default: %(default)s)",
        ),
    )
    calibrate.add_argument("--batch-size", type=int_at_least(1), default=4, help="(default: %(default)s)")
    calibrate.add_argument("--temperature", type=float, default=1.0, help="(default: %(default)s)")
    calibrate.add_argument("--top-k", type=int_at_least(0), default=0, help="(default: %(default)s)")
    calibrate.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    calibrate.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    calibrate.add_argument("--out", type=Path, help=f"profile JSON (default: under {sv_dir()})")
    calibrate.add_argument("--recording", type=Path, help="also save the recorded positions (torch file) for replay")
    calibrate.set_defaults(run=run_calibrate)

    replay = sv_sub.add_parser(
        "replay",
        help="evaluate length policies offline on a recording against a latency profile",
        description="Regroup recorded steps (`sv calibrate --recording`) into batches and "
        "compare, in predicted tokens per second: target-only, fixed K, SV with the draft-only "
        "and the companion predictor, and a hindsight oracle that knows the target's decisions. "
        "Use a recording of prompts the profile was not calibrated on.",
    )
    replay.add_argument("--recording", type=Path, required=True, help="recorded positions (torch file)")
    replay.add_argument("--sv-profile", type=Path, required=True, help="calibration profile")
    replay.add_argument("--latency", type=Path, required=True, help="latency profile")
    replay.add_argument(
        "--batch-sizes", type=int_at_least(1), nargs="+", default=list(SV_BATCH_SIZES), help="(default: %(default)s)"
    )
    replay.add_argument("--methods", nargs="+", default=["token", "block"], choices=["token", "block"])
    replay.add_argument(
        "--steps", type=int_at_least(1), default=300, help="replayed steps per batch size (default: %(default)s)"
    )
    replay.add_argument("--out", type=Path, help="also write the results as JSON, and a plot beside it (.png)")
    replay.set_defaults(run=run_replay)


def _model_arguments(parser) -> None:
    parser.add_argument("--target", default=TARGET, help="(default: %(default)s)")
    parser.add_argument("--draft", default=DRAFT, help="(default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="(default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    parser.add_argument("--allow-download", action="store_true", help=ALLOW_DOWNLOAD_HELP)


def build_policy(config, target, sampling):
    """(SVPolicy, companion model or None) for ``blockspec generate --policy sv``: the profiles saved for the
    model names the user typed (a quantized draft keeps its name)."""
    from ..models.companion import load_companion
    from ..policy import SVPolicy

    companion_name = config.companion if config.sv_predictor == "companion" else None
    policy = SVPolicy.from_cache(
        target,
        None,
        sampling=sampling,
        method="token" if config.verifier == "token" else "block",
        max_draft=config.max_draft,
        kind=config.sv_predictor,
        companion=config.companion,
        profile=config.sv_profile,
        latency=config.latency,
        names=(config.target, config.draft),
    )
    companion = (
        load_companion(
            companion_name, target, dtype=config.dtype, device=config.device, allow_download=config.allow_download
        )
        if companion_name
        else None
    )
    return policy, companion


def run_profile(args) -> int:
    from ..auto import measure_profile
    from ..models.companion import load_companion
    from ..models.hf import load_model, resolve_device

    resolve_device(args.device)  # a device torch cannot use is refused before the models load
    target = load_model(args.target, dtype=args.dtype, device=args.device, allow_download=args.allow_download)
    draft = load_model(args.draft, dtype=args.dtype, device=args.device, allow_download=args.allow_download)
    companion_name = None if args.companion == "none" else args.companion
    companion = (
        load_companion(companion_name, target, dtype=args.dtype, device=args.device, allow_download=args.allow_download)
        if companion_name
        else None
    )
    profile = measure_profile(
        target,
        draft,
        companion,
        batch_sizes=tuple(args.batch_sizes),
        tokens=tuple(args.tokens),
        context=args.context,
        repeats=args.repeats,
    )
    # the names the other commands look the profile up by: what the user typed
    profile.meta.update(target=args.target, draft=args.draft, companion=companion_name)
    out = args.out or latency_path(args.target, args.draft, companion_name, args.dtype, str(target.device))
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    for name, table in (("target", profile.target), ("draft", profile.draft), ("companion", profile.companion)):
        if table is not None:
            print(
                f"{name} forward seconds (rows: batch {list(table.batch_sizes)}; columns: tokens per row "
                f"{list(table.tokens)})"
            )
            for batch, row in zip(table.batch_sizes, table.seconds):
                print(f"  B={batch:<3} " + " ".join(f"{s:8.3f}" for s in row))
    print(f"saved {out}")
    return 0


def run_calibrate(args) -> int:
    from ..bench.calibrate import Recorder, fit_profile, record
    from ..bench.datasets import load as load_prompts
    from ..engine import SpeculativeDecoder
    from ..models.chat import encode_prompt
    from ..models.companion import load_companion
    from ..models.hf import load_model, resolve_device
    from ..sampling import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)  # values checked before the models load
    resolve_device(args.device)
    target = load_model(args.target, dtype=args.dtype, device=args.device, allow_download=args.allow_download)
    draft = load_model(args.draft, dtype=args.dtype, device=args.device, allow_download=args.allow_download)
    companion = load_companion(
        args.companion, target, dtype=args.dtype, device=args.device, allow_download=args.allow_download
    )
    decoder = SpeculativeDecoder(
        target, draft, verifier="token", max_draft=args.max_draft, policy=Recorder(args.max_draft), companion=companion
    )
    prompts = load_prompts(args.dataset, args.prompts, seed=args.seed)
    ids = [encode_prompt(decoder.tokenizer, p.text, chat=True) for p in prompts]
    recording = record(
        decoder, ids, sampling=sampling, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed
    )
    if args.recording:
        recording.save(args.recording)
    profile, report = fit_profile(
        recording, target=args.target, draft=args.draft, companion=args.companion, sampling=sampling_key(sampling)
    )
    profile.metrics["calibration_prompts"] = [p.id for p in prompts]
    out = args.out or profile_path(args.target, args.draft, args.companion, sampling_key(sampling))
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    plot = out.with_suffix(".png")
    plot_calibration(report, plot, title=f"{args.target} / {args.draft} / companion {args.companion}")
    print(
        f"{'rule':<6} {'predictor':<10} {'held-out log-loss':>18} {'floor':>7} {'Brier':>8} {'mean pred':>10} "
        f"{'mean gain':>10}"
    )
    for method, kinds in report.items():
        for kind, m in kinds.items():
            print(
                f"{method:<6} {kind:<10} {m['log_loss']:18.4f} {m['entropy_of_labels']:7.4f} {m['brier']:8.4f} "
                f"{m['mean_predicted']:10.3f} {m['mean_label']:10.3f}"
            )
    print(f"saved {out} and {plot}", file=sys.stderr)
    print(
        json.dumps(
            {"profile": str(out), "positions": profile.metrics["positions"], "held_out": profile.metrics["held_out"]}
        )
    )
    return 0


def plot_calibration(report: dict, path: Path, title: str) -> None:
    """Held-out calibration curves: mean exact gain against mean predicted gain, per rule and predictor."""
    from ..bench.report import new_figure

    figure, axes = new_figure(len(report), title)
    for ax, (method, kinds) in zip(axes, report.items()):
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        for kind, m in kinds.items():
            predicted, observed, _ = zip(*m["curve"])
            ax.plot(predicted, observed, marker="o", label=f"{kind} (log-loss {m['log_loss']:.3f})")
        ax.set(
            title=f"{method} rule",
            xlabel="predicted gain",
            ylabel="exact gain (held-out mean)",
            xlim=(0, 1),
            ylim=(0, 1),
        )
        ax.legend()
    figure.savefig(path, dpi=110)


def run_replay(args) -> int:
    from ..bench.calibrate import Recording
    from ..bench.replay import replay
    from ..policy.latency import LatencyProfile
    from ..policy.predictor import Profile

    recording, profile = Recording.load(args.recording), Profile.load(args.sv_profile)
    latency = LatencyProfile.load(args.latency)
    rows = []
    for method in args.methods:
        for batch in args.batch_sizes:
            outcomes = replay(recording, profile, latency, batch=batch, method=method, steps=args.steps)
            base = outcomes["target-only"].goodput
            for name, o in outcomes.items():
                rows.append(
                    {
                        "method": method,
                        "batch": batch,
                        "policy": name,
                        "tokens_per_s": o.goodput,
                        "speedup": o.goodput / base,
                        "verified_per_emitted": o.verified / o.emitted,
                        "drafted_per_emitted": o.drafted / o.emitted,
                    }
                )
    print(
        f"{'rule':<6} {'B':>3} {'policy':<13} {'tok/s':>8} {'vs target':>9} {'verified/emitted':>17} "
        f"{'drafted/emitted':>16}"
    )
    for r in rows:
        print(
            f"{r['method']:<6} {r['batch']:>3} {r['policy']:<13} {r['tokens_per_s']:8.2f} {r['speedup']:8.3f}x "
            f"{r['verified_per_emitted']:17.3f} {r['drafted_per_emitted']:16.3f}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
        plot_replay(rows, args.out.with_suffix(".png"))
    print(json.dumps({"replay": [{k: r[k] for k in ("method", "batch", "policy", "speedup")} for r in rows]}))
    return 0


def plot_replay(rows: list[dict], path: Path) -> None:
    """Predicted speedup over target-only against batch size, per policy, one panel per rule."""
    from ..bench.report import new_figure

    methods = sorted({r["method"] for r in rows})
    figure, axes = new_figure(len(methods), "replay: predicted speedup over target-only")
    for ax, method in zip(axes, methods):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            points = sorted((r["batch"], r["speedup"]) for r in rows if (r["method"], r["policy"]) == (method, policy))
            style = {"ls": "--", "color": "black"} if policy == "oracle" else {}
            ax.plot(*zip(*points), marker="o", label=policy, **style)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", title=f"{method} rule", xlabel="batch size", ylabel="speedup over target-only")
        ax.legend(fontsize=8)
    figure.savefig(path, dpi=110)
