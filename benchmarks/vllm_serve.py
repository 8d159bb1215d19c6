# vLLM lives in its own environment (scripts/setup_vllm.sh), not in the one pyright checks:
# pyright: reportMissingImports=false
"""vLLM's own server (`vllm serve`) against blockspec's engine, on the bundled pair, the same prompts and seeds.

Four steps, each appending to or reading --out DIR (default results/vllm-serve):

    python benchmarks/vllm_serve.py prompts            # main env: the prompts' token ids (chat template), model dirs
    .venv-vllm/bin/python benchmarks/vllm_serve.py vllm    # vLLM's env: one server per configuration
    python benchmarks/vllm_serve.py blockspec          # main env: blockspec's engine on the same prompts
    python benchmarks/vllm_serve.py report             # either env: the tables

vllm: for each dtype and configuration (target-only; speculative decoding with a draft_model drafter and sampled
drafts, K tokens, verified by vLLM's token rule or blockspec's block rule, both through blockspec's plugin, which
also fixes vLLM CPU's temperature defect: vLLM CPU as shipped emits wrong tokens at temperature > 0), a `vllm
serve` on 127.0.0.1 is started, checked (its workers must run the rule asked for), warmed up and driven by the
official openai client at each concurrency: the first max(c, --requests) prompts, c requests in flight, every
request --max-new-tokens long (ignore_eos), its own seed. Acceptance comes from the server's /metrics. Then, for
the block rule, a server with BLOCKSPEC_VLLM_ANALYTIC=1 scores every step's drafts under both rules, one request
at a time (untimed): the paired analytic gain of block over token verification on vLLM's drafts. Configuration
block-cut is the block rule with each request's drafts verified only while the draft's top probability is at
least --min-draft-prob (the plugin's BLOCKSPEC_VLLM_MIN_DRAFT_PROB); block-sv the block rule with Speculative
Verification choosing what is drafted and verified, from the profiles --sv names (BLOCKSPEC_VLLM_SV).
blockspec: the same prompts at batch 1 (target-only, token and block at each K, with the same analytic scores)
and at each larger batch size (target-only).
Every configuration runs alone, one after the other (a server cannot switch rules): compare figures of one run
only. Every record holds the CPU flags, threads, vLLM's CPU binding and the commit.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

DATASETS = ("gsm8k", "humaneval")
PORT = 8631
BINDING = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}


def main(argv: list[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("prompts", "vllm", "blockspec", "report"), help="see above")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results/vllm-serve"),
        help="folder of prompts.json and records.jsonl (default: %(default)s)",
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts per dataset (prompts step)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="model dtypes, in turn")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["target-only", "token", "block"],
        help="target-only, token (vLLM's token rule), block (blockspec's block rule), block-cut "
        "(the block rule, drafts cut at --min-draft-prob), block-sv (the block rule, SV from --sv)",
    )
    parser.add_argument(
        "--min-draft-prob",
        type=float,
        default=0.3,
        help="block-cut: verify drafts while the draft's top probability is at least this",
    )
    parser.add_argument(
        "--sv",
        nargs=2,
        type=Path,
        metavar=("CALIBRATION", "LATENCY"),
        help="block-sv: SV's calibration profile (blockspec sv calibrate) and vLLM latency profile "
        "(python -m blockspec.vllm.profile)",
    )
    parser.add_argument("--max-draft", type=int, nargs="+", default=[2, 4], help="drafted tokens per step, K")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 4, 16],
        help="vllm: requests in flight; blockspec: batch sizes (target-only above 1)",
    )
    parser.add_argument("--requests", type=int, default=8, help="requests per concurrency level, at least c")
    parser.add_argument("--analytic-requests", type=int, default=8, help="requests scored under both rules")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (EOS ignored)")
    parser.add_argument("--temperature", type=float, default=1.0, help="top-p 1, top-k off")
    args = parser.parse_args(argv)
    if "block-sv" in args.configs and not args.sv:
        parser.error("--configs block-sv needs --sv CALIBRATION LATENCY")
    args.out.mkdir(parents=True, exist_ok=True)
    return {"prompts": write_prompts, "vllm": run_vllm, "blockspec": run_blockspec, "report": report}[args.step](args)


def write_prompts(args) -> None:
    from blockspec.bench.datasets import load
    from blockspec.models.cache import converted_dir
    from blockspec.models.chat import encode_prompt
    from blockspec.models.convert import load_preset_tokenizer

    tokenizer = load_preset_tokenizer("qwen2.5-coder-1.5b")
    prompts = [
        {"id": p.id, "ids": encode_prompt(tokenizer, p.text)} for name in DATASETS for p in load(name, args.prompts)
    ]
    random.Random(0).shuffle(prompts)  # each concurrency level takes a mix of both sets
    (args.out / "prompts.json").write_text(
        json.dumps(
            {
                # the bfloat16 copies blockspec keeps of the bundled GGUF files: what vLLM loads (in either dtype)
                "target": str(converted_dir("qwen2.5-coder-1.5b", "bfloat16")),
                "draft": str(converted_dir("qwen2.5-coder-0.5b", "bfloat16")),
                "prompts": prompts,
            }
        )
    )
    print(f"{len(prompts)} prompts -> {args.out / 'prompts.json'}")


def common(args, engine: str) -> dict:
    import provenance

    from blockspec import machine

    return {
        "engine": engine,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": provenance.commit(),
        "machine": {"platform": platform.platform(), **machine.facts()},
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
    }


def append(args, record: dict) -> None:
    with open(args.out / "records.jsonl", "a") as out:
        out.write(json.dumps(record) + "\n")


def configurations(args) -> list[tuple[str, int]]:
    return [(config, k) for config in args.configs for k in ([0] if config == "target-only" else args.max_draft)]


# --- vLLM ----------------------------------------------------------------------------------------------------------


def run_vllm(args) -> None:
    import vllm

    setup = json.loads((args.out / "prompts.json").read_text())
    for dtype in args.dtypes:
        for config, k in configurations(args):
            with Server(
                setup, dtype, config, k, analytic=False, min_draft_prob=args.min_draft_prob, sv=args.sv
            ) as server:
                base = {
                    **common(args, "vllm"),
                    "vllm": vllm.__version__,
                    "dtype": dtype,
                    "env": {**BINDING, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
                    "config": config,
                    "k": k,
                    "status": server.status(),
                }
                server.complete(setup["prompts"][0]["ids"][:32], 8, seed=0, temperature=args.temperature)  # warm-up
                for c in args.concurrency:
                    record = {
                        **base,
                        "concurrency": c,
                        **drive(server, setup["prompts"], c, args),
                        "cut": server.status()["cut"],
                    }
                    append(args, record)
                    print(summary_line(record), flush=True)
            if config == "block" and args.analytic_requests:
                with Server(setup, dtype, config, k, analytic=True) as server:
                    per_request = []
                    for i, prompt in enumerate(setup["prompts"][: args.analytic_requests]):
                        before = server.status()["analytic"]
                        server.complete(prompt["ids"], args.max_new_tokens, seed=1000 + i, temperature=args.temperature)
                        after = server.status()["analytic"]
                        per_request.append({key: after[key] - before[key] for key in after})
                    append(
                        args,
                        {**common(args, "vllm"), "dtype": dtype, "config": "analytic", "k": k, "analytic": per_request},
                    )
                    print(
                        f"vllm {dtype} analytic K={k}: BE token | block | gain {analytic_line(per_request)}", flush=True
                    )


class Server:
    """`vllm serve` on 127.0.0.1 with blockspec's plugin asked for ``config``'s rule; stopped on exit."""

    def __init__(self, setup, dtype, config, k, analytic, min_draft_prob=None, sv=None):
        self.url = f"http://127.0.0.1:{PORT}"
        # `vllm serve` itself: vllm-cpu 0.32.0's `vllm` command fails (it asks for the version of a distribution
        # named vllm, and this one is vllm-cpu), so the server module is started the way the command starts it
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            setup["target"],
            "--host",
            "127.0.0.1",
            "--port",
            str(PORT),
            "--dtype",
            dtype,
            "--max-model-len",
            "2048",
            "--seed",
            "0",
            "--served-model-name",
            "target",
            "--max-num-seqs",
            "16",
        ]
        env = {**os.environ, **BINDING, "VLLM_SERVER_DEV_MODE": "1", "BLOCKSPEC_VLLM_RULE": "token"}
        if config != "target-only":
            command += [
                "--speculative-config",
                json.dumps(
                    {
                        "method": "draft_model",
                        "model": setup["draft"],
                        "num_speculative_tokens": k,
                        "draft_sample_method": "probabilistic",
                        "rejection_sample_method": "standard",
                    }
                ),
            ]
            env["BLOCKSPEC_VLLM_RULE"] = config.removesuffix("-cut").removesuffix("-sv")
            if config == "block-cut":
                env["BLOCKSPEC_VLLM_MIN_DRAFT_PROB"] = str(min_draft_prob)
            if config == "block-sv":
                assert sv is not None  # main refuses block-sv without --sv
                env["BLOCKSPEC_VLLM_SV"] = os.pathsep.join(str(path.resolve()) for path in sv)
        if analytic:
            env["BLOCKSPEC_VLLM_ANALYTIC"] = "1"
        self.rule, self.command, self.env = env["BLOCKSPEC_VLLM_RULE"], command, env
        self.log = open(f"/tmp/vllm-serve-{dtype}-{config}-{k}.log", "w")

    def __enter__(self):
        self.process = subprocess.Popen(self.command, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}; see {self.log.name}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        else:
            raise TimeoutError(f"vllm serve did not come up in 900 s; see {self.log.name}")
        from openai import OpenAI

        from blockspec.vllm.status import check_server

        check_server(self.url, self.rule)

        self.client = OpenAI(base_url=self.url + "/v1", api_key="none", timeout=3600, max_retries=0)
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()

    def status(self) -> dict:
        """The worker's blockspec status, through vLLM's development endpoint (127.0.0.1 only)."""
        from blockspec.vllm.status import check_server

        return check_server(self.url, self.rule)[0]

    def metrics(self) -> dict[str, float]:
        """vLLM's speculative decoding counters."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=60).read().decode()
        counters = {}
        for line in text.splitlines():
            if line.startswith("vllm:spec_decode_num_") and "_total" in line and "per_pos" not in line:
                name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                counters[name] = counters.get(name, 0.0) + value
        return counters

    def complete(self, ids, max_tokens, seed, temperature) -> tuple[float, int]:
        start = time.perf_counter()
        response = self.client.completions.create(
            model="target",
            prompt=ids,
            max_tokens=max_tokens,
            seed=seed,
            temperature=temperature,
            top_p=1.0,
            extra_body={"ignore_eos": True, "top_k": 0},
        )
        return time.perf_counter() - start, response.usage.completion_tokens


