"""transformers' assisted generation on a model HFModel has wrapped: stock sdpa (what it runs now, HFModel
switching to grouped_sdpa only during its own forwards) against grouped_sdpa set on the model for good, on the
same models, prompts and seeds, interleaved prompt by prompt after a warm-up each.

    python benchmarks/hf_kernel.py --prompts 3 --max-new-tokens 48 --out benchmarks/results/hf-kernel-avx2.json

Prints a table; the last stdout line is JSON (also saved with --out).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} built-in prompts")
    parser.add_argument("--out", type=Path, default=Path("results/hf_kernel.json"))
    args = parser.parse_args(argv)

    from blockspec import SamplingParams, machine
    from blockspec.bench.executor import hf_generate
    from blockspec.models.attention import GROUPED_SDPA
    from blockspec.models.chat import encode_prompt
    from blockspec.models.load import load_model

    target, draft = load_model(args.target, dtype=args.dtype), load_model(args.draft, dtype=args.dtype)
    prompts = [encode_prompt(target.tokenizer, text) for text in PROMPTS[: args.prompts]]
    sampling = SamplingParams(temperature=args.temperature)

    def assisted(kernel: str, prompt: list[int], new: int) -> dict:
        for model in (target.model, draft.model):
            model.set_attn_implementation(kernel)
        return hf_generate(target, prompt, sampling, new, 0, assistant_model=draft.model)

    kernels = ("sdpa", GROUPED_SDPA)
    for kernel in kernels:  # warm-up
        assisted(kernel, prompts[0], 8)
    runs = {kernel: [] for kernel in kernels}
    for prompt in prompts:
        for kernel in kernels:
            runs[kernel].append(assisted(kernel, prompt, args.max_new_tokens))
    rates = {k: sum(r["new_tokens"] for r in v) / sum(r["wall_time"] for r in v) for k, v in runs.items()}
    for kernel in kernels:
        print(f"{kernel:24s} {rates[kernel]:6.2f} tok/s  x sdpa {rates[kernel] / rates['sdpa']:.3f}")
    summary = {
        "tokens_per_s": rates,
        "new_tokens": {k: [r["new_tokens"] for r in v] for k, v in runs.items()},
        "args": {k: str(v) for k, v in vars(args).items()},
        **machine.facts(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
