"""What Speculative Verification adds to a step inside vLLM: the plugin's two SV decisions before verification
(``SVPolicy.draft_budget``, then ``sv_hook.sv_lengths`` over the drafts' distributions) and its online step after it
(``sv_hook.learn_from_verification``, the exact gains of the verified drafts), on random draft and target
distributions over the bundled pair's vocabulary, K drafted tokens per request, all verified.

    .venv-vllm/bin/python benchmarks/vllm_sv_hook.py --sv CALIBRATION LATENCY --out results/vllm-sv-hook.json

Timed in this process after warm-up; each figure is the median of its timed calls. Run it alone (no test or
benchmark meanwhile). Prints a table, saves JSON with the machine's CPU flags and the commit.
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
        "--sv",
        nargs=2,
        type=Path,
        required=True,
        metavar=("CALIBRATION", "LATENCY"),
        help="SV's profiles, as BLOCKSPEC_VLLM_SV names them",
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16], help="requests drafting at once")
    parser.add_argument("--max-draft", type=int, default=4, help="tokens drafted per request, K")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per batch size, after 3 warm-up")
    parser.add_argument("--out", type=Path, default=Path("results/vllm-sv-hook.json"))
    args = parser.parse_args(argv)

    import provenance

    from blockspec import machine
    from blockspec.vllm.sv_hook import learn_from_verification, sv_lengths, sv_policy, use_sv
    from blockspec.vllm.switches import SWITCH

    os.environ[SWITCH] = "block"
    use_sv(args.sv)
    runner = types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=args.max_draft))
    policy = sv_policy(runner)  # the policy the plugin's worker builds at its first step
    generator = torch.Generator().manual_seed(0)
    rows = []
    for batch in args.batch_sizes:
        probs = torch.rand(batch, args.max_draft, VOCAB, generator=generator).softmax(-1)
        drafts = torch.multinomial(probs.flatten(0, 1), 1, generator=generator).view(batch, args.max_draft)
        target = torch.rand(batch * args.max_draft, VOCAB, generator=generator).softmax(-1)
        counts, sampled = torch.full((batch,), args.max_draft), torch.ones(batch, dtype=torch.bool)
        times = {"sv_ms": [], "learn_ms": []}
        for call in range(3 + args.calls):
            start = time.perf_counter()
            policy.draft_budget(batch, 1)
            sv_lengths(policy, drafts, probs)
            decided = time.perf_counter()
            learn_from_verification(policy, drafts.flatten(), counts, sampled, probs.flatten(0, 1), target)
            if call >= 3:
                times["sv_ms"].append(decided - start)
                times["learn_ms"].append(time.perf_counter() - decided)
        rows.append(
            {
                "requests": batch,
                "k": args.max_draft,
                **{name: 1000 * statistics.median(values) for name, values in times.items()},
            }
        )
        print(
            f"{batch:>3} requests x K={args.max_draft}: SV's decisions {rows[-1]['sv_ms']:7.2f} ms, "
            f"its online step {rows[-1]['learn_ms']:7.2f} ms",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "vllm_sv_hook",
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "commit": provenance.commit(),
                "machine": {"platform": platform.platform(), **machine.facts()},
                "torch": torch.__version__,
                "torch_threads": torch.get_num_threads(),
                "vocab": VOCAB,
                "profiles": [str(path) for path in args.sv],
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
