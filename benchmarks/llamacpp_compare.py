"""What a CPU user gets on the bundled GGUF pair: blockspec on llama.cpp's kernels against llama.cpp itself.

Per prompt, in one interleaved round (batch 1, the same chat-formatted prompt and max new tokens everywhere):
  llamacpp-alone     blockspec's engine, target alone, on the llama.cpp adapter
  llama-bench        llama.cpp's own benchmark of the target alone (`llama-bench`, one repetition): as many new
                     tokens, after as many tokens of context as the prompt has (the goal the target alone is held to)
  llama.cpp-alone    llama.cpp's own text generation, target alone (`llama-completion`, no chat, the sampler at the
                     plain law as llama.cpp-spec's): what a llama.cpp user runs, sampling included, which llama-bench
                     is not; its decode time as its counters give it, evaluation plus sampling
  llamacpp-token/-block  blockspec, the 0.5B draft, fixed K, token / block verification, on llama.cpp
  llamacpp-auto      blockspec's adaptive draft: block verification, length adapted to the measured step costs
  llamacpp-block-q4 / -auto-q4  the same with the draft requantized to q4_0 by llama.cpp (`--draft-quant q4_0`)
  llamacpp-block-q4-cut / -auto-q4-cut  the q4_0 draft with its vocabulary cut to its first 32,768 ids and special
                     tokens (`models.vocab_cut`: an output layer of 32,790 rows instead of 151,936)
  llamacpp-lookup    blockspec, prompt lookup alone (no draft model)
  llamacpp-default   what `blockspec generate` runs on llama.cpp: prompt lookup beside the q4_0 draft's adaptive
                     length (a proposal only where it is expected to beat the draft's step)
  llamacpp-default-blind  the same with the adaptive length blind to what the draft's catch-up costs (it resumes
                     drafting wherever drafting step after step pays, however far behind the draft is)
  hf-alone           blockspec's engine, target alone, on transformers (bfloat16 weights dequantized from the GGUF)
  hf-assisted        transformers' assisted generation with the same draft (its whole wall time: it reports no
                     prefill time; the others are decode time)
  llama.cpp-spec     llama.cpp's own lossless speculative decoding (`llama-speculative-simple`: the draft drafts
                     greedily, the target samples every position and keeps a drafted token only if its own sample
                     equals it), same draft and K, decode time as it reports it
  llama.cpp-ngram    llama.cpp's own prompt lookup, the same program with no draft model (`--spec-type ngram-simple`:
                     drafts of up to NGRAM_DRAFT tokens that followed the last earlier occurrence of the context's
                     last NGRAM tokens, kept as llama.cpp-spec keeps drafts), decode time as it reports it (it may
                     decode past the max new tokens: its last step keeps all it accepted)
Figures are tokens/s of the decode (prefill excluded everywhere: llama.cpp's programs report it so), their ratios to
llamacpp-alone on the same prompt (and, with the llama-bench or llama.cpp-alone rows, to that run beside it, per
dataset), and accepted tokens per step; the block rows also score every step's draft exactly under both rules
(`bench.executor.ExpectedScores`): the paired analytic gain of block over token.

    bash scripts/build_llamacpp_tools.sh      # once: llama-bench, llama-completion, llama-speculative-simple
    python benchmarks/llamacpp_compare.py run --out results/llamacpp --datasets humaneval-edit pydoc-qa humaneval
    python benchmarks/llamacpp_compare.py report --out results/llamacpp

llama.cpp's programs must run the kernels blockspec's llama.cpp runs: `run` refuses tools whose recorded flags ask for
other instruction sets (a folder built for another machine kind, or before a rebuild with other CMAKE_ARGS) and
records their flags. Run it alone: llama.cpp's threads collapse under load from another process.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROWS = (
    "llamacpp-alone",
    "llama-bench",
    "llama.cpp-alone",
    "llamacpp-token",
    "llamacpp-block",
    "llamacpp-auto",
    "llamacpp-block-q4",
    "llamacpp-auto-q4",
    "llamacpp-block-q4-cut",
    "llamacpp-auto-q4-cut",
    "llamacpp-lookup",
    "llamacpp-default",
    "llamacpp-default-blind",
    "llama.cpp-spec",
    "llama.cpp-ngram",
    "hf-alone",
    "hf-assisted",
)
BASELINE = "llamacpp-alone"
VOCABULARY_CUT = 32768  # the cut draft's ids (plus its special tokens)
PROGRAMS = ("llama-bench", "llama-completion", "llama-speculative-simple")  # scripts/build_llamacpp_tools.sh's
NGRAM, NGRAM_DRAFT = 12, 48  # llama.cpp-ngram's lookup n-gram and longest draft (llama.cpp's ngram-simple defaults)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="measure, appending to <out>/records.jsonl")
    run_parser.add_argument("--datasets", nargs="+", default=["humaneval-edit", "pydoc-qa", "humaneval"])
    run_parser.add_argument("--prompts", type=int, default=2, help="per dataset")
    run_parser.add_argument("--max-new-tokens", type=int, default=128)
    run_parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    run_parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="one run per seed at T > 0 (prompt i of N: stream seed * N + i)",
    )
    # K = 3: a verification of 4 tokens, the width llama.cpp's repacked matmuls run cheapest per token
    run_parser.add_argument("--max-draft", type=int, default=3, help="K of the fixed rows and of llama.cpp's")
    run_parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    run_parser.add_argument(
        "--tools",
        type=Path,
        help="folder of llama.cpp's programs, as scripts/build_llamacpp_tools.sh builds it",
    )
    for each in (run_parser, sub.add_parser("report", help="print the tables of <out>/records.jsonl(.gz)")):
        each.add_argument("--out", type=Path, default=Path("results/llamacpp"))
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)
    report(load(args.out))
    return 0


def run(args) -> None:
    import torch

    from blockspec import PromptLookup, SamplingParams, SpeculativeDecoder
    from blockspec.auto import default_decoder, lookup_latency
    from blockspec.bench import datasets
    from blockspec.bench.executor import ExpectedScores
    from blockspec.machine import cpu_flags
    from blockspec.models.chat import encode_prompt
    from blockspec.models.llamacpp import build_info, load_llamacpp

    tools = args.tools or Path(subprocess.check_output(["bash", "scripts/build_llamacpp_tools.sh"], text=True).strip())
    tools_args = tools_flags(tools, build_info())
    target, draft = load_llamacpp("qwen2.5-coder-1.5b"), load_llamacpp("qwen2.5-coder-0.5b")
    small = load_llamacpp("qwen2.5-coder-0.5b", quant="q4_0")
    cut = load_llamacpp("qwen2.5-coder-0.5b", quant="q4_0", vocabulary=VOCABULARY_CUT)
    # the build's instruction sets decide llama.cpp's kernels, as the CPU flags decide which it can run
    machine = {
        "cpu_flags": cpu_flags(),
        "threads": torch.get_num_threads(),
        "llamacpp_build": build_info(),
        "llamacpp_tools": tools_args,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    records = (args.out / "records.jsonl").open("a")

    def record(entry: dict) -> None:
        entry.update(machine, date=time.strftime("%Y-%m-%d %H:%M"))
        records.write(json.dumps(entry) + "\n")
        records.flush()
        print(json.dumps({k: v for k, v in entry.items() if k not in machine}), flush=True)

    def auto(model, lookup=False, **options):  # blockspec generate's default; options: AdaptiveLength's
        decoder = default_decoder(target, model, lookup=lookup, **options)
        record({"row": "policy", "draft": model.name, "speculates": decoder.draft is not None})
        return decoder

    decoders = {
        "llamacpp-alone": SpeculativeDecoder(target),
        "llamacpp-token": SpeculativeDecoder(target, draft, rule="token", max_draft=args.max_draft),
        "llamacpp-block": SpeculativeDecoder(target, draft, rule="block", max_draft=args.max_draft),
        "llamacpp-auto": auto(draft),
        "llamacpp-block-q4": SpeculativeDecoder(target, small, rule="block", max_draft=args.max_draft),
        "llamacpp-auto-q4": auto(small),
        "llamacpp-block-q4-cut": SpeculativeDecoder(target, cut, rule="block", max_draft=args.max_draft),
        "llamacpp-auto-q4-cut": auto(cut),
        "llamacpp-lookup": SpeculativeDecoder(target, lookup=PromptLookup(costs=lookup_latency(target, 1))),
        "llamacpp-default": auto(small, lookup=True),
        "llamacpp-default-blind": auto(small, lookup=True, horizon=math.inf),
    }
    if {"hf-alone", "hf-assisted"} & set(args.rows):
        from blockspec.bench.executor import run_assisted
        from blockspec.models.load import load_model

        hf_target, hf_draft = (
            load_model(name, dtype="bfloat16") for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
        )
        decoders["hf-alone"] = SpeculativeDecoder(hf_target)
    prompts = [(name, p) for name in args.datasets for p in datasets.load(name, n=args.prompts, seed=0)]
    runs = [(t, seed) for t in args.temperatures for seed in (args.seeds if t > 0 else [0])]  # greedy: one run
    for temperature, run_seed in runs:
        sampling = SamplingParams(temperature=temperature)
        for index, (dataset, prompt) in enumerate(prompts):
            ids = encode_prompt(target.tokenizer, prompt.text, chat=True)
            # every row of a prompt draws from the same stream (common random numbers), each prompt from its own: with
            # one stream for all, a seed's early draws sway every prompt's text alike, and prompts stop being samples
            seed = run_seed * len(prompts) + index
            for row in args.rows:
                base = {"row": row, "dataset": dataset, "prompt": prompt.id, "temperature": temperature, "K": 0}
                base.update(seed=run_seed, stream=seed)
                if row == "llama-bench":  # it samples nothing: the same figure at every temperature, run again
                    measured = llama_bench(tools, target.path, machine["threads"], len(ids), args.max_new_tokens)
                    record({**base, **measured, "accepted_per_step": None, "drafted_per_step": None})
                    continue
                if row == "llama.cpp-alone":
                    text = target.tokenizer.decode(ids)
                    measured = llama_completion(tools, target.path, text, args, temperature, seed)
                    record({**base, **measured, "accepted_per_step": None, "drafted_per_step": None})
                    continue
                if row in ("llama.cpp-spec", "llama.cpp-ngram"):
                    text = target.tokenizer.decode(ids)
                    model = draft.path if row == "llama.cpp-spec" else None
                    measured = speculative_simple(tools, target.path, model, text, args, temperature, seed)
                    record({**base, "K": args.max_draft if model else NGRAM_DRAFT, **measured})
                    continue
                if row == "hf-assisted":
                    done = run_assisted(hf_target, hf_draft, ids, sampling, args.max_new_tokens, seed=seed)
                    tokens = done["new_tokens"]
                    unknown = {"accepted_per_step": None, "drafted_per_step": None}  # transformers does not say
                    record({**base, "tokens": tokens, "tok_s": tokens / done["wall_time"], **unknown})
                    continue
                decoder = decoders[row]
                scores = ExpectedScores() if row.startswith("llamacpp-block") else None
                result = decoder.generate(
                    [ids], max_new_tokens=args.max_new_tokens, sampling=sampling, seed=seed, on_step=scores
                )
                decode_s = result.wall_time - result.prefill_s - (scores.seconds if scores else 0.0)
                entry = {
                    **base,
                    "K": decoder.max_draft if decoder.draft is not None else 0,
                    "tokens": result.new_tokens,
                    "tok_s": result.new_tokens / decode_s,
                    "accepted_per_step": result.block_efficiency - 1,
                    "drafted_per_step": sum(sum(s.verified) for s in result.stats) / max(result.row_steps, 1),
                }
                if scores is not None:
                    entry.update({f"expected_{rule}": statistics.fmean(v) for rule, v in scores.expected.items()})
                record(entry)
    records.close()


def tools_flags(tools: Path, system_info: str) -> str:
    """The CMake arguments llama.cpp's programs in ``tools`` were built with (their file cmake-args, which
    scripts/build_llamacpp_tools.sh writes), where they ask for the instruction sets the llama.cpp blockspec runs was
    built with (``system_info``). Otherwise SystemExit: llama.cpp's programs built with other kernels would compare
    the engines on unequal terms, in either direction; or built before llama-completion was among them."""
    from blockspec.models.llamacpp import build_mismatches

    path = tools / "cmake-args"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: build the tools with scripts/build_llamacpp_tools.sh, which records them")
    missing = [name for name in PROGRAMS if not (tools / name).is_file()]
    if missing:
        raise SystemExit(f"{tools} lacks {', '.join(missing)}: build the tools with scripts/build_llamacpp_tools.sh")
    flags = path.read_text().strip()
    mismatches = build_mismatches(flags, system_info)
    if mismatches:
        raise SystemExit(
            f"llama.cpp's programs in {tools} were built with {flags!r}, the llama.cpp blockspec runs with other "
            f"instruction sets ({'; '.join(mismatches)}: asked for by the programs' flags, built into blockspec's): "
            "build them with the same CMAKE_ARGS as scripts/setup.sh used"
        )
    return flags


def llama_bench(tools: Path, model: Path, threads: int, depth: int, tokens: int) -> dict:
    """llama-bench's token generation of ``tokens`` (one repetition, after its warm-up) for ``model`` at
    ``threads``, after ``depth`` tokens of context (flash attention on ``auto``, as in blockspec's contexts)."""
    command = [str(tools / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(tokens), "-r", "1"]
    command += ["-t", str(threads), "-d", str(depth), "-o", "json"]
    (test,) = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, timeout=900).stdout)
    return {"tok_s": test["avg_ts"], "tokens": tokens, "depth": depth}