def drive(server, prompts, c, args) -> dict:
    chosen = prompts[: max(c, args.requests)]
    before = server.metrics()
    start = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        results = list(
            pool.map(
                lambda item: server.complete(item[1]["ids"], args.max_new_tokens, 1000 + item[0], args.temperature),
                enumerate(chosen),
            )
        )
    wall = time.perf_counter() - start
    after = server.metrics()
    spec = {
        name.removeprefix("vllm:spec_decode_num_").removesuffix("_total"): after[name] - before.get(name, 0)
        for name in after
    }
    return {
        "requests": len(chosen),
        "wall_s": wall,
        "new_tokens": sum(n for _, n in results),
        "latencies_s": [t for t, _ in results],
        "spec": spec,
    }


# --- blockspec ----------------------------------------------------------------------------------------------------


def run_blockspec(args) -> None:
    import torch

    from blockspec import SamplingParams, SpeculativeDecoder
    from blockspec.models.load import load_model

    setup = json.loads((args.out / "prompts.json").read_text())
    sampling = SamplingParams(temperature=args.temperature)
    for dtype in args.dtypes:
        target, draft = load_model("qwen2.5-coder-1.5b", dtype=dtype), load_model("qwen2.5-coder-0.5b", dtype=dtype)
        base = {**common(args, "blockspec"), "torch": torch.__version__, "dtype": dtype}
        for config, k in configurations(args):
            decoder = (
                SpeculativeDecoder(target) if k == 0 else SpeculativeDecoder(target, draft, rule=config, max_draft=k)
            )
            decoder.generate([setup["prompts"][0]["ids"][:32]], max_new_tokens=8, sampling=sampling, seed=0)
            for batch in args.concurrency if k == 0 else [1]:
                chosen = setup["prompts"][: max(batch, args.requests)]
                groups = [chosen[i : i + batch] for i in range(0, len(chosen), batch)]
                latencies, new_tokens, analytic, steps = [], 0, [], []
                start = time.perf_counter()
                for g, group in enumerate(groups):
                    began = time.perf_counter()
                    result = decoder.generate(
                        [p["ids"] for p in group],
                        max_new_tokens=args.max_new_tokens,
                        sampling=sampling,
                        seed=[1000 + g * batch + i for i in range(len(group))],
                        stop_on_eos=False,
                        expected=k > 0,
                    )
                    latencies += [time.perf_counter() - began] * len(group)
                    new_tokens += result.new_tokens
                    steps += result.stats
                    if k:
                        analytic.append(
                            {
                                "rows": len(result.stats),
                                "token": sum(sum(s.expected_token) for s in result.stats),
                                "block": sum(sum(s.expected_block) for s in result.stats),
                            }
                        )
                record = {
                    **base,
                    "config": config,
                    "k": k,
                    "concurrency": batch,
                    "requests": len(chosen),
                    "wall_s": time.perf_counter() - start,
                    "new_tokens": new_tokens,
                    "latencies_s": latencies,
                    "spec": {
                        "accepted_tokens": sum(sum(s.accepted) for s in steps),
                        "draft_tokens": sum(sum(s.verified) for s in steps),
                    },
                }
                if analytic:
                    record["analytic"] = analytic
                append(args, record)
                print(summary_line(record), flush=True)


