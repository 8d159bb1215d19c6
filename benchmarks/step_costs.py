"""Where a decoding step's time goes, live: each model forward timed by (model, tokens per row), the rest of the
step (sampling, verification, bookkeeping) by difference, and what a latency profile predicts for the same
forwards. This is what Speculative Verification's cost model must get right: it prices a step from the profile.

    python benchmarks/step_costs.py --batch-sizes 16 \
        --latency benchmarks/results/sv-profiles/latency-prefix8-interleaved.json

The first --batch-size prompts of --dataset (chat template) are decoded --repeats times by each configuration
(target-only, block verification at each K in --max-draft, and SV with --sv-profile), configurations
alternating, at temperature 1 with the same seeds; the first --skip-steps steps of each run are left out (row
count still full, caches warm).
Per configuration: decode tokens/s from the steps kept, block efficiency, mean seconds per call of each forward
kind, and per step outside the forwards and in all; with --latency, the profile's figures in brackets (its
cells include the processing of the logits, so a whole step is the comparable figure). Prints a table, saves
JSON (--out); the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16])
    parser.add_argument("--max-draft", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration and batch size")
    parser.add_argument("--skip-steps", type=int, default=2, help="first steps of each run left out")
    parser.add_argument("--latency", help="a `blockspec sv profile` JSON to compare the forwards with")
    parser.add_argument(
        "--sv-profile",
        help="with --latency: also SV (draft-only predictor, block rule, up to the "
        "largest --max-draft), from this `blockspec sv calibrate` JSON",
    )
    parser.add_argument("--out", default="results/step_costs.json")
    args = parser.parse_args()

    from blockspec.bench import datasets
    from blockspec.engine import SpeculativeDecoder
    from blockspec.models.chat import encode_prompt
    from blockspec.models.hf import load_model
    from blockspec.policy import SVPolicy
    from blockspec.policy.latency import LatencyProfile
    from blockspec.policy.predictor import Profile
    from blockspec.sampling import SamplingParams

    target = load_model(args.target, dtype=args.dtype, progress=False)
    draft = load_model(args.draft, dtype=args.dtype, progress=False)
    profile = LatencyProfile.load(args.latency) if args.latency else None
    log = _time_forwards({"target": target, "draft": draft})
    decoders = {"target-only": SpeculativeDecoder(target)}
    decoders |= {f"block K={k}": SpeculativeDecoder(target, draft, rule="block", max_draft=k) for k in args.verified}
    if args.sv_profile and profile:
        policy = SVPolicy(
            Profile.load(args.sv_profile),
            profile,
            rule="block",
            max_draft=max(args.verified),
            kind="draft",
            carry_over=True,
        )  # history and offsets carry over from run to run
        decoders["SV draft"] = SpeculativeDecoder(
            target, draft, rule="block", max_draft=max(args.verified), policy=policy
        )
    prompts = [encode_prompt(target.tokenizer, p.text) for p in datasets.load(args.dataset, max(args.batch_sizes))]
    result = {
        "target": args.target,
        "draft": args.draft,
        "dtype": args.dtype,
        "dataset": args.dataset,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.platform(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "latency": args.latency,
        "rows": [],
    }
    for batch in args.batch_sizes:
        steps = defaultdict(list)  # configuration -> (StepStats, its forwards) of the kept steps
        decoders["target-only"].generate(prompts[:batch], max_new_tokens=4, seed=0)  # warm-up at this batch size
        for _ in range(args.repeats):
            for name, decoder in decoders.items():
                log.clear()
                out = decoder.generate(
                    prompts[:batch],
                    max_new_tokens=args.max_new_tokens,
                    seed=0,
                    sampling=SamplingParams(temperature=1.0),
                )
                steps[name] += list(zip(out.stats, _per_step(log)))[args.skip_steps :]
        print(f"B={batch}: seconds per step (forward kinds: model n=tokens per row; profile's figure in brackets)")
        for name, kept in steps.items():
            row = _summary(name, batch, kept, profile)
            result["rows"].append(row)
            forwards = ", ".join(
                f"{kind} {s:.3f}" + (f" [{row['profile'][kind]:.3f}]" if profile else "")
                for kind, s in row["forwards"].items()
            )
            print(
                f"  {name:<12} {row['tokens_per_s']:6.1f} tok/s  BE {row['block_efficiency']:.2f}  step "
                f"{row['step_s']:.3f} [{row['profile_step_s']:.3f}] = {forwards}; outside forwards "
                f"{row['outside_s']:.3f}",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


def _time_forwards(models: dict) -> list[tuple[str, int, float]]:
    """Wrap each model's ``forward`` so every call appends (model name, tokens per row, seconds) to the log."""
    log = []
    for name, model in models.items():

        def timed(tokens, valid, forward=model.forward, name=name):
            start = time.perf_counter()
            logits = forward(tokens, valid)
            log.append((name, tokens.shape[1], time.perf_counter() - start))
            return logits

        model.forward = timed
    return log


def _per_step(log) -> list[list[tuple[str, int, float]]]:
    """The forwards of each step: a step ends with the target's one scoring forward."""
    steps, current = [], []
    for entry in log:
        current.append(entry)
        if entry[0] == "target":
            steps.append(current)
            current = []
    return steps


def _summary(name: str, batch: int, kept: list, profile) -> dict:
    """Seconds per call of each forward kind (a step's first draft forward, a catch-up, apart from the rest)
    against the profile's figure for the same (batch, tokens), calls per step, and the step outside its forwards."""
    calls = defaultdict(list)  # kind -> (seconds, profile's seconds) per call
    predicted = []  # the profile's seconds per step (its cells include the processing of logits)
    for _, forwards in kept:
        predicted.append(0.0)
        for i, (model, tokens, seconds) in enumerate(forwards):
            kind = f"{model} n={tokens}" + (" first" if model == "draft" and i == 0 else "")
            figure = getattr(profile, model)(batch, tokens) if profile else math.nan
            calls[kind].append((seconds, figure))
            predicted[-1] += figure
    step_s = statistics.fmean(stats.total_s for stats, _ in kept)
    row_steps = sum(len(stats.rows) for stats, _ in kept)
    return {
        "config": name,
        "batch": batch,
        "steps": len(kept),
        "step_s": step_s,
        "tokens_per_s": sum(sum(stats.emitted) for stats, _ in kept) / sum(stats.total_s for stats, _ in kept),
        "block_efficiency": 1 + sum(sum(stats.accepted) for stats, _ in kept) / row_steps,
        "forwards": {kind: statistics.fmean(s for s, _ in c) for kind, c in calls.items()},
        "profile": {kind: statistics.fmean(p for _, p in c) for kind, c in calls.items() if profile},
        "calls_per_step": {kind: len(c) / len(kept) for kind, c in calls.items()},
        "outside_s": step_s - sum(s for c in calls.values() for s, _ in c) / len(kept),
        "profile_step_s": statistics.fmean(predicted),
        "draft_stage_s": statistics.fmean(stats.draft_s for stats, _ in kept),
        "target_stage_s": statistics.fmean(stats.target_s for stats, _ in kept),
        "verify_s": statistics.fmean(stats.verify_s for stats, _ in kept),
    }


if __name__ == "__main__":
    main()
