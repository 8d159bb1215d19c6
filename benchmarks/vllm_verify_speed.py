# vLLM lives in its own environment (scripts/setup_vllm.sh), not in the one pyright checks:
# pyright: reportMissingImports=false
"""One verification step inside vLLM 0.32: vLLM's token rule (``rejection_sample``) against blockspec's block rule
(``rejection.block_rejection_sample``), on random inputs of the bundled pair's vocabulary, every request sampled.

    .venv-vllm/bin/python benchmarks/vllm_verify_speed.py --out results/vllm-verify-speed.json

Both rules are timed alternately, in this process, after warm-up; the figure is the median of the timed calls.
Run it alone (no test or benchmark meanwhile). Prints a table, saves JSON with the machine's CPU flags.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import types
from datetime import UTC, datetime
from pathlib import Path

import torch

VOCAB = 151936  # Qwen2.5's


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["1x2", "1x4", "4x2", "16x2", "16x4"],
        help="requests x drafted tokens each (default: %(default)s)",
    )
    parser.add_argument("--calls", type=int, default=20, help="timed calls per rule and shape, after 5 warm-up")
    parser.add_argument("--out", type=Path, default=Path("results/vllm-verify-speed.json"))
    args = parser.parse_args(argv)

    os.environ["BLOCKSPEC_VLLM_RULE"] = "block"
    from vllm.platforms.cpu import CpuPlatform

    from blockspec import machine
    from blockspec.vllm import plugin
    from blockspec.vllm.rejection import block_rejection_sample

    plugin.register()
    CpuPlatform.register_triton_kernel_overrides()  # as vLLM's CPU worker does after loading its plugins
    rules = {"token": block_rejection_sample.stock, "block": block_rejection_sample}
    generator = torch.Generator().manual_seed(0)
    rows = []
    for shape in args.shapes:
        batch, k = (int(n) for n in shape.split("x"))
        draft_probs = torch.rand(batch * k, VOCAB, generator=generator).softmax(-1)
        inputs = (
            torch.multinomial(draft_probs, 1, generator=generator).squeeze(-1).to(torch.int32),
            [k] * batch,
            k,
            torch.full((batch,), k, dtype=torch.int32).cumsum(0).to(torch.int32),
            draft_probs,
            3 * torch.randn(batch * k, VOCAB, generator=generator),
            torch.randint(0, VOCAB, (batch, 1), dtype=torch.int32, generator=generator),
            types.SimpleNamespace(
                all_greedy=False, all_random=True, temperature=torch.ones(batch), generators={}, top_k=None, top_p=None
            ),
        )
        times = {name: [] for name in rules}
        for call in range(5 + args.calls):
            for name, rule in rules.items():
                start = time.perf_counter()
                rule(*inputs)
                if call >= 5:
                    times[name].append(time.perf_counter() - start)
        row = {"requests": batch, "k": k, **{f"{name}_ms": 1000 * statistics.median(t) for name, t in times.items()}}
        rows.append(row)
        print(
            f"{batch:>3} requests x K={k}: token {row['token_ms']:7.2f} ms, block {row['block_ms']:7.2f} ms, "
            f"block / token {row['block_ms'] / row['token_ms']:.2f}x",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "vllm_verify_speed",
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "machine": {"platform": platform.platform(), **machine.facts()},
                "torch": torch.__version__,
                "vocab": VOCAB,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