# --- report -------------------------------------------------------------------------------------------------------


def summary_line(record) -> str:
    return (
        f"{record['engine']} {record['dtype']} {record['config']} K={record['k']} c={record['concurrency']}: "
        f"{record['new_tokens'] / record['wall_s']:.2f} tok/s, mean latency "
        f"{sum(record['latencies_s']) / len(record['latencies_s']):.1f} s"
    )


def analytic_line(per_request) -> str:
    """Analytic BE of each rule, pooled, and the gain of block over token, (1 + sum E_block / steps) /
    (1 + sum E_token / steps) - 1, with its interval over requests."""
    token, block, rows = (sum(r[key] for r in per_request) for key in ("token", "block", "rows"))
    columns = {key: [r[key] for r in per_request] for key in ("token", "block", "rows")}
    gain = interval(columns, lambda s: (s["rows"] + s["block"]) / (s["rows"] + s["token"]) - 1, "{:+.1%}")
    return f"{1 + token / rows:.3f} | {1 + block / rows:.3f} | {gain}"


def interval(columns: dict[str, list[float]], statistic, form: str) -> str:
    """statistic of the columns' totals with the reports' 95 % percentile bootstrap interval, resampling the
    units the columns are aligned on (``blockspec.bench.report.stats.bootstrap``, one stratum)."""
    import numpy as np

    from blockspec.bench.report.stats import ReportConfig, bootstrap

    arrays = {name: np.asarray(values, float) for name, values in columns.items()}
    estimate = bootstrap(statistic, arrays, np.zeros(len(next(iter(arrays.values())))), ReportConfig())
    if estimate.lo is None:
        return form.format(estimate.value)
    return f"{form.format(estimate.value)} [{form.format(estimate.lo)}, {form.format(estimate.hi)}]"


