"""The draft's catch-up forward on llama.cpp: every position's logits against the last one's alone.

    python benchmarks/catchup_cost.py          # the q4_0 bundled draft, after a 128-token context

Before a step drafts, the draft reads the tokens it has not read yet in one forward and uses the last position's
logits alone (``forward(..., last=True)``). Prints a markdown table: milliseconds of one forward over n tokens,
both ways, interleaved, the median of 9 rounds after a warm-up. No records: the table is the result.
"""

from __future__ import annotations

import statistics
import time

import torch

from blockspec.models.llamacpp import build_info, load_llamacpp

WIDTHS = (1, 2, 4, 8, 16)


def main() -> None:
    draft = load_llamacpp("qwen2.5-coder-0.5b", quant="q4_0")
    generator = torch.Generator().manual_seed(0)
    draft.prefill([torch.randint(1000, (128,), generator=generator).tolist()])
    times: dict[tuple[int, bool], list[float]] = {(n, last): [] for n in WIDTHS for last in (False, True)}
    for round_ in range(10):
        for n, last in times:
            before = draft.lengths.clone()
            tokens = torch.randint(1000, (1, n), generator=generator)
            start = time.perf_counter()
            draft.forward(tokens, torch.ones_like(tokens, dtype=torch.bool), last=last)
            seconds = time.perf_counter() - start
            draft.rollback(before)
            if round_:  # the first round warms up
                times[n, last].append(seconds)
    print(f"llama.cpp: {build_info()}; {torch.get_num_threads()} threads\n")
    print("| n | every position | last alone | ratio |\n|---|---|---|---|")
    for n in WIDTHS:
        every, last = (1000 * statistics.median(times[n, only]) for only in (False, True))
        print(f"| {n} | {every:.1f} | {last:.1f} | {last / every:.2f}x |")


if __name__ == "__main__":
    main()
