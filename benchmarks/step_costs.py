"""What decoding's forwards cost where decoding pays them, beside what the step-latency probe says they cost.

    python benchmarks/step_costs.py --backend llamacpp --dataset humaneval --prompts 6 --configs alone lookup
    python benchmarks/step_costs.py --backend hf --configs alone block:4
    python benchmarks/step_costs.py --dataset pydoc-qa --temperatures 1 --configs alone default --draft-quant q4_0

Prompt lookup and the adaptive policy price a step by a probe (``blockspec.auto``: forwards of each width, timed in
turns on random tokens, cached). Here every ``forward`` of real decoding is timed: each configuration decodes the
first --prompts prompts of --dataset (chat template, batch 1, --max-new-tokens) at each --temperature (seed 0),
configurations taking turns prompt by prompt. Configurations: ``alone`` (the target alone), ``lookup`` (prompt lookup
priced by the cached ``lookup_latency`` probe), ``token:K`` and ``block:K`` (the draft model, K tokens a step),
``default`` (``blockspec.auto.default_decoder``, what ``blockspec generate`` runs: prompt lookup beside the draft
under the adaptive length, whose step costs come from the cached ``latency_probe``; lookup alone where that finds the
draft cannot pay). --draft-quant q4_0 drafts with the draft requantized by llama.cpp, as the default does on llama.cpp.

Before each prompt's turn the probe's method runs once more, uncached (``blockspec.auto.time_forwards`` over
--probe-widths, as ``lookup_latency`` times them), so the probe's ratios over the run sit beside decoding's.

Per configuration: tokens/s over the decoding (prefill left out); per (model, tokens per row) the calls and their
median seconds; per step the seconds outside the forwards (sampling, verification, lookup, bookkeeping); the share
of the decoding spent in draft forwards that read more than 2 tokens (catching up on tokens the draft did not read:
after steps that did not draft with it, or a lookup proposal); and the
target's in-loop cost of each width over its 1-token cost. Then the probes' ratios (lowest, median, highest), and
the cached probe's that ``lookup`` chose by. Run it alone on the machine. Prints a table; the records (one line per
run or probe, every forward's seconds) go to --out as JSON lines, and the last stdout line is the summary's JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from blockspec import machine


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--backend", choices=("llamacpp", "hf"), default="llamacpp")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--draft-quant", choices=("q4_0",), help="the llamacpp backend's draft, requantized")
    parser.add_argument("--dtype", default="bfloat16", help="the hf backend's dtype")
    parser.add_argument("--dataset", default="humaneval")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    parser.add_argument("--configs", nargs="+", default=["alone", "lookup"], type=config_name)
    parser.add_argument("--probe-widths", type=int, nargs="*", default=[1, 2, 3, 4], help="none: no probes")
    parser.add_argument("--out", type=Path, default=Path("results/step_costs.jsonl"))
    args = parser.parse_args()

    from blockspec import PromptLookup, SamplingParams, SpeculativeDecoder
    from blockspec.auto import (
        LATENCY_REPEATS,
        PROBE_CONTEXT,
        default_decoder,
        lookup_latency,
        time_forwards,
    )
    from blockspec.bench import datasets
    from blockspec.models.chat import encode_prompt

    target, draft = load(args.backend, args.target, args.dtype), None
    if any(":" in c or c == "default" for c in args.configs):
        draft = load(args.backend, args.draft, args.dtype, args.draft_quant)
    probe = lookup_latency(target, 1) if {"lookup", "default"} & set(args.configs) else None
    decoders = {}
    for name in args.configs:
        if name == "alone":
            decoders[name] = SpeculativeDecoder(target)
        elif name == "lookup":
            decoders[name] = SpeculativeDecoder(target, lookup=PromptLookup(costs=probe))
        elif name == "default":
            decoders[name] = default_decoder(target, draft)
        else:
            rule, k = name.split(":")
            decoders[name] = SpeculativeDecoder(target, draft, rule=rule, max_draft=int(k))
    log = log_forwards({"target": target} | ({"draft": draft} if draft else {}))
    widths = tuple(sorted(set(args.probe_widths)))
    prompts = [encode_prompt(target.tokenizer, p.text, chat=True) for p in datasets.load(args.dataset, args.prompts)]
    decoders[args.configs[0]].generate(prompts[:1], max_new_tokens=8, seed=0)  # warm-up, not kept
    flags = machine.cpu_flags()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs, probes = [], []
    with args.out.open("w") as out:
        for temperature in args.temperatures:
            for index, ids in enumerate(prompts):
                if widths:  # its forwards reach the log too, which each configuration's run clears first
                    probed = {"target": (target, widths)}
                    table = time_forwards(probed, (1,), PROBE_CONTEXT, LATENCY_REPEATS, progress=False)["target"]
                    run = {"config": "probe", "temperature": temperature, "prompt": index, "seconds": table.seconds[0]}
                    out.write(json.dumps(run | {"widths": widths, "cpu_flags": flags}) + "\n")
                    probes.append(run["seconds"])
                for name, decoder in decoders.items():
                    log.clear()
                    result = decoder.generate(
                        [ids], max_new_tokens=args.max_new_tokens, seed=0, sampling=SamplingParams(temperature)
                    )
                    run = {
                        "config": name,
                        "temperature": temperature,
                        "prompt": index,
                        "tokens": result.new_tokens,
                        "steps": len(result.stats),
                        "decode_s": result.wall_time - result.prefill_s,
                        "forwards": list(log),
                        "backend": args.backend,
                        "cpu_flags": flags,
                        "threads": torch.get_num_threads(),
                        "date": time.strftime("%Y-%m-%d %H:%M"),
                    }
                    out.write(json.dumps(run) + "\n")
                    runs.append(run)
    summary = {
        "cached_probe": None if probe is None else probe_ratios(probe),
        "probes": spread(widths, probes),
        "probe_count": len(probes),
        "rows": summarize(runs),
    }
    print_table(summary, flags)
    print(json.dumps(summary))


def config_name(text: str) -> str:
    """``alone``, ``lookup``, ``default`` or ``token:K`` / ``block:K`` with K >= 1 (argparse's type)."""
    if text in ("alone", "lookup", "default"):
        return text
    rule, _, k = text.partition(":")
    if rule not in ("token", "block") or not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"expected alone, lookup, default, token:K or block:K, got {text!r}")
    return text


