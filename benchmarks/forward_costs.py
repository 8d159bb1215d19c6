"""Forward cost by arithmetic: each model variant (dtype, int8 quantization) timed at batch 1 for n new tokens
over a prefilled cache, variants taking turns call by call so the machine's drift is shared by all.

    python benchmarks/forward_costs.py --out benchmarks/results/forward-costs-avx2.json
    python benchmarks/forward_costs.py --variants qwen2.5-coder-0.5b:bfloat16 qwen2.5-coder-0.5b:bfloat16:int8

A variant is MODEL:DTYPE[:QUANT]. A cell is what a decoding step pays for one forward: ``forward`` of n tokens
after --context cached tokens and the processing of its logits (``sv.latency.step_seconds``: every position's
for n > 1, as verification does; the last one, sampled, for n = 1, as drafting does). Median of --repeats after
one warm-up round. The CPU flags, threads and other processes' CPU time are recorded: run it alone. Prints a
table; the last stdout line is the JSON also saved to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import UTC, datetime
from pathlib import Path

import torch

DEFAULT_VARIANTS = [
    "qwen2.5-coder-1.5b:bfloat16",
    "qwen2.5-coder-1.5b:float32",
    "qwen2.5-coder-1.5b:bfloat16:int8",
    "qwen2.5-coder-0.5b:bfloat16",
    "qwen2.5-coder-0.5b:float32",
    "qwen2.5-coder-0.5b:bfloat16:int8",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, help="MODEL:DTYPE[:QUANT]")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5, 9], help="new tokens per forward")
    parser.add_argument("--context", type=int, default=128, help="cached tokens before each forward")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="results/forward_costs.json")
    args = parser.parse_args()

    import provenance

    from blockspec import machine
    from blockspec.auto import step_seconds
    from blockspec.models.load import load_model

    models = {}
    for variant in args.variants:
        name, dtype, *quant = variant.split(":")
        models[variant] = load_model(name, dtype=dtype, quant=quant[0] if quant else None, progress=False)
    generator = torch.Generator().manual_seed(0)
    vocab = min(m.vocab_size for m in models.values())
    prompt = torch.randint(vocab, (1, args.context), generator=generator).tolist()
    steps = {n: torch.randint(vocab, (1, n), generator=generator) for n in args.tokens}
    for model in models.values():
        model.prefill(prompt)
    times = {(v, n): [] for v in models for n in args.tokens}
    start = machine.cpu_clock()
    with torch.inference_mode():
        for _ in range(1 + args.repeats):  # round 0 warms up and is dropped below
            for n, step in steps.items():
                for variant, model in models.items():
                    times[variant, n].append(step_seconds(model, step, last_only=n == 1))
    load = machine.others_load(start, machine.cpu_clock())
    ms = {v: {n: round(1e3 * statistics.median(times[v, n][1:]), 2) for n in args.tokens} for v in models}

    print(f"{'variant':44s}" + "".join(f"{f'n={n}':>10s}" for n in args.tokens))
    for variant, row in ms.items():
        print(f"{variant:44s}" + "".join(f"{row[n]:10.1f}" for n in args.tokens))
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": provenance.commit(),
        "command": "python benchmarks/forward_costs.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
        ),
        **machine.facts(),
        **load,
        "context": args.context,
        "repeats": args.repeats,
        "ms": ms,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
