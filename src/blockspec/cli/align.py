"""``blockspec align``: the alignment sweep, ``blockspec bench --preset align`` with flags of its own."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import defaults
from ..defaults import DTYPES
from . import bench
from .common import ALLOW_DOWNLOAD_HELP, DEVICE_HELP, NO_CHAT_HELP, TIME_BUDGET_HELP, int_at_least, positive_float

EXAMPLES = """examples:
  blockspec align --time-budget 1200      # bundled pair, 3 datasets x 5 T_d
  blockspec align --draft-temperatures 0.5 1 2 --prompts 8 --out results/align-8   # run again to resume
  python -m blockspec.bench.report --records results/align/records.jsonl --out results/align  # re-report"""


def add_parser(sub) -> None:
    # Every default is None: only the flags given override the align preset (blockspec.bench.runner.PRESETS).
    align = sub.add_parser(
        "align",
        help="alignment sweep: block-vs-token gain against draft-target overlap, the draft sampling at "
        "several temperatures of its own",
        description="How does the gain of block over token verification depend on draft quality? The draft\n"
        "samples at temperatures T_d of its own (still lossless) while the target keeps --temperature; the\n"
        "report gives, per T_d, the draft-target overlap, the analytic block efficiency of both rules and\n"
        "the paired analytic gain. No wall clock is measured. This is `blockspec bench --preset align`, resumable;\n"
        "docs/guide/cli.md explains it.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    align.add_argument("--target", help="the model whose distribution is kept (default: the bundled target)")
    align.add_argument("--draft", help="the small model that proposes tokens (default: the bundled draft)")
    align.add_argument("--datasets", nargs="+", help="prompt sets (blockspec.bench.datasets.DATASETS)")
    align.add_argument(
        "--prompts",
        type=int_at_least(1),
        dest="prompts_per_dataset",
        help=f"prompts per dataset (default: {defaults.ALIGN['prompts_per_dataset']})",
    )
    align.add_argument(
        "--draft-temperatures",
        type=float,
        nargs="+",
        help="the draft's own temperatures T_d; 0 = its argmax (default: "
        f"{' '.join(f'{t:g}' for t in defaults.ALIGN['draft_temperatures'])})",
    )
    align.add_argument("--temperature", type=float, help="the target's temperature, > 0 (default: the bench's)")
    align.add_argument(
        "--max-draft",
        type=int_at_least(1),
        help=f"tokens drafted per step, K (default: {defaults.ALIGN['max_drafts'][0]})",
    )
    align.add_argument("--max-new-tokens", type=int_at_least(1), help="new tokens per prompt (default: the bench's)")
    align.add_argument("--seed", type=int, help="base seed: prompt n of a set uses seed + n at every T_d")
    align.add_argument("--dtype", choices=DTYPES, help=f"(default: {defaults.ALIGN['dtype']})")
    align.add_argument("--device", help=f"{DEVICE_HELP} (default: the bench's)")
    align.add_argument("--no-chat", dest="chat", action="store_false", default=None, help=NO_CHAT_HELP)
    align.add_argument("--allow-download", action="store_true", default=None, help=ALLOW_DOWNLOAD_HELP)
    align.add_argument("--time-budget", type=positive_float, help=TIME_BUDGET_HELP)
    align.add_argument("--out", type=Path, help=f"output directory (default: {defaults.ALIGN['out']})")
    align.set_defaults(run=bench.run, preset="align")