def load(backend: str, name: str, dtype: str, quant: str | None = None):
    if backend == "llamacpp":
        from blockspec.models.llamacpp import load_llamacpp

        return load_llamacpp(name, quant=quant, progress=False)
    if quant is not None:
        raise SystemExit("--draft-quant is the llamacpp backend's")
    from blockspec.models.load import load_model

    return load_model(name, dtype=dtype, progress=False)


def log_forwards(models: dict) -> list[tuple[str, int, float]]:
    """Wrap each model's ``forward`` so every call appends (model name, tokens per row, seconds) to the log."""
    log = []
    for name, model in models.items():

        def timed(tokens, valid, *, last=False, forward=model.forward, name=name):
            start = time.perf_counter()
            logits = forward(tokens, valid, last=last)
            log.append((name, tokens.shape[1], time.perf_counter() - start))
            return logits

        model.forward = timed
    return log


def summarize(runs: list[dict]) -> list[dict]:
    """Per (configuration, temperature): tokens/s, the median seconds of each (model, width) call, the target's
    width-w median over its 1-token median, the seconds per step outside the forwards, and the share of the decoding
    in draft forwards over more than 2 tokens (catch-ups)."""
    groups = defaultdict(list)
    for run in runs:
        groups[run["config"], run["temperature"]].append(run)
    rows = []
    for (config, temperature), kept in groups.items():
        calls = defaultdict(list)
        for run in kept:
            for model, width, seconds in run["forwards"]:
                calls[f"{model} {width}"].append(seconds)
        by_width = sorted(calls.items(), key=lambda c: (c[0].split()[0], int(c[0].split()[1])))
        medians = {kind: statistics.median(s) for kind, s in by_width}
        one = medians.get("target 1")
        decode = sum(run["decode_s"] for run in kept)
        steps = sum(run["steps"] for run in kept)
        forwards = sum(sum(s) for s in calls.values())
        catch_up = sum(s for run in kept for model, width, s in run["forwards"] if model == "draft" and width > 2)
        rows.append(
            {
                "config": config,
                "temperature": temperature,
                "tokens_per_s": sum(run["tokens"] for run in kept) / decode,
                "steps": steps,
                "calls": {kind: len(s) for kind, s in calls.items()},
                "median_s": medians,
                "target_ratio": {
                    kind.split()[1]: s / one for kind, s in medians.items() if kind.startswith("target") and one
                },
                "outside_s_per_step": (decode - forwards) / steps,
                "catch_up_share": catch_up / decode,
            }
        )
    return rows


def spread(widths: tuple[int, ...], probes: list[list[float]]) -> dict:
    """Per probed width w > 1: the lowest, median and highest of the probes' cost(w) / cost(1)."""
    ratios = {w: sorted(seconds[i] / seconds[0] for seconds in probes) for i, w in enumerate(widths) if i}
    return {str(w): (r[0], statistics.median(r), r[-1]) for w, r in ratios.items() if r}


def probe_ratios(table) -> dict:
    """The probe's cost of each width over its 1-token cost, at batch 1, and its 1-token seconds."""
    return {"1-token s": table(1, 1), **{str(w): table(1, w) / table(1, 1) for w in table.tokens}}


def print_table(summary: dict, flags: list[str]) -> None:
    print(f"CPU flags: {' '.join(flags) or 'none'}; threads {torch.get_num_threads()}")
    for row in summary["rows"]:
        print(
            f"{row['config']:<9} T={row['temperature']:g}  {row['tokens_per_s']:6.2f} tok/s  {row['steps']} steps, "
            f"outside forwards {1e3 * row['outside_s_per_step']:.2f} ms/step, "
            f"draft catch-ups over 2 tokens {100 * row['catch_up_share']:.1f} % of the decoding"
        )
        for kind, seconds in row["median_s"].items():
            ratio = row["target_ratio"].get(kind.split()[1]) if kind.startswith("target") else None
            shown = f"  in-loop width / 1: {ratio:.2f}" if ratio is not None else ""
            print(f"    {kind:<10} {row['calls'][kind]:5d} calls  median {1e3 * seconds:6.2f} ms{shown}")
    if summary["probes"]:
        print(f"the {summary['probe_count']} probes during the run, width / 1 (lowest, median, highest):")
        for w, (low, middle, high) in summary["probes"].items():
            print(f"    {w:>2}: {low:.2f} {middle:.2f} {high:.2f}")
    cached = summary["cached_probe"]
    if cached:
        ratios = ", ".join(f"{w}: {r:.2f}" for w, r in cached.items() if w != "1-token s" and int(w) <= 16)
        print(f"cached probe lookup chose by: 1 token {1e3 * cached['1-token s']:.1f} ms; width / 1: {ratios}")


if __name__ == "__main__":
    main()
