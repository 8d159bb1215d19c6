"""``blockspec bench``: a preset's BenchConfig with the flags given in its place, run, then reported."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path

from .. import defaults
from ..bench.records import CONFIGS, KNOWN_CONFIGS, PATHS, TREE, is_paths, is_tree, paths_config, paths_of, tree_config
from ..defaults import BACKENDS, DTYPES, QUANTS
from .common import (
    ALLOW_DOWNLOAD_HELP,
    DEVICE_HELP,
    NO_CHAT_HELP,
    TIME_BUDGET_HELP,
    int_at_least,
    positive_float,
    tree_shape,
)

PRESETS = ("quick", "paper", "sv", "align")  # blockspec.bench.runner.PRESETS, which imports torch
# `blockspec align` takes one target temperature and one K: the BenchConfig fields its flags set
ALIGN_FIELDS = {"temperature": "temperatures", "max_draft": "max_drafts"}

EXAMPLES = """examples:
  blockspec bench                        # the quick preset (on llama.cpp on a CPU, as generate runs)
  blockspec bench --backend hf           # the same on transformers, with its assisted generation
  blockspec bench --preset paper --time-budget 3600   # run again to resume
  blockspec bench --datasets gsm8k --max-draft 2 4 --prompts 5 --out results/mine
  blockspec bench --configs target-only block tree-2,1,1 tree-3,1 --max-draft 4   # trees beside a chain
  blockspec bench --configs block paths-3 paths-iid-3 --max-draft 4   # 3 paths of 4 tokens beside a chain of 4
  blockspec sv profile --backend hf && blockspec sv calibrate --backend hf   # once (the sv preset runs transformers),
  blockspec bench --preset sv --out results/bench-sv  # then the SV grid (hours; resumable)"""


