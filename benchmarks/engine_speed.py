"""End-to-end speed on a real pair at batch 1: target-only, token and block verification for several draft
lengths, and transformers' own assisted generation, on the same models, prompts and sampling.

    python benchmarks/engine_speed.py                                   # bundled Qwen2.5-Coder 1.5B/0.5B, bf16
    python benchmarks/engine_speed.py --temperatures 1 --max-draft 4 --max-new-tokens 32 --prompts 2
    python benchmarks/engine_speed.py --int8 --max-draft 2 4   # also the int8 draft and the default policy

Configurations are interleaved prompt by prompt (A B C ... A B C ...), after one warm-up generation each,
so machine drift affects all of them alike. Prints a table, saves JSON (--out); the last stdout line is JSON.
Block efficiency = 1 + mean accepted per step (tokens per target forward).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation.",
    "Explain the difference between a list and a tuple in Python, with a short example.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Implement binary search in JavaScript and explain its time complexity.",
    "Write a bash script that counts the lines of every .py file in a directory tree.",
    "What does the `yield` keyword do in Python? Give an example of a generator.",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-draft", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompts", type=int, default=4, help=f"how many of the {len(PROMPTS)} built-in prompts")
    parser.add_argument(
        "--no-assisted", dest="assisted", action="store_false", help="skip transformers' assisted generation"
    )
    parser.add_argument(
        "--int8",
        action="store_true",
        help="also each K with the draft quantized to int8, and the "
        "default policy (AdaptiveLength over this machine's cached step latency, int8 draft)",
    )
    parser.add_argument("--out", type=Path, default=Path("results/engine_speed.json"))
    args = parser.parse_args(argv)

    from blockspec import SamplingParams, SpeculativeDecoder, machine
    from blockspec.auto import latency_probe
    from blockspec.models.chat import encode_prompt
    from blockspec.models.hf import load_model
    from blockspec.policy import AdaptiveLength

    target = load_model(args.target, dtype=args.dtype)
    drafts = {"": load_model(args.draft, dtype=args.dtype)}
    if args.int8:
        drafts[" int8"] = load_model(args.draft, dtype=args.dtype, quant="int8")
    prompts = [encode_prompt(target.tokenizer, text) for text in PROMPTS[: args.prompts]]
    configs = (
        [("target-only", "none", 0, None)]
        + [
            (f"{verifier} K={k}{label}", verifier, k, draft)
            for label, draft in drafts.items()
            for verifier in ("token", "block")
            for k in args.max_draft
        ]
        + ([("hf-assisted", "assisted", 0, drafts[""])] if args.assisted else [])
    )
    if args.int8:
        configs.append(("auto", "auto", max(args.max_draft), drafts[" int8"]))

    records = []
    for temperature in args.temperatures:
        sampling = SamplingParams(temperature=temperature)
        runners = {
            name: make_runner(
                kind,
                k,
                target,
                draft,
                sampling,
                args.max_new_tokens,
                SpeculativeDecoder,
                lambda: AdaptiveLength(latency_probe(target, drafts[" int8"], 1), max_draft=8),
            )
            for name, kind, k, draft in configs
        }
        for run in runners.values():  # warm-up, excluded
            run(prompts[0][:16], seed=0)
        for p, prompt in enumerate(prompts):
            for name, *_ in configs:
                record = runners[name](prompt, seed=1000 + p)
                records.append({"temperature": temperature, "config": name, "prompt": p, **record})
                print(
                    f"T={temperature:g} prompt {p} {name:<16} {record['new_tokens']:>4} tokens "
                    f"{record['wall_time']:7.2f} s  BE {record['block_efficiency'] or float('nan'):.2f}",
                    file=sys.stderr,
                    flush=True,
                )

    summary = summarize(records, configs, args.temperatures)
    result = {
        "benchmark": "engine_speed",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), **machine.facts()},
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "models": {"target": args.target, "draft": args.draft, "dtype": args.dtype},
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts),
        "summary": summary,
        "records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(summary)
    print(json.dumps({"benchmark": "engine_speed", "summary": summary}))


def make_runner(kind, max_draft, target, draft, sampling, max_new_tokens, decoder_class, adaptive):
    if kind == "assisted":
        from blockspec.bench.runner import run_assisted

        return lambda prompt, seed: {
            **run_assisted(target, draft, prompt, sampling, max_new_tokens, seed),
            "steps": None,
            "block_efficiency": None,
            "forward_time": None,
        }
    if kind == "auto":  # a fresh policy per run: each generate call starts from the prior acceptance

        def run(prompt, seed):
            decoder = decoder_class(target, draft, verifier="block", policy=adaptive())
            return measure(decoder, prompt, seed, sampling, max_new_tokens, kind)

        return run
    decoder = decoder_class(target, None if kind == "none" else draft, verifier=kind, max_draft=max_draft or 4)
    return lambda prompt, seed: measure(decoder, prompt, seed, sampling, max_new_tokens, kind)


def measure(decoder, prompt, seed, sampling, max_new_tokens, kind):
    result = decoder.generate([prompt], max_new_tokens=max_new_tokens, sampling=sampling, seed=seed)
    steps = result.stats
    return {
        "new_tokens": result.new_tokens,
        "wall_time": result.wall_time,
        "steps": len(steps),
        "block_efficiency": result.block_efficiency if kind != "none" else None,
        "forward_time": result.prefill_s + sum(s.forward_s for s in steps),
        "prefill_time": result.prefill_s,
        "draft_time": sum(s.draft_s for s in steps),
        "target_time": sum(s.target_s for s in steps),
        "verify_time": sum(s.verify_s for s in steps),
        "drafted_per_step": sum(sum(s.verified) for s in steps) / max(len(steps), 1),
    }


def summarize(records, configs, temperatures):
    summary = []
    for temperature in temperatures:
        rows = {
            name: [r for r in records if r["temperature"] == temperature and r["config"] == name]
            for name, *_ in configs
        }
        speed = {name: sum(r["new_tokens"] for r in rs) / sum(r["wall_time"] for r in rs) for name, rs in rows.items()}
        for name, rs in rows.items():
            steps = sum(r["steps"] or 0 for r in rs)
            forward = [r["forward_time"] for r in rs if r["forward_time"] is not None]
            summary.append(
                {
                    "temperature": temperature,
                    "config": name,
                    "tokens_per_s": round(speed[name], 3),
                    "speedup_vs_target": round(speed[name] / speed["target-only"], 3),
                    "speedup_vs_assisted": round(speed[name] / speed["hf-assisted"], 3)
                    if "hf-assisted" in speed
                    else None,
                    "block_efficiency": round(sum(r["new_tokens"] for r in rs) / steps, 3) if steps else None,
                    "outside_forward_share": round(1 - sum(forward) / sum(r["wall_time"] for r in rs), 4)
                    if forward
                    else None,
                }
            )
    return summary


def print_table(summary):
    print(
        f"{'T':>3} {'config':<16} {'tokens/s':>9} {'vs target':>9} {'vs assisted':>11} {'BE*':>5} {'outside fwd':>11}"
    )
    for row in summary:
        assisted = f"{row['speedup_vs_assisted']:.2f}x" if row["speedup_vs_assisted"] else "-"
        be = f"{row['block_efficiency']:.2f}" if row["block_efficiency"] else "-"
        outside = f"{100 * row['outside_forward_share']:.1f} %" if row["outside_forward_share"] is not None else "-"
        print(
            f"{row['temperature']:>3g} {row['config']:<16} {row['tokens_per_s']:>9.2f} {row['speedup_vs_target']:>8.2f}x "
            f"{assisted:>11} {be:>5} {outside:>11}"
        )
    print("* BE = emitted tokens per target forward (1 + mean accepted per step; EOS and length cuts included)")


if __name__ == "__main__":
    main()