def speed(record) -> float:
    return record["new_tokens"] / record["wall_s"]


def report(args) -> int:
    path = args.out / "records.jsonl"
    opened = open(path) if path.exists() else gzip.open(path.with_suffix(".jsonl.gz"), "rt")
    with opened as lines:
        records = [json.loads(line) for line in lines]
    timed = [r for r in records if r["config"] != "analytic"]
    machines = {(" ".join(r["machine"]["cpu_flags"]), r["machine"]["threads"]) for r in records}
    for flags, threads in sorted(machines):
        print(f"Machine: CPU flags {flags}; {threads} threads.")
    dates = sorted(r["date"] for r in records)
    commits = ", ".join(sorted({r["commit"] for r in records}))
    print(f"Records: {len(records)}, {dates[0]} to {dates[-1]}, commits {commits}.")

    def find(engine, dtype, config, k, c):
        return next(
            (
                r
                for r in timed
                if (r["engine"], r["dtype"], r["config"], r["k"], r["concurrency"]) == (engine, dtype, config, k, c)
            ),
            None,
        )

    print("\n## throughput\n")
    print(
        "| started (UTC) | engine | dtype | config | K | streams | requests | tok/s | x target-only | "
        "mean latency s | accepted / drafted |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in timed:
        alone = find(r["engine"], r["dtype"], "target-only", 0, r["concurrency"])
        spec = r.get("spec") or {}
        accepted = f"{spec['accepted_tokens'] / spec['draft_tokens']:.3f}" if spec.get("draft_tokens") else "-"
        print(
            f"| {r['date'][11:16]} | {r['engine']} | {r['dtype']} | {r['config']} | {r['k']} | {r['concurrency']} | "
            f"{r['requests']} | "
            f"{speed(r):.2f} | {f'{speed(r) / speed(alone):.3f}x' if alone else '-'} | "
            f"{sum(r['latencies_s']) / len(r['latencies_s']):.1f} | {accepted} |"
        )

    print("\n## target alone, vLLM and blockspec\n")
    print("| dtype | streams (vLLM) / batch (blockspec) | vLLM tok/s | blockspec tok/s | blockspec / vLLM |")
    print("|---|---|---|---|---|")
    for dtype in dict.fromkeys(r["dtype"] for r in timed):
        for c in sorted({r["concurrency"] for r in timed}):
            pair = find("vllm", dtype, "target-only", 0, c), find("blockspec", dtype, "target-only", 0, c)
            if all(pair):
                print(
                    f"| {dtype} | {c} | {speed(pair[0]):.2f} | {speed(pair[1]):.2f} | "
                    f"{speed(pair[1]) / speed(pair[0]):.3f}x |"
                )

    for new, old in (("block", "token"), ("block-cut", "block"), ("block-sv", "block")):
        wall_clock_ratios(timed, new, old)

    print("\n## paired analytic gain of block over token verification\n")
    print("| engine | dtype | drafts of | K | requests | analytic BE token | analytic BE block | analytic gain (CI) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        if r.get("analytic"):
            drafts = "block" if r["config"] == "analytic" else r["config"]
            print(
                f"| {r['engine']} | {r['dtype']} | {drafts} | {r['k']} | {len(r['analytic'])} | "
                f"{analytic_line(r['analytic'])} |"
            )
    return 0


def wall_clock_ratios(timed, new: str, old: str) -> None:
    """The section "{new} over {old}, wall clock": configuration ``new`` against ``old`` where both ran equally
    often at the same engine, dtype, K and streams (1 stream: paired over requests; more: each pass's ratio)."""
    rows = []
    done = set()
    for r in timed:
        key = (r["engine"], r["dtype"], r["k"], r["concurrency"])
        runs = {
            config: [
                o for o in timed if (o["engine"], o["dtype"], o["k"], o["concurrency"]) == key and o["config"] == config
            ]
            for config in (old, new)
        }
        if r["config"] != new or key in done or len(runs[old]) != len(runs[new]):
            continue
        done.add(key)
        before, after = (sum(o["new_tokens"] for o in runs[c]) / sum(o["wall_s"] for o in runs[c]) for c in (old, new))
        ratio = f"{after / before:.3f}x"
        if r["concurrency"] == 1:  # the same requests one at a time, run after run: pair them
            latencies = {c: [s for run in runs[c] for s in run["latencies_s"]] for c in (old, new)}
            ratio = interval(latencies, lambda s: s[old] / s[new], "{:.3f}x")
        elif len(runs[new]) > 1:  # requests share the batch: no pairing, but each pass's own ratio
            passes = (f"{speed(b) / speed(t):.3f}x" for t, b in zip(runs[old], runs[new]))
            ratio += f" (passes {', '.join(passes)})"
        rows.append(
            f"| {r['engine']} | {r['dtype']} | {r['k']} | {r['concurrency']} | {len(runs[new])} | "
            f"{before:.2f} | {after:.2f} | {ratio} |"
        )
    if not rows:
        return
    print(f"\n## {new} over {old}, wall clock\n")
    print(
        f"| engine | dtype | K | streams | runs each | tok/s {old} | tok/s {new} | {new} / {old} "
        "(1 stream: CI over requests; more: each pass) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