def add_parser(sub) -> None:
    # Every default is None: only the flags given override the preset (blockspec.bench.runner.PRESETS).
    bench = sub.add_parser(
        "bench",
        help="compare target-only, token and block verification, Speculative Verification and "
        "transformers' assisted generation, at one or more batch sizes",
        description="Decode the same prompts with the same seeds through every configuration, write one JSONL\n"
        "record per run, then the report and plots. Resumable: records already written are skipped.\n"
        "Every option is explained in docs/guide/cli.md.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--preset", default="quick", choices=PRESETS, help="the settings to start from (default: quick)")
    bench.add_argument("--target", help="target model (default: the preset's)")
    bench.add_argument("--draft", help="draft model (default: the preset's)")
    bench.add_argument("--datasets", nargs="+", help="prompt sets (blockspec.bench.datasets.DATASETS)")
    bench.add_argument("--prompts", type=int_at_least(1), dest="prompts_per_dataset", help="prompts per dataset")
    bench.add_argument(
        "--max-draft",
        type=int_at_least(1, defaults.DRAFT_LIMIT),
        nargs="+",
        dest="max_drafts",
        help="draft lengths K to compare",
    )
    bench.add_argument("--temperatures", type=float, nargs="+", help="sampling temperatures (0 = greedy)")
    bench.add_argument(
        "--draft-temperatures",
        type=float,
        nargs="+",
        help="the draft's own temperatures, the alignment sweep (default: the preset's; align: "
        f"{' '.join(f'{t:g}' for t in defaults.ALIGN['draft_temperatures'])})",
    )
    bench.add_argument(
        "--configs",
        nargs="+",
        type=config_name,
        metavar="CONFIG",
        help=f"configurations to run, any of {', '.join(KNOWN_CONFIGS)}; {TREE}SHAPE, a tree of that shape "
        f"drafted each step (children per node at each depth, e.g. {TREE}2,1,1); {PATHS}K, K paths of each "
        f"--max-draft tokens drafted each step, first tokens distinct, or {PATHS}iid-K, K i.i.d. paths merged where "
        f"they agree (default: the preset's; quick and paper: "
        f"{' '.join(CONFIGS)}, less hf-assisted where --backend auto picks llama.cpp)",
    )
    bench.add_argument("--batch-sizes", type=int_at_least(1), nargs="+", help="prompts decoded together per run")
    bench.add_argument("--companion", help="SV companion (default: the same as `blockspec sv`)")
    bench.add_argument("--sv-profile", type=Path, help="SV calibration profile (default: `blockspec sv calibrate`'s)")
    bench.add_argument("--latency", type=Path, help="SV latency profile (default: `blockspec sv profile`'s)")
    bench.add_argument("--max-new-tokens", type=int_at_least(1), help="new tokens per prompt")
    bench.add_argument("--time-budget", type=positive_float, help=TIME_BUDGET_HELP)
    bench.add_argument(
        "--precision",
        type=positive_float,
        help="stop the batch-1 runs once the block-vs-token gain is known to +- this",
    )
    bench.add_argument("--seed", type=int, help="base seed: prompt i of a set uses seed + i in every configuration")
    bench.add_argument("--dtype", choices=["auto", *DTYPES], help="auto: the fastest on this machine (default: auto)")
    bench.add_argument("--target-quant", choices=QUANTS, help="quantize the target in every configuration (CPU)")
    bench.add_argument("--device", help=DEVICE_HELP)
    bench.add_argument(
        "--backend",
        choices=["auto", *BACKENDS],
        help="llamacpp, hf or auto (default: the preset's: auto for quick, hf for the others). auto: llama.cpp for "
        "GGUF models (the bundled pair's included) on a CPU, as generate runs them, leaving out what only "
        "transformers runs (its assisted generation and prompt lookup, block-int8, sv-token, sv-block); hf "
        "otherwise",
    )
    bench.add_argument("--out", type=Path, help="output directory for records, report and plots")
    bench.add_argument("--allow-download", action="store_true", default=None, help=ALLOW_DOWNLOAD_HELP)
    bench.add_argument("--no-chat", dest="chat", action="store_false", default=None, help=NO_CHAT_HELP)
    bench.add_argument(
        "--retry-failed",
        action="store_true",
        default=None,
        help="rerun the runs recorded as failed (default: keep them)",
    )
    bench.set_defaults(run=run)


def config_name(text: str) -> str:
    """An argparse type: a name in KNOWN_CONFIGS, a tree's (TREE and a shape) or paths' (PATHS, then iid- or not,
    then k), written as the records name it."""
    if text in KNOWN_CONFIGS:
        return text
    if is_tree(text):
        return tree_config(tree_shape(text.removeprefix(TREE)))
    if is_paths(text):
        try:
            return paths_config(*paths_of(text))
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    raise argparse.ArgumentTypeError(
        f"must be one of {', '.join(KNOWN_CONFIGS)}, {TREE}SHAPE, {PATHS}K or {PATHS}iid-K, got {text!r}"
    )


def bench_config(args):
    """The BenchConfig `blockspec bench` (or `align`) runs: the preset's, with every flag given in its place."""
    from ..bench import runner

    preset = runner.PRESETS[args.preset]
    given = {ALIGN_FIELDS.get(name, name): value for name, value in vars(args).items() if value is not None}
    overrides = {}
    for field in fields(preset):
        if field.name in given:
            value = given[field.name]
            if isinstance(getattr(preset, field.name), tuple):  # the lists (one value for align's single flags)
                value = tuple(value) if isinstance(value, list) else (value,)
            overrides[field.name] = value
    return replace(preset, **overrides)


def run(args) -> int:
    from ..bench import report, runner
    from ..models.load import resolve_device
    from ..sampling import SamplingParams

    config = bench_config(args)
    for temperature in (*config.temperatures, *config.draft_temperatures):  # refused here, not after the models load
        SamplingParams(temperature=temperature)
    resolve_device(config.device)
    records_file = runner.run(config)
    return report.main(["--records", str(records_file), "--out", str(config.out)])
