"""How far a model's next-token laws move with the shape of the forward that computes them.

    python benchmarks/shape_drift.py --model qwen2.5-coder-1.5b --backend llamacpp
    python benchmarks/shape_drift.py --model qwen2.5-coder-1.5b --backend hf --dtype float32

The target alone decodes one token per row per forward. Verification scores a drafted block in one wider forward,
and a batch puts several rows in each forward. Speculative decoding is lossless relative to the distributions the
verifier is handed (docs/algorithms.md). So where a wider forward gives other laws than a one-token forward, a
speculative decoder's output law differs from the target alone's by as much, whatever the rule.

Each window is --steps consecutive positions of a prompt (the bench's prompts, teacher-forced). They are scored
three ways after the same prefill: one token per forward, the row alone (the reference); all --steps tokens in one
forward ("wide"); one token per forward beside --rows - 1 other prompts' rows ("batched"). Each position gets the
total variation distance between the reference law and the other at temperature 1, the largest |logit
difference|, and whether the argmax differs. Run it alone on the machine. Prints a summary; the last stdout line is
the JSON also saved to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import UTC, datetime
from pathlib import Path

import torch

from blockspec import machine
from blockspec.bench import datasets
from blockspec.models.load import load_model


def scored(model, rows: list[list[int]], start: int, steps: int, width: int) -> torch.Tensor:
    """Row 0's logits [steps, V] after rows[0][: start + 1], ..., rows[0][: start + steps]: every row prefilled with
    its first ``start`` tokens, then fed its next ``steps`` tokens ``width`` per forward, all rows in each forward."""
    model.prefill([row[:start] for row in rows])
    out = []
    for at in range(start, start + steps, width):
        tokens = torch.tensor([row[at : min(at + width, start + steps)] for row in rows])
        out.append(model.forward(tokens, torch.ones_like(tokens, dtype=torch.bool))[0])
    return torch.cat(out).double()


def compare(reference: torch.Tensor, other: torch.Tensor) -> list[dict]:
    """Per position: total variation between the two laws at temperature 1, max |logit difference|, argmax moved."""
    tv = 0.5 * (reference.softmax(-1) - other.softmax(-1)).abs().sum(-1)
    logit = (reference - other).abs().max(-1).values
    moved = reference.argmax(-1) != other.argmax(-1)
    return [{"tv": float(a), "max_logit": float(b), "argmax_moved": bool(c)} for a, b, c in zip(tv, logit, moved)]


def summary(rows: list[dict]) -> dict:
    def quantile(key, q):
        values = sorted(r[key] for r in rows)
        return values[min(len(values) - 1, int(q * len(values)))]

    return {
        "positions": len(rows),
        "tv_median": quantile("tv", 0.5),
        "tv_p90": quantile("tv", 0.9),
        "tv_max": quantile("tv", 1.0),
        "max_logit_median": quantile("max_logit", 0.5),
        "max_logit_max": quantile("max_logit", 1.0),
        "argmax_moved": sum(r["argmax_moved"] for r in rows),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a preset, or a GGUF file")
    parser.add_argument("--backend", default="llamacpp", choices=["llamacpp", "hf"])
    parser.add_argument("--dtype", default="bfloat16", help="hf backend only")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "pydoc-qa"])
    parser.add_argument("--prompts", type=int, default=4, help="per dataset")
    parser.add_argument("--tokens", type=int, default=160, help="each prompt cut to this many (shorter: left out)")
    parser.add_argument("--steps", type=int, default=5, help="positions per window: a K = 4 verification forward")
    parser.add_argument("--stride", type=int, default=25, help="tokens between windows' starts")
    parser.add_argument("--first", type=int, default=20, help="the first window's start")
    parser.add_argument("--rows", type=int, default=4, help="rows per forward in the batched way")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/shape_drift.json"))
    args = parser.parse_args(argv)

    model = load_model(args.model, backend=args.backend, dtype=args.dtype)
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer to encode the prompts with")
    texts = [p.text for name in args.datasets for p in datasets.load(name, n=args.prompts, seed=args.seed)]
    prompts = [ids[: args.tokens] for ids in (tokenizer.encode(t) for t in texts) if len(ids) >= args.tokens]
    if len(prompts) < args.rows:
        raise SystemExit(f"{len(prompts)} prompts have {args.tokens} tokens; --rows {args.rows} needs as many")
    ways: dict[str, list[dict]] = {"wide": [], "batched": []}
    for i, prompt in enumerate(prompts):
        neighbours = [prompts[(i + j) % len(prompts)] for j in range(1, args.rows)]
        for start in range(args.first, args.tokens - args.steps + 1, args.stride):
            reference = scored(model, [prompt], start, args.steps, 1)
            ways["wide"] += compare(reference, scored(model, [prompt], start, args.steps, args.steps))
            ways["batched"] += compare(reference, scored(model, [prompt, *neighbours], start, args.steps, 1))
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    results = {way: summary(rows) for way, rows in ways.items()}
    header = f"{'TV median':>9} {'p90':>9} {'max':>9} | {'max |dlogit|':>12} | argmax moved"
    print(f"{'way':>8} | {'positions':>9} | {header}")
    for way, s in results.items():
        print(
            f"{way:>8} | {s['positions']:>9} | {s['tv_median']:>9.2e} {s['tv_p90']:>9.2e} {s['tv_max']:>9.2e} | "
            f"{s['max_logit_max']:>12.3g} | {s['argmax_moved']}"
        )
    record = {
        "benchmark": "shape_drift",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "machine": {"platform": platform.platform(), **machine.facts()},
        "summary": results,
        "positions": ways,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record))
    print(json.dumps({k: v for k, v in record.items() if k != "positions"}))


if __name__ == "__main__":
    main()
