"""Block verification against llama.cpp's rule, context by context, in exact expectations.

    python benchmarks/argmax_rule.py run --out results/argmax-rule
    python benchmarks/argmax_rule.py report --out results/argmax-rule   # records.jsonl, or records.jsonl.gz

llama.cpp's lossless speculative decoding (`llama-speculative-simple`, its server) drafts the draft's argmax and
accepts a drafted token when the target's own sample equals it. That is the token rule with a one-hot draft: the
same law and the same acceptance, a token x accepted with chance p(x). blockspec drafts by sampling the draft and
verifies the block with the draft's probabilities. Which accepts more per step at temperature T?

Measured on the wall clock, the two engines sample different texts, and a few prompts leave the answer to chance.
Here both rules start from the same contexts: the target's own text at T (decoded once per prompt, on llama.cpp),
every --stride-th position of it. At each context the draft drafts --max-draft tokens twice, its argmax chain and a
chain sampled at T, the target scores both, and the exact expected accepted length of a step drafting K of them is
computed for K = 1..--max-draft: llama.cpp's rule on the argmax chain (exact: nothing in it is random but the
target's coin), and the token and block rules on the sampled chain (exact given the chain; the chain is one draw).
The per-context figures are averaged over contexts; the ratio's interval resamples prompts within datasets.

What it leaves out: a decoder's steps start where its last step ended, not at every --stride-th position, and
llama.cpp's `--spec-draft-p-min` (0 here: it always drafts K). No timing: the figures do not depend on the
machine's load, so the run may share the machine. The records are a JSON line per prompt with every context's
figures; the report gives the mean over contexts per K and dataset, and the ratios with their intervals.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np
import torch

from blockspec import SamplingParams
from blockspec.bench.report.stats import ReportConfig, bootstrap
from blockspec.sampling import process, sample
from blockspec.verify import expected_accepted

RULES = ("llama.cpp", "token", "block")


def chain(draft, pending: int, k: int, law: SamplingParams, vocab: int, generator: torch.Generator | None):
    """From a draft whose cache holds the context less ``pending``: k tokens drafted after it, argmax
    (``generator`` None) or sampled at ``law``, and the laws they were drawn from [k, V]; the cache is left as
    it was found."""
    start = int(draft.lengths[0])
    token, tokens, probs = pending, [], []
    for _ in range(k):
        x = torch.tensor([[token]])
        q = process(draft.forward(x, torch.ones_like(x, dtype=torch.bool))[0, -1, :vocab].float(), law)
        uniform = None if generator is None else torch.rand(1, generator=generator, dtype=torch.float64)
        token = int(q.argmax()) if uniform is None else int(sample(q[None], uniform))
        tokens.append(token)
        probs.append(q)
    draft.rollback(torch.tensor([start]))
    return torch.tensor(tokens), torch.stack(probs)


def scored(target, pending: int, tokens: torch.Tensor, law: SamplingParams, vocab: int) -> torch.Tensor:
    """The target's laws [k+1, V] after ``pending`` and each of ``tokens``; its cache is left as it was found."""
    start = int(target.lengths[0])
    x = torch.cat([torch.tensor([pending]), tokens])[None]
    logits = target.forward(x, torch.ones_like(x, dtype=torch.bool))[0, :, :vocab].float()
    target.rollback(torch.tensor([start]))
    return process(logits, law)


def contexts(target, draft, ids: list[int], text: list[int], stride: int, k: int, law, vocab: int, seed: int):
    """Per context prompt + text[:t], t = 0, stride, ...: the expected accepted length of each rule at K = 1..k."""
    generator = torch.Generator().manual_seed(seed)
    sequence = ids + text
    for model in (target, draft):
        model.prefill([ids[:-1]])
    out = []
    for t in range(0, len(text), stride):
        at = len(ids) + t  # the context is sequence[:at]; the caches hold sequence[: at - 1]
        pending = sequence[at - 1]
        argmax_tokens, _ = chain(draft, pending, k, law, vocab, None)
        sampled_tokens, sampled_probs = chain(draft, pending, k, law, vocab, generator)
        p_argmax = scored(target, pending, argmax_tokens, law, vocab)
        p_sampled = scored(target, pending, sampled_tokens, law, vocab)
        row: dict[str, int | list[float]] = {"t": t}
        for name, tokens, probs, p, rule in (
            ("llama.cpp", argmax_tokens, None, p_argmax, "token"),
            ("token", sampled_tokens, sampled_probs, p_sampled, "token"),
            ("block", sampled_tokens, sampled_probs, p_sampled, "block"),
        ):
            row[name] = [
                float(
                    expected_accepted(
                        tokens[None, :n], None if probs is None else probs[None, :n], p[None, : n + 1], rule
                    )
                )
                for n in range(1, k + 1)
            ]
        out.append(row)
        advance = torch.tensor([sequence[at - 1 : min(at - 1 + stride, len(sequence) - 1)]])
        for model in (target, draft):
            model.forward(advance, torch.ones_like(advance, dtype=torch.bool))
    return out