def plain_sampling(temperature: float, seed: int) -> list[str]:
    """The arguments that make llama.cpp's programs sample at the plain law (no top-k, top-p or min-p) at
    ``temperature`` from ``seed``, in a context of 4096 tokens, on torch's threads: the same in each of its rows."""
    import torch

    sampler = ["--temp", str(temperature), "--top-k", "0", "--top-p", "1", "--min-p", "0", "--seed", str(seed)]
    return [*sampler, "-c", "4096", "-t", str(torch.get_num_threads())]


def llama_completion(tools: Path, target: Path, text: str, args, temperature: float, seed: int) -> dict:
    """One run of llama.cpp's own text generation with the target alone, sampling at the plain law as
    llama.cpp-spec's target does: its tokens over its evaluation and sampling time as its counters give them (the
    prompt's evaluation excluded, and its own few milliseconds of printing and bookkeeping). Each token but the
    last is evaluated after it is sampled, the first sampled from the prompt's evaluation: tokens are runs plus one.
    Both times are kept: llama.cpp's own work per token outside its forwards is its sampling time."""
    command = [
        str(tools / "llama-completion"),
        *("-m", str(target), "-p", text, "-n", str(args.max_new_tokens), "-no-cnv", "--no-display-prompt"),
        *plain_sampling(temperature, seed),
    ]
    log = subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=900, stdin=subprocess.DEVNULL
    ).stderr
    evaluated = re.search(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs", log)
    sampled = re.search(r"sampling time =\s+([\d.]+) ms", log)
    if not (evaluated and sampled):
        raise RuntimeError(f"unexpected llama-completion output:\n{log[-2000:]}")
    tokens = int(evaluated.group(2)) + 1
    eval_s, sampling_s = float(evaluated.group(1)) / 1000, float(sampled.group(1)) / 1000
    return {"tokens": tokens, "tok_s": tokens / (eval_s + sampling_s), "eval_s": eval_s, "sampling_s": sampling_s}


def speculative_simple(
    tools: Path, target: Path, draft: Path | None, text: str, args, temperature: float, seed: int
) -> dict:
    """One run of llama.cpp's own speculative decoding: the draft drafts K tokens each step (no confidence cut-off),
    or with no draft its n-gram lookup proposes (llama.cpp-ngram's settings); the target verifies them with its
    sampler at the plain law (no top-k, top-p or min-p); its reported decode speed and acceptance."""
    if draft is not None:
        spec = ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.max_draft)]
        spec += ["--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
    else:
        spec = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NGRAM)]
        spec += ["--spec-ngram-simple-size-m", str(NGRAM_DRAFT)]
    command = [
        str(tools / "llama-speculative-simple"),
        *("-m", str(target), "-p", text, "-n", str(args.max_new_tokens)),
        *spec,
        *plain_sampling(temperature, seed),
    ]
    log = subprocess.run(command, capture_output=True, text=True, check=True, timeout=900).stderr
    found = {
        name: re.search(pattern, log)
        for name, pattern in (
            ("decoded", r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
            ("predicted", r"n_predict\s*=\s*(\d+)"),
            ("drafted", r"n_drafted\s*=\s*(\d+)"),
            ("accepted", r"n_accept\s*=\s*(\d+)"),
        )
    }
    if not all(found.values()):
        raise RuntimeError(f"unexpected llama-speculative-simple output:\n{log[-2000:]}")
    value = {name: int(match.group(1)) for name, match in found.items() if match}
    seconds = float(found["decoded"].group(2))  # pyright: ignore[reportOptionalMemberAccess]
    # a step emits the drafted tokens it accepted and one token of the target's own: steps = emitted - accepted
    steps = max(value["predicted"] - value["accepted"], 1)
    return {
        "tokens": value["decoded"],
        "tok_s": value["decoded"] / seconds,
        "accepted_per_step": value["accepted"] / steps,
        "drafted_per_step": value["drafted"] / steps,
    }


def load(out: Path) -> list[dict]:
    path = out / "records.jsonl.gz"
    text = gzip.open(path, "rt").read() if path.is_file() else (out / "records.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def interval(values: list[float], rounds: int = 2000) -> str:
    """The median and a 95 % bootstrap interval over runs: prompts, and seeds at T > 0 (the report is reproducible)."""
    if len(values) < 3:
        return f"{statistics.median(values):.3f}x"
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    low, high = medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]
    return f"{statistics.median(values):.3f}x [{low:.3f}, {high:.3f}]"


def run_key(record: dict) -> tuple:
    """What pairs a run with the target alone's: temperature, prompt and seed (0 in records that name none)."""
    return record["temperature"], record["prompt"], record.get("seed", 0)


def report(records: list[dict]) -> None:
    """The tables: the target alone against llama-bench (run before and after the runs in earlier records, prompt
    by prompt since); per temperature and dataset, every row against the llama-bench run beside it and against
    llama.cpp's own generation beside it (or, in a run with neither, against the target alone); per temperature and
    prompt group, every row against the target alone on the same prompts; block against token verification on the
    same drafts, where a run has block rows."""
    runs = [r for r in records if "temperature" in r]
    flags = sorted({" ".join(r["cpu_flags"]) for r in records})
    builds = sorted({r["llamacpp_build"] for r in records if "llamacpp_build" in r})  # not in earlier records
    built = f" llama.cpp built with: {'; '.join(builds)}." if builds else ""
    print(f"Machine: CPU flags {'; '.join(flags)}; {records[0]['threads']} threads.{built}\n")
    alone = {run_key(r): r["tok_s"] for r in runs if r["row"] == BASELINE}
    benches = [r for r in records if r["row"] == "llama-bench" and "temperature" not in r]
    if benches:  # records of earlier runs: llama-bench before (and after) the runs, the runs' median against it
        print("## target alone against llama-bench\n")
        print("| llama-bench tg64 after | tok/s | blockspec target alone on llama.cpp, median tok/s | ratio |")
        print("|---|---|---|---|")
        median_alone = statistics.median(alone.values())
        for bench in benches:
            depth = bench.get("depth", 0)  # earlier runs measured on an empty context only
            after = f" (after the runs from {bench['after_runs_from']})" if "after_runs_from" in bench else ""
            ratio = median_alone / bench["tok_s"]
            print(f"| {depth} tokens{after} | {bench['tok_s']:.2f} | {median_alone:.2f} | {ratio:.3f}x |")
    paired = [r for r in runs if r["row"] == "llama-bench" and run_key(r) in alone]
    if paired:
        print("## target alone against llama-bench, prompt by prompt\n")
        print(
            "| T | runs | llama-bench at the prompt's depth, median tok/s | blockspec target alone on llama.cpp, "
            "median tok/s | target alone / llama-bench (CI) |"
        )
        print("|---|---|---|---|---|")
        for temperature in sorted({r["temperature"] for r in paired}):
            these = [r for r in paired if r["temperature"] == temperature]
            ratios = [alone[run_key(r)] / r["tok_s"] for r in these]
            print(
                f"| {temperature:g} | {len(these)} | {statistics.median(r['tok_s'] for r in these):.2f} | "
                f"{statistics.median(alone[run_key(r)] for r in these):.2f} | {interval(ratios)} |"
            )
    paired_rows = {r["row"] for r in runs if run_key(r) in alone}
    references = [row for row in ("llama-bench", "llama.cpp-alone") if row in paired_rows]
    for row in references:
        against(runs, row, alone)
    if not references:
        per_dataset(runs, alone)
    groups = {
        "prompts grounded in their input (humaneval-edit, pydoc-qa)": ("humaneval-edit", "pydoc-qa"),
        "other prompts": None,
    }
    print("\n## speed against llama.cpp's target alone\n")
    print("| T | prompts | row | K | runs | tok/s | x target alone (CI) | accepted / step | drafted / step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for temperature in sorted({r["temperature"] for r in runs}):
        for group, names in groups.items():
            inside = names or tuple({r["dataset"] for r in runs} - grounded(groups))
            chosen = [r for r in runs if r["temperature"] == temperature and r["dataset"] in inside]
            for row in (row for row in ROWS if row != "llama-bench"):  # it has its own table, above
                these = [r for r in chosen if r["row"] == row]
                if not these:
                    continue
                ratios = [r["tok_s"] / alone[run_key(r)] for r in these]
                print(
                    f"| {temperature:g} | {group} | {row} | {these[0]['K']} | {len(these)} | "
                    f"{statistics.median(r['tok_s'] for r in these):.2f} | {interval(ratios)} | "
                    f"{mean_of(these, 'accepted_per_step')} | {mean_of(these, 'drafted_per_step')} |"
                )
    scored = [r for r in runs if "expected_block" in r]
    if scored:
        block_against_token(runs, scored)


def block_against_token(runs: list[dict], scored: list[dict]) -> None:
    """Per temperature, each block row's analytic accepted tokens per step under both rules on its own drafts
    (``scored``: the runs that scored them), and its measured ones against llama.cpp's own rule on the same prompts."""
    print("\n## block against token verification, and against llama.cpp's own rule\n")
    print(
        "| T | row | runs | analytic accepted / step token | block | analytic gain | measured accepted / step | "
        "llama.cpp-spec accepted / step | block / llama.cpp |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for temperature in sorted({r["temperature"] for r in scored}):
        spec = [r for r in runs if r["row"] == "llama.cpp-spec" and r["temperature"] == temperature]
        own = {run_key(r): r["accepted_per_step"] for r in spec}
        for row in ("llamacpp-block", "llamacpp-block-q4", "llamacpp-block-q4-cut"):
            these = [r for r in scored if r["row"] == row and r["temperature"] == temperature]
            if not these:
                continue
            token = statistics.fmean(r["expected_token"] for r in these)
            block = statistics.fmean(r["expected_block"] for r in these)
            measured = statistics.fmean(r["accepted_per_step"] for r in these)
            theirs = [own[run_key(r)] for r in these if run_key(r) in own]  # none in a run without llama.cpp-spec
            versus = (
                f"{statistics.fmean(theirs):.2f} | {measured / statistics.fmean(theirs):.2f}x" if theirs else "- | -"
            )
            print(
                f"| {temperature:g} | {row} | {len(these)} | {token:.3f} | {block:.3f} | {block / token - 1:+.1%} | "
                f"{measured:.2f} | {versus} |"
            )


def against(runs: list[dict], reference: str, alone: dict) -> None:
    """Every row against llama.cpp's own target alone, the ``reference`` run (llama-bench, or llama.cpp's own
    generation) beside it on the same prompt, temperature and seed, and against blockspec's target alone: per
    temperature and dataset, as the datasets differ in how much their answers copy."""
    print(f"\n## every row against {reference}, per dataset\n")
    print(f"| T | dataset | row | runs | tok/s | x {reference} (CI) | x target alone (CI) |")
    print("|---|---|---|---|---|---|---|")
    theirs = {run_key(r): r["tok_s"] for r in runs if r["row"] == reference}
    beside = [r for r in runs if r["row"] != reference and run_key(r) in theirs and run_key(r) in alone]
    for temperature, dataset, row, these in by_dataset(beside):
        print(
            f"| {temperature:g} | {dataset} | {row} | {len(these)} | "
            f"{statistics.median(r['tok_s'] for r in these):.2f} | "
            f"{interval([r['tok_s'] / theirs[run_key(r)] for r in these])} | "
            f"{interval([r['tok_s'] / alone[run_key(r)] for r in these])} |"
        )


def per_dataset(runs: list[dict], alone: dict) -> None:
    """Every row against blockspec's target alone on the same prompt, temperature and seed, per temperature and
    dataset: the table against llama-bench gives these figures beside its own where a run has llama-bench rows."""
    print("\n## every row against the target alone, per dataset\n")
    print("| T | dataset | row | runs | tok/s | x target alone (CI) | accepted / step | drafted / step |")
    print("|---|---|---|---|---|---|---|---|")
    for temperature, dataset, row, these in by_dataset(runs):
        print(
            f"| {temperature:g} | {dataset} | {row} | {len(these)} | "
            f"{statistics.median(r['tok_s'] for r in these):.2f} | "
            f"{interval([r['tok_s'] / alone[run_key(r)] for r in these])} | "
            f"{mean_of(these, 'accepted_per_step')} | {mean_of(these, 'drafted_per_step')} |"
        )


def by_dataset(runs: list[dict]):
    """(temperature, dataset, row, its runs) for each that has runs, in the tables' order (rows as ROWS lists them)."""
    for temperature in sorted({r["temperature"] for r in runs}):
        for dataset in sorted({r["dataset"] for r in runs}):
            for row in ROWS:
                these = [r for r in runs if (r["row"], r["temperature"], r["dataset"]) == (row, temperature, dataset)]
                if these:
                    yield temperature, dataset, row, these


def mean_of(runs: list[dict], key: str) -> str:
    """The mean of ``key`` over ``runs``, or "-" where a run does not know it."""
    values = [r[key] for r in runs]
    return "-" if None in values else f"{statistics.fmean(values):.2f}"


def grounded(groups: dict) -> set[str]:
    return {name for names in groups.values() if names for name in names}


if __name__ == "__main__":
    sys.exit(main())
