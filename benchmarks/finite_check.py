"""What the per-step check for NaN or inf logits costs on the bundled pair, against the step it guards.

    python benchmarks/finite_check.py --batch-sizes 1 64 --out benchmarks/results/measurements/finite-check.json

Every sampled step the engine checks the target's distributions [B, K+1, V] and, at each of the K drafted positions,
the draft's [B, V] (``blockspec.sampling.check_softmax``: one entry per row of softmax's output, since non-finite
logits turn their whole row NaN; a greedy step reads its argmax's own logit instead). Here, per batch size:
the target's real verification forward ([pending + K drafted] tokens per row, over a prompt of --context
tokens) is timed, then the check on the distributions of the real (bfloat16) logits it returned, repeated; the
added time per step is the target's check plus K draft-sized checks. Run it alone: other CPU-heavy processes
distort every figure (their CPU time is recorded). The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from blockspec import machine
from blockspec.models.load import load_model
from blockspec.sampling import SamplingParams, check_softmax, process


def median_seconds(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(target, batch: int, width: int, context: int, repeats: int) -> dict:
    prompt = torch.randint(1000, 20000, (context,), generator=torch.Generator().manual_seed(batch)).tolist()
    target.prefill([prompt] * batch)
    tokens = torch.randint(1000, 20000, (batch, width + 1))
    valid = torch.ones_like(tokens, dtype=torch.bool)
    start = time.perf_counter()
    logits = target.forward(tokens, valid)  # [B, K+1, V]
    forward_s = time.perf_counter() - start
    probs = process(logits, SamplingParams(temperature=1.0))  # a sampled step's
    target_check = median_seconds(lambda: check_softmax(probs, logits, 1.0), repeats)
    draft_probs, draft_logits = probs[:, 0], logits[:, 0]  # [B, V]: one drafted position's have this shape
    draft_check = median_seconds(lambda: check_softmax(draft_probs, draft_logits, 1.0), repeats)
    added = target_check + width * draft_check
    return {
        "batch": batch,
        "width": width,
        "vocab": int(logits.shape[-1]),
        "target_forward_s": forward_s,
        "target_check_s": target_check,
        "draft_check_s": draft_check,
        "added_per_step_s": added,
        "added_share_of_target_forward": added / forward_s,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    target = load_model(args.target, dtype=args.dtype)
    clock = machine.cpu_clock()
    rows = [measure(target, b, args.width, args.context, args.repeats) for b in args.batch_sizes]
    result = {
        "command": " ".join(["python benchmarks/finite_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "target": args.target,
        "dtype": args.dtype,
        "context": args.context,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **machine.facts(),
        **machine.others_load(clock, machine.cpu_clock()),
        "rows": rows,
    }
    print(f"{'B':>4} {'target fwd s':>12} {'target check ms':>16} {'draft check ms':>15} {'added / fwd':>12}")
    for r in rows:
        print(
            f"{r['batch']:>4} {r['target_forward_s']:>12.3f} {1e3 * r['target_check_s']:>16.3f} "
            f"{1e3 * r['draft_check_s']:>15.3f} {100 * r['added_share_of_target_forward']:>11.2f}%"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
