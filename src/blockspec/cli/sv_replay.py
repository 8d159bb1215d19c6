"""``blockspec sv replay``: length policies evaluated offline on a recording (``sv calibrate --recording``)."""

from __future__ import annotations

import json
from pathlib import Path

from ..defaults import SV_BATCH_SIZES
from ..files import write_atomic
from .common import int_at_least, rule_name


def add_parser(sv_sub) -> None:
    replay = sv_sub.add_parser(
        "replay",
        help="evaluate length policies offline on a recording against a latency profile",
        description="Regroup recorded steps into batches and compare target-only, fixed K, SV and a hindsight "
        "oracle in predicted tokens per second. Use a recording of prompts the profile was not calibrated on.",
    )
    replay.add_argument("--recording", type=Path, required=True, help="recorded positions (`sv calibrate --recording`)")
    replay.add_argument("--sv-profile", type=Path, required=True, help="calibration profile")
    replay.add_argument("--latency", type=Path, required=True, help="latency profile")
    replay.add_argument(
        "--batch-sizes", type=int_at_least(1), nargs="+", default=list(SV_BATCH_SIZES), help="(default: %(default)s)"
    )
    replay.add_argument(
        "--rules",
        type=rule_name(sampled=True),
        nargs="+",
        metavar="RULE",
        help="rules to replay (default: every one of blockspec.verify.SAMPLED_RULES)",
    )
    replay.add_argument(
        "--steps", type=int_at_least(1), default=300, help="replayed steps per batch size (default: %(default)s)"
    )
    replay.add_argument("--out", type=Path, help="also write the results as JSON, and a plot beside it (.png)")
    replay.set_defaults(run=run)


def run(args) -> int:
    from ..bench.calibrate import Recording
    from ..bench.replay import replay
    from ..policy.latency import LatencyProfile
    from ..policy.predictor import Profile
    from ..verify import SAMPLED_RULES

    recording, profile = Recording.load(args.recording), Profile.load(args.sv_profile)
    latency = LatencyProfile.load(args.latency)
    rows = []
    for rule in args.rules or SAMPLED_RULES:
        for batch in args.batch_sizes:
            outcomes = replay(recording, profile, latency, batch=batch, rule=rule, steps=args.steps)
            base = outcomes["target-only"].goodput
            for name, o in outcomes.items():
                rows.append(
                    {
                        "rule": rule,
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
            f"{r['rule']:<6} {r['batch']:>3} {r['policy']:<13} {r['tokens_per_s']:8.2f} {r['speedup']:8.3f}x "
            f"{r['verified_per_emitted']:17.3f} {r['drafted_per_emitted']:16.3f}"
        )
    if args.out:
        write_atomic(args.out, json.dumps(rows, indent=1) + "\n")
        plot(rows, args.out.with_suffix(".png"))
    print(json.dumps({"replay": [{k: r[k] for k in ("rule", "batch", "policy", "speedup")} for r in rows]}))
    return 0


def plot(rows: list[dict], path: Path) -> None:
    """Predicted speedup over target-only against batch size, per policy, one panel per rule."""
    from ..bench.report import new_figure

    rules = sorted({r["rule"] for r in rows})
    figure, axes = new_figure(len(rules), "replay: predicted speedup over target-only")
    for ax, rule in zip(axes, rules):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            points = sorted((r["batch"], r["speedup"]) for r in rows if (r["rule"], r["policy"]) == (rule, policy))
            style = {"ls": "--", "color": "black"} if policy == "oracle" else {}
            ax.plot(*zip(*points), marker="o", label=policy, **style)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xscale="log", title=f"{rule} rule", xlabel="batch size", ylabel="speedup over target-only")
        ax.legend(fontsize=8)
    figure.savefig(path, dpi=110)
