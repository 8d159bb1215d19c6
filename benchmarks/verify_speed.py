"""Micro-benchmark of the verifiers: median wall time per call, block/token ratio, cost of input validation.

    python benchmarks/verify_speed.py                      # the full grid: B {1, 8, 64}, K {4, 8}, V {32000, 151936}
    python benchmarks/verify_speed.py --batch 1 --width 8 --vocab 151936
    python benchmarks/verify_speed.py --tables trees       # tree rows only: shapes of 1 to 16 nodes, B {1, 8}
    python benchmarks/verify_speed.py --device cuda        # on a GPU: inputs, generator and timing there

Inputs are realistic float32 distributions (softmax of scaled Gaussian logits, draft correlated with target)
with every drafted token sampled from the draft (a tree's children without replacement: scheme "distinct").
Each timed call includes drawing its randomness from a torch.Generator, as the engine does. Prints a table per
kind, saves JSON (--out), and the last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from blockspec.verify import RULES, verify_tree_block, verify_tree_token

# Target forward times measured on an AVX-512 machine (Qwen2.5-Coder-1.5B bf16, KV cache 128):
# (B, tokens per row) -> ms. Used only to express verification cost as a share of the matching forward.
TARGET_FORWARD_MS = {(1, 5): 203, (1, 9): 229, (8, 5): 515, (8, 9): 743, (64, 5): 3045, (64, 9): 5208}
TREE_VERIFIERS = {"token": verify_tree_token, "block": verify_tree_block}
# Tree shapes (children per node at each depth, "x"-separated): 1, 2, 4, 8 and 16 nodes; 4x1x1x1 is four drafted
# paths of 4 tokens, 4x3 a wide tree of the same size.
TREE_SHAPES = ["1", "2", "2x1", "2x1x1x1", "4x1x1x1", "4x3"]


def make_inputs(batch: int, width: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    target_logits = 3.0 * torch.randn(batch, width + 1, vocab, generator=gen)
    draft_logits = target_logits[:, :width] + 1.0 * torch.randn(batch, width, vocab, generator=gen)
    target_probs = target_logits.softmax(-1)
    draft_probs = draft_logits.softmax(-1)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).reshape(batch, width)
    return draft_tokens, draft_probs, target_probs


def tree_parents(shape: tuple[int, ...]) -> list[int]:
    """parent(a) for nodes a = 1..N of a tree of ``shape``, numbered level by level (a parent before its children)."""
    parents, level = [], [0]
    for children in shape:
        first = len(parents) + 1
        parents += [parent for parent in level for _ in range(children)]
        level = list(range(first, len(parents) + 1))
    return parents


def make_tree_inputs(batch: int, shape: tuple[int, ...], vocab: int, seed: int = 0):
    """(draft_tokens [B, N], parents [B, N], draft_probs [B, N+1, V], target_probs [B, N+1, V]): one tree of
    ``shape`` per row, every node's children drawn from its draft row without replacement (scheme "distinct")."""
    parents = tree_parents(shape)
    nodes = len(parents)
    gen = torch.Generator().manual_seed(seed)
    target_logits = 3.0 * torch.randn(batch, nodes + 1, vocab, generator=gen)
    draft_probs = (target_logits + 1.0 * torch.randn(batch, nodes + 1, vocab, generator=gen)).softmax(-1)
    target_probs = target_logits.softmax(-1)
    draft_tokens = torch.empty(batch, nodes, dtype=torch.long)
    for parent in sorted(set(parents)):
        children = [child - 1 for child, above in enumerate(parents, start=1) if above == parent]
        draft_tokens[:, children] = torch.multinomial(draft_probs[:, parent], len(children), generator=gen)
    return draft_tokens, torch.tensor(parents).expand(batch, nodes).contiguous(), draft_probs, target_probs


