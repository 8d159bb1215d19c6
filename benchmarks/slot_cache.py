"""HFModel's slot cache at batch: multi-token forwards (sdpa against grouped_sdpa) and prefill (one padded
forward against groups of similar length), each pair side by side in one run.

    python benchmarks/slot_cache.py                                   # the bundled 1.5B target, bf16
    python benchmarks/slot_cache.py --model qwen2.5-coder-0.5b --batch-sizes 64 --contexts 256 --prefill-batch 64

1. Forwards: transformers' sdpa copies every key/value head once per query head it serves (repeat_kv) whenever
   more than one token per row is scored under a mask, which HFModel always passes; grouped_sdpa attends in
   place. For each (batch B, cached context T) the same prefilled cache is timed with both, alternating call by
   call, for n tokens per row (n = 1 takes the same path in both: the control).
2. Prefill: the first --prefill-batch prompts of --dataset (chat template) in one forward padded to the longest,
   against HFModel's default groups of at most PREFILL_TOKENS padded tokens, alternating, --prefill-repeats each.

Prints tables, saves JSON (--out); the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256], help="cached tokens per row")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4], help="tokens per row in one forward")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per cell and attention")
    parser.add_argument("--dataset", default="humaneval", help="prompts for the prefill comparison")
    parser.add_argument("--prefill-batch", type=int, default=16, help="0 skips the prefill comparison")
    parser.add_argument("--prefill-repeats", type=int, default=2)
    parser.add_argument("--out", default="results/slot_cache.json")
    args = parser.parse_args()

    from blockspec.models.attention import GROUPED_SDPA
    from blockspec.models.load import load_model

    model = load_model(args.model, dtype=args.dtype, progress=False)
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads; median seconds")
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "machine": platform.platform(),
        "torch": torch.__version__,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "forwards": forwards(model, {"sdpa": "sdpa", "grouped": GROUPED_SDPA}, args),
    }
    model.model.set_attn_implementation(GROUPED_SDPA)
    if args.prefill_batch:
        result["prefill"] = prefill(model, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


def forwards(model, attentions: dict[str, str], args) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'B':>3} {'T':>5} {'n':>3} {'sdpa':>8} {'grouped':>8} {'ratio':>7}")
    with torch.inference_mode():
        for batch in args.batch_sizes:
            for context in args.contexts:
                model.prefill(torch.randint(model.vocab_size, (batch, context), generator=generator).tolist())
                prefilled = model.lengths.clone()
                for n in args.tokens:
                    step = torch.randint(model.vocab_size, (batch, n), generator=generator)
                    valid = torch.ones_like(step, dtype=torch.bool)
                    times = {name: [] for name in attentions}
                    for repeat in range(1 + args.repeats):  # the first round warms up and is not kept
                        for name, implementation in attentions.items():
                            model.model.set_attn_implementation(implementation)
                            start = time.perf_counter()
                            model.forward(step, valid)
                            if repeat:
                                times[name].append(time.perf_counter() - start)
                            model.rollback(prefilled)
                    median = {name: statistics.median(seconds) for name, seconds in times.items()}
                    rows.append(
                        {
                            "batch": batch,
                            "context": context,
                            "tokens": n,
                            **median,
                            "ratio": median["sdpa"] / median["grouped"],
                        }
                    )
                    print(
                        f"{batch:>3} {context:>5} {n:>3} {median['sdpa']:>8.3f} {median['grouped']:>8.3f} "
                        f"{rows[-1]['ratio']:>6.2f}x",
                        flush=True,
                    )
    return rows


def prefill(model, args) -> dict:
    from blockspec.bench import datasets
    from blockspec.models.chat import encode_prompt

    prompts = [encode_prompt(model.tokenizer, p.text) for p in datasets.load(args.dataset, args.prefill_batch)]
    lengths = [len(p) for p in prompts]
    budgets = {"one forward": max(lengths) * len(prompts), "grouped": model.prefill_tokens}
    times = {name: [] for name in budgets}
    with torch.inference_mode():
        for _ in range(args.prefill_repeats):
            for name, budget in budgets.items():
                model.prefill_tokens = budget
                start = time.perf_counter()
                model.prefill(prompts)
                times[name].append(time.perf_counter() - start)
    model.prefill_tokens = budgets["grouped"]
    median = {name: statistics.median(seconds) for name, seconds in times.items()}
    print(
        f"prefill of {len(prompts)} {args.dataset} prompts ({min(lengths)}-{max(lengths)} tokens, "
        f"{sum(lengths)} in all, {max(lengths) * len(prompts)} padded): one forward {median['one forward']:.1f} s, "
        f"grouped {median['grouped']:.1f} s, {median['one forward'] / median['grouped']:.2f}x",
        flush=True,
    )
    return {
        "dataset": args.dataset,
        "batch": len(prompts),
        "tokens": sum(lengths),
        "padded": budgets["one forward"],
        **median,
        "ratio": median["one forward"] / median["grouped"],
    }


if __name__ == "__main__":
    main()
