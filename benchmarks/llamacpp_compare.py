"""What a CPU user gets on the bundled GGUF pair: blockspec on llama.cpp's kernels against llama.cpp itself.

Per prompt, in one interleaved round (batch 1, the same chat-formatted prompt and max new tokens everywhere):
  llamacpp-alone     blockspec's engine, target alone, on the llama.cpp adapter
  llamacpp-token/-block  blockspec, the 0.5B draft, fixed K, token / block verification, on llama.cpp
  llamacpp-auto      blockspec's default: block verification, length adapted to the measured step costs
  llamacpp-lookup    blockspec, prompt lookup alone (no draft model)
  llama.cpp-spec     llama.cpp's own lossless speculative decoding (`llama-speculative-simple`: the draft drafts
                     greedily, the target samples every position and keeps a drafted token only if its own sample
                     equals it), same draft and K, decode time as it reports it
and once per run `llama-bench`'s tg figure for the target (the reference the adapter's target alone is held to).
Figures are tokens/s of the decode (prefill excluded everywhere: llama.cpp's programs report it so), their ratios to
llamacpp-alone of the same prompt, and accepted tokens per step. Records go to --out as JSON lines with the CPU flags.

    bash scripts/build_llamacpp_tools.sh          # once: llama-bench and llama-speculative-simple
    python benchmarks/llamacpp_compare.py --datasets humaneval pydoc-qa --prompts 3 --temperatures 0 1

Run it alone: llama.cpp's threads collapse under load from another process.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
from pathlib import Path

ROWS = ("llamacpp-alone", "llamacpp-token", "llamacpp-block", "llamacpp-auto", "llamacpp-lookup", "llama.cpp-spec")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "pydoc-qa"])
    parser.add_argument("--prompts", type=int, default=2, help="per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--max-draft", type=int, default=4, help="K of the fixed rows and of llama.cpp's")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--tools", type=Path, help="folder of llama-bench and llama-speculative-simple")
    parser.add_argument("--out", type=Path, default=Path("results/llamacpp/records.jsonl"))
    args = parser.parse_args()

    import torch

    from blockspec import PromptLookup, SamplingParams, SpeculativeDecoder
    from blockspec.auto import adaptive_policy, latency_probe
    from blockspec.bench import datasets
    from blockspec.machine import cpu_flags
    from blockspec.models.chat import encode_prompt
    from blockspec.models.llamacpp import load_llamacpp

    tools = args.tools or Path(subprocess.check_output(["bash", "scripts/build_llamacpp_tools.sh"], text=True).strip())
    target, draft = load_llamacpp("qwen2.5-coder-1.5b"), load_llamacpp("qwen2.5-coder-0.5b")
    threads = torch.get_num_threads()
    machine = {"cpu_flags": cpu_flags(), "threads": threads, "date": time.strftime("%Y-%m-%d %H:%M")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.open("a")

    def record(entry: dict) -> None:
        entry.update(machine)
        log.write(json.dumps(entry) + "\n")
        log.flush()
        print(json.dumps({k: v for k, v in entry.items() if k not in machine}), flush=True)

    bench = llama_bench(tools, target.path, threads)
    record({"row": "llama-bench", **bench})
    policy = adaptive_policy(latency_probe(target, draft, 1), 1, 8)
    decoders = {
        "llamacpp-alone": SpeculativeDecoder(target),
        "llamacpp-token": SpeculativeDecoder(target, draft, rule="token", max_draft=args.max_draft),
        "llamacpp-block": SpeculativeDecoder(target, draft, rule="block", max_draft=args.max_draft),
        "llamacpp-auto": SpeculativeDecoder(target, draft if policy else None, max_draft=8, policy=policy),
        "llamacpp-lookup": SpeculativeDecoder(target, lookup=PromptLookup()),
    }
    prompts = [(name, p) for name in args.datasets for p in datasets.load(name, n=args.prompts, seed=0)]
    for temperature in args.temperatures:
        sampling = SamplingParams(temperature=temperature)
        for dataset, prompt in prompts:
            ids = encode_prompt(target.tokenizer, prompt.text, chat=True)
            for row in args.rows:
                base = {"row": row, "dataset": dataset, "prompt": prompt.id, "temperature": temperature}
                if row == "llama.cpp-spec":
                    text = target.tokenizer.decode(ids)
                    record({**base, **speculative_simple(tools, target.path, draft.path, text, args, temperature)})
                    continue
                result = decoders[row].generate([ids], max_new_tokens=args.max_new_tokens, sampling=sampling, seed=0)
                decode_s = result.wall_time - result.prefill_s
                record(
                    {
                        **base,
                        "tokens": result.new_tokens,
                        "tok_s": result.new_tokens / decode_s,
                        "accepted_per_step": result.block_efficiency - 1,
                        "drafted_per_step": sum(sum(s.verified) for s in result.stats) / max(result.row_steps, 1),
                    }
                )
    log.close()
    summarize(args.out)


def llama_bench(tools: Path, model: Path, threads: int) -> dict:
    """llama-bench's token generation (tg64, 3 repetitions) for ``model`` at ``threads``."""
    out = subprocess.run(
        [str(tools / "llama-bench"), "-m", str(model), "-p", "0", "-n", "64", "-r", "3", "-t", str(threads)]
        + ["-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (test,) = json.loads(out)
    return {"tok_s": test["avg_ts"], "tok_s_sd": test["stddev_ts"], "tokens": 64}


def speculative_simple(tools: Path, target: Path, draft: Path, text: str, args, temperature: float) -> dict:
    """One run of llama.cpp's own speculative decoding: the draft drafts up to K tokens greedily (no confidence
    cut-off), the target verifies them with its sampler; its reported decode speed and acceptance."""
    command = [
        str(tools / "llama-speculative-simple"),
        *("-m", str(target), "-md", str(draft), "-p", text, "-n", str(args.max_new_tokens)),
        *("--draft-max", str(args.max_draft), "--draft-min", "0", "--draft-p-min", "0"),
        *("--temp", str(temperature), "--top-k", "0", "--top-p", "1", "--min-p", "0"),  # the target's plain law
        *("--seed", "0", "-c", "4096", "-t", str(_threads()), "--no-warmup"),
    ]
    log = subprocess.run(command, capture_output=True, text=True, check=True, timeout=900).stderr
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    steps = re.search(r"n_predict\s*=\s*(\d+)", log)
    if not (decoded and drafted and accepted and steps):
        raise RuntimeError(f"unexpected llama-speculative-simple output:\n{log[-2000:]}")
    tokens, seconds = int(decoded.group(1)), float(decoded.group(2))
    n_accept = int(accepted.group(1))
    # each step emits its accepted drafts plus one token of the target's own: steps = tokens - accepted
    return {
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "accepted_per_step": n_accept / max(int(steps.group(1)) - n_accept, 1),
        "drafted": int(drafted.group(1)),
        "accepted": n_accept,
    }


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def summarize(path: Path) -> None:
    """Per temperature and row: median tokens/s, median ratio to llamacpp-alone on the same prompt, mean accepted per
    step; and the llama-bench reference."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    bench = [r for r in records if r["row"] == "llama-bench"]
    for r in bench:
        print(f"llama-bench tg64: {r['tok_s']:.2f} +- {r['tok_s_sd']:.2f} tok/s")
    alone = {(r["temperature"], r["prompt"]): r["tok_s"] for r in records if r["row"] == "llamacpp-alone"}
    print(f"{'T':>4} {'row':<16} {'tok/s':>7} {'x alone':>8} {'accepted/step':>14} {'n':>3}")
    for temperature in sorted({r["temperature"] for r in records if "temperature" in r}):
        for row in ROWS:
            runs = [r for r in records if r["row"] == row and r.get("temperature") == temperature]
            if not runs:
                continue
            ratios = [r["tok_s"] / alone[temperature, r["prompt"]] for r in runs if (temperature, r["prompt"]) in alone]
            print(
                f"{temperature:>4} {row:<16} {statistics.median(r['tok_s'] for r in runs):7.2f} "
                f"{statistics.median(ratios) if ratios else float('nan'):8.2f} "
                f"{statistics.mean(r['accepted_per_step'] for r in runs):14.2f} {len(runs):>3}"
            )


if __name__ == "__main__":
    main()