def median_ms(fn, *, min_repeats: int, budget_s: float, device: str = "cpu") -> float:
    """Median wall time of ``fn()`` in ms; on CUDA each call is timed to the end of its kernels (synchronized)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    fn()  # warm-up
    sync()
    times = []
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(1000 * (time.perf_counter() - t0))
        if len(times) >= 200:
            break
    return statistics.median(times)


def chain_rows(args) -> list[dict]:
    rows = []
    timing = {"min_repeats": args.repeats, "budget_s": args.budget, "device": args.device}
    header = (
        f"{'B':>3} {'K':>2} {'V':>7} | {'token ms':>9} {'block ms':>9} {'greedy ms':>9} | {'block/token':>11} | "
        f"{'validation ms':>13} {'(+% block)':>10} | {'block % of fwd':>14}"
    )
    print(header)
    print("-" * len(header))
    for batch in args.batch:
        for width in args.width:
            for vocab in args.vocab:
                inputs = [tensor.to(args.device) for tensor in make_inputs(batch, width, vocab)]
                gen = torch.Generator(args.device).manual_seed(1)
                times = {
                    name: median_ms(functools.partial(rule.verify, *inputs, generator=gen, validate=False), **timing)
                    for name, rule in RULES.items()
                }
                validated = median_ms(
                    functools.partial(RULES["block"].verify, *inputs, generator=gen, validate=True), **timing
                )
                forward = TARGET_FORWARD_MS.get((batch, width + 1)) if args.device == "cpu" else None
                row = {
                    "batch": batch,
                    "width": width,
                    "vocab": vocab,
                    **{f"{name}_ms": round(ms, 3) for name, ms in times.items()},
                    "block_over_token": round(times["block"] / times["token"], 2),
                    "validation_ms": round(validated - times["block"], 3),
                    "block_share_of_target_forward": round(times["block"] / forward, 4) if forward else None,
                }
                rows.append(row)
                share = f"{100 * row['block_share_of_target_forward']:.2f} %" if forward else "-"
                print(
                    f"{batch:>3} {width:>2} {vocab:>7} | {times['token']:>9.2f} {times['block']:>9.2f} "
                    f"{times['greedy']:>9.2f} | {row['block_over_token']:>10.2f}x | {row['validation_ms']:>13.2f} "
                    f"{100 * row['validation_ms'] / times['block']:>9.0f}% | {share:>14}",
                    flush=True,
                )
                del inputs
    print(
        "validate=False in the timed columns; 'validation ms' = block with validate=True minus without. '% of fwd': "
        "block time over the Qwen2.5-Coder-1.5B bf16 forward of K+1 tokens (measured on an AVX-512 machine)."
    )
    return rows


def tree_rows(args) -> list[dict]:
    rows = []
    timing = {"min_repeats": args.repeats, "budget_s": args.budget, "device": args.device}
    header = (
        f"{'B':>3} {'shape':>8} {'N':>3} {'V':>7} | {'token ms':>9} {'block ms':>9} | "
        f"{'% of step':>9} | {'validation ms':>13}"
    )
    print(header)
    print("-" * len(header))
    for batch in args.tree_batch:
        for name in args.trees:
            shape = tuple(int(k) for k in name.split("x"))
            for vocab in args.tree_vocab:
                inputs = [tensor.to(args.device) for tensor in make_tree_inputs(batch, shape, vocab)]
                gen = torch.Generator(args.device).manual_seed(1)
                times = {
                    rule: median_ms(
                        functools.partial(verify, *inputs, scheme="distinct", generator=gen, validate=False), **timing
                    )
                    for rule, verify in TREE_VERIFIERS.items()
                }
                validated = median_ms(
                    functools.partial(verify_tree_block, *inputs, scheme="distinct", generator=gen, validate=True),
                    **timing,
                )
                slowest = max(times.values())
                row = {
                    "batch": batch,
                    "shape": name,
                    "nodes": inputs[0].shape[1],
                    "vocab": vocab,
                    **{f"tree_{rule}_ms": round(ms, 3) for rule, ms in times.items()},
                    "validation_ms": round(validated - times["block"], 3),
                    "share_of_target_step": round(slowest / args.step_ms, 4),
                }
                rows.append(row)
                print(
                    f"{batch:>3} {name:>8} {row['nodes']:>3} {vocab:>7} | {times['token']:>9.2f} "
                    f"{times['block']:>9.2f} | {100 * row['share_of_target_step']:>7.2f} % | "
                    f"{row['validation_ms']:>13.2f}",
                    flush=True,
                )
                del inputs
    print(
        "verify_tree_token / verify_tree_block, scheme 'distinct', validate=False in the timed columns. '% of step': "
        f"the slower rule over a {args.step_ms:g} ms target step (--step-ms; a batch-1 step, larger batches' cost "
        "more)."
    )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", nargs="+", choices=["chains", "trees"], default=["chains", "trees"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64], help="batch sizes B (chains)")
    parser.add_argument("--width", type=int, nargs="+", default=[4, 8], help="drafted tokens per row K (chains)")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936], help="vocabulary sizes V (chains)")
    parser.add_argument("--trees", nargs="+", default=TREE_SHAPES, help="tree shapes, children per depth: 4x1x1x1")
    parser.add_argument("--tree-batch", type=int, nargs="+", default=[1, 8], help="batch sizes B (trees)")
    parser.add_argument("--tree-vocab", type=int, nargs="+", default=[151936], help="vocabulary sizes V (trees)")
    parser.add_argument("--step-ms", type=float, default=80.0, help="a target step, to express tree rows against")
    parser.add_argument("--repeats", type=int, default=7, help="minimum timed calls per cell (median reported)")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per cell, at least")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    parser.add_argument("--device", default="cpu", help="where the verifiers run: cpu, or cuda on a GPU")
    parser.add_argument("--out", type=Path, default=Path("results/verify_speed.json"), help="JSON output file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    rows = chain_rows(args) if "chains" in args.tables else []
    trees = tree_rows(args) if "trees" in args.tables else []
    record = {
        "benchmark": "verify_speed",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "threads": args.threads,
            "device": torch.cuda.get_device_name(args.device) if "cuda" in args.device else "cpu",
        },
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__},
        "rows": rows,
        "tree_rows": trees,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