def summary(prompts: list[dict], ks) -> list[dict]:
    """Per dataset and pooled ("all"), per K in ``ks``: the mean expected accepted length of each rule over the
    contexts, and the token and block rules' ratio to llama.cpp's rule with a percentile interval over prompts
    (resampled within their datasets)."""
    rows = []
    for dataset in [*sorted({p["dataset"] for p in prompts}), "all"]:
        chosen = [p for p in prompts if dataset in ("all", p["dataset"])]
        strata = np.array([p["dataset"] for p in chosen])
        count = sum(len(p["contexts"]) for p in chosen)
        for k in ks:
            columns = {rule: np.array([sum(c[rule][k - 1] for c in p["contexts"]) for p in chosen]) for rule in RULES}
            row = {"dataset": dataset, "K": k, "prompts": len(chosen), "contexts": count}
            row |= {rule: float(columns[rule].sum() / count) for rule in RULES}
            for rule in ("token", "block"):
                estimate = bootstrap(lambda s, r=rule: s[r] / s["llama.cpp"], columns, strata, ReportConfig())
                row[f"{rule}/llama.cpp"] = (estimate.value, estimate.lo, estimate.hi)
            rows.append(row)
    return rows


def ratio(estimate: tuple) -> str:
    value, lo, hi = estimate
    return f"{value:.3f}x" + ("" if lo is None else f" [{lo:.3f}, {hi:.3f}]")


def report(prompts: list[dict]) -> None:
    """The tables of the records: every K pooled over the datasets, then each dataset at K = 3 and the largest K."""
    flags = sorted({" ".join(p["cpu_flags"]) for p in prompts})
    print(f"Machine: CPU flags {'; '.join(flags)}; {prompts[0]['threads']} threads.\n")
    temperatures = sorted({p["temperature"] for p in prompts})
    largest = min(len(c["block"]) for p in prompts for c in p["contexts"])
    header = "| T | dataset | K | prompts | contexts | llama.cpp | token | block | token / llama.cpp (CI) | "
    header += "block / llama.cpp (CI) |"
    sections = (
        ("accepted tokens per step, by K", lambda r: r["dataset"] == "all", range(1, largest + 1)),
        ("accepted tokens per step, by dataset", lambda r: r["dataset"] != "all", sorted({min(3, largest), largest})),
    )
    for title, shown, ks in sections:
        print(f"## {title}\n")
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
        for temperature in temperatures:
            for r in summary([p for p in prompts if p["temperature"] == temperature], list(ks)):
                if shown(r):
                    print(
                        f"| {temperature:g} | {r['dataset']} | {r['K']} | {r['prompts']} | {r['contexts']} | "
                        f"{r['llama.cpp']:.3f} | {r['token']:.3f} | {r['block']:.3f} | {ratio(r['token/llama.cpp'])} | "
                        f"{ratio(r['block/llama.cpp'])} |"
                    )
        print()


def run(args) -> None:
    from blockspec import SamplingParams, SpeculativeDecoder, machine
    from blockspec.bench import datasets
    from blockspec.models.chat import encode_prompt
    from blockspec.models.load import load_model

    target = load_model(args.target, backend="llamacpp")
    draft = load_model(args.draft, backend="llamacpp")
    law = SamplingParams(temperature=args.temperature)
    decoder = SpeculativeDecoder(target, draft, max_draft=3)  # the text's law is the target's whatever decodes it
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / "records.jsonl").open("w") as records:
        for name in args.datasets:
            for i, prompt in enumerate(datasets.load(name, n=args.prompts, seed=0)):
                ids = encode_prompt(target.tokenizer, prompt.text, chat=True)
                text = decoder.generate([ids], max_new_tokens=args.max_new_tokens, sampling=law, seed=args.seed + i)
                found = contexts(
                    target,
                    draft,
                    ids,
                    text.sequences[0],
                    args.stride,
                    args.max_draft,
                    law,
                    decoder.vocab,
                    args.seed + i,
                )
                entry = {"prompt": prompt.id, "dataset": name, "temperature": args.temperature, **machine.facts()}
                records.write(json.dumps(entry | {"contexts": found}) + "\n")
                print(json.dumps(entry | {"contexts": len(found)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="measure, writing <out>/records.jsonl, then report")
    run_parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    run_parser.add_argument("--draft", default="qwen2.5-coder-0.5b", help="as shipped: llama.cpp-spec's draft")
    run_parser.add_argument(
        "--datasets", nargs="+", default=["humaneval", "humaneval-edit", "pydoc-qa", "gsm8k", "sharegpt"]
    )
    run_parser.add_argument("--prompts", type=int, default=6, help="per dataset (the bench's first ones, seed 0)")
    run_parser.add_argument("--max-new-tokens", type=int, default=128, help="of each prompt's text")
    run_parser.add_argument("--temperature", type=float, default=1.0)
    run_parser.add_argument("--max-draft", type=int, default=8, help="the largest K")
    run_parser.add_argument("--stride", type=int, default=8, help="tokens of the text between contexts")
    run_parser.add_argument(
        "--seed", type=int, default=0, help="prompt i of a dataset: its text and chains use seed + i"
    )
    for each in (run_parser, sub.add_parser("report", help="print the tables of <out>/records.jsonl(.gz)")):
        each.add_argument("--out", type=Path, default=Path("results/argmax-rule"))
    args = parser.parse_args(argv)
    if args.command == "run":
        if not args.temperature > 0:
            parser.error("--temperature must be > 0: greedy, both rules accept the same tokens")
        run(args)
    path = args.out / "records.jsonl.gz"
    text = gzip.open(path, "rt").read() if path.is_file() else (args.out / "records.jsonl").read_text()
    report([json.loads(line) for line in text.splitlines()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
