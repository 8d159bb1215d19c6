"""The draft model's adaptive length replayed on greedy outputs: its predicted speed beside fixed lengths, exactly,
without timing noise.

Greedy, a drafted chain is accepted up to the first position where the draft's own best token, given the committed
text, is not the target's: so the steps any length policy takes on a prompt follow from one bit per output position,
whether the draft's argmax there is the target's greedy token. `record` decodes each prompt with the target alone
on llama.cpp and saves those bits (the draft reads the prompt and the output in one forward); `costs` measures the
step latency of both models (the target's forward over 1 to 9 tokens, the draft's over 1 to 16: a step that drafts
after plain steps first reads every token since it last drafted); `report` runs each policy over the bits as the
engine's loop does (what the draft has not read, the tokens left, what the policy learns from the positions a step
verified) and prices its steps with those costs: per dataset, its predicted speed over the target alone
(geometric mean over prompts), drafted tokens per step and the share of plain steps. The adaptive length (`auto`)
prices its choices with the draft's costs at the widths the engine's latency probe measures (DRAFT_TOKENS) alone;
the replay charges every step what the costs file says it costs. What the engine spends around each forward is left
out, and positions after a step's first rejected draft teach the policy the bit of the committed text there (the
engine's draft read its own rejected token there).

    python benchmarks/length_replay.py record --out benchmarks/results/RUN
    python benchmarks/length_replay.py costs --out benchmarks/results/RUN --name NAME   # once per machine or build
    python benchmarks/length_replay.py report --out benchmarks/results/RUN

`record` writes RUN/records.jsonl.gz, `costs` RUN/costs-NAME.json (a latency profile); `report` prints one section
per costs file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path

DATASETS = ("humaneval", "gsm8k", "sharegpt")
CATCH_UP_TOKENS = (1, 2, 4, 8, 16)  # the draft's widths `costs` measures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="the draft's agreement with the target's greedy output, to --out")
    rec.add_argument("--datasets", nargs="+", default=list(DATASETS))
    rec.add_argument("--prompts", type=int, default=8, help="per dataset")
    rec.add_argument("--seed", type=int, default=0, help="which prompts")
    rec.add_argument("--max-new-tokens", type=int, default=128)
    cost = sub.add_parser("costs", help="both models' step latency on this machine, to --out as costs-NAME.json")
    cost.add_argument("--name", required=True, help="what the costs were measured on, e.g. avx2-build")
    rep = sub.add_parser("report", help="each length policy's predicted speed over the target alone, per costs file")
    rep.add_argument("--fixed", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="fixed lengths to replay")
    for command in (rec, cost, rep):
        command.add_argument("--out", type=Path, required=True, help="the run's directory")
    for command in (rec, cost):
        command.add_argument("--target", default="qwen2.5-coder-1.5b")
        command.add_argument("--draft", default="qwen2.5-coder-0.5b")
        command.add_argument("--draft-quant", default="q4_0", help="as `blockspec generate` requantizes the draft")
    args = parser.parse_args(argv)
    {"record": record, "costs": costs, "report": report}[args.command](args)
    return 0


def load_pair(args):
    from blockspec.models.llamacpp import load_llamacpp

    return load_llamacpp(args.target), load_llamacpp(args.draft, quant=args.draft_quant)


def record(args) -> None:
    import torch

    from blockspec import SamplingParams, SpeculativeDecoder
    from blockspec.bench import datasets
    from blockspec.models.chat import encode_prompt

    target, draft = load_pair(args)
    decoder = SpeculativeDecoder(target)
    args.out.mkdir(parents=True, exist_ok=True)
    with gzip.open(args.out / "records.jsonl.gz", "wt") as out:
        for name in args.datasets:
            for prompt in datasets.load(name, n=args.prompts, seed=args.seed):
                ids = encode_prompt(target.tokenizer, prompt.text, chat=True)
                sampling = SamplingParams(temperature=0.0)
                output = decoder.generate([ids], max_new_tokens=args.max_new_tokens, sampling=sampling).sequences[0]
                best = {}  # model -> its argmax after the prompt and each output token but the last
                for role, model in (("draft", draft), ("target", target)):
                    model.prefill([ids[:-1]])
                    tokens = torch.tensor([ids[-1:] + output[:-1]])
                    best[role] = model.forward(tokens, torch.ones_like(tokens, dtype=torch.bool))[0].argmax(-1).tolist()
                    model.prefill([])
                match = "".join("1" if b == o else "0" for b, o in zip(best["draft"], output))
                # the target's batched forward agrees with its own one-token steps but for rare near-ties
                target_agrees = sum(b == o for b, o in zip(best["target"], output))
                line = {"dataset": name, "prompt": prompt.id, "max_new_tokens": args.max_new_tokens}
                out.write(json.dumps({**line, "match": match, "target_agrees": target_agrees}) + "\n")
                print(f"{prompt.id}: {len(output)} tokens, draft agrees at {match.count('1')}", flush=True)


def costs(args) -> None:
    from blockspec.auto import LATENCY_REPEATS, PROBE_CONTEXT, measure_profile
    from blockspec.defaults import ADAPTIVE_MAX_DRAFT

    target, draft = load_pair(args)
    tokens = tuple(range(1, ADAPTIVE_MAX_DRAFT + 2))
    profile = measure_profile(
        target,
        draft,
        batch_sizes=(1,),
        tokens=tokens,
        draft_tokens=CATCH_UP_TOKENS,
        context=PROBE_CONTEXT,
        repeats=LATENCY_REPEATS,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    profile.save(args.out / f"costs-{args.name}.json")
    print(f"saved {args.out / f'costs-{args.name}.json'}")


def replay_prompt(policy, match: str, max_new_tokens: int, costs) -> tuple[float, int, int, int]:
    """The engine's greedy loop over one prompt's agreement bits ``match`` under a ``LengthPolicy``: (its predicted
    speed over the target alone under ``costs``, steps, plain steps, drafted tokens)."""
    import torch

    policy.reset()
    done, catch_up, seconds, steps, plain, drafted = 0, 1, 0.0, 0, 0, 0
    while done < len(match):
        k = min(policy.draft_budget(1, catch_up), max_new_tokens - done - 1)
        agrees = [done + i < len(match) and match[done + i] == "1" for i in range(k)]
        accepted = agrees.index(False) if False in agrees else k
        if k:
            seconds += costs.drafting(1, k, catch_up, companion=False) + costs.target(1, k + 1)
            # the target's law one-hot at the draft's token (0) where they agree, else at another (1)
            best = torch.tensor([[0 if a else 1 for a in agrees] + [0]])
            target_probs = torch.nn.functional.one_hot(best, 2).float()
            verified, tau = torch.tensor([k]), torch.tensor([accepted])
            policy.observe([0], torch.zeros(1, k, dtype=torch.long), None, target_probs, verified, tau)
            catch_up = 2 if accepted == k else 1
        else:
            seconds += costs.target(1, 1)
            catch_up, plain = catch_up + 1, plain + 1
        done, steps, drafted = done + accepted + 1, steps + 1, drafted + k
    return len(match) * costs.target(1, 1) / seconds, steps, plain, drafted


def probed(costs):
    """``costs`` with the draft's widths cut to those the engine's latency probe measures: what ``auto`` sees."""
    from blockspec.policy import LatencyTable
    from blockspec.policy.latency import DRAFT_TOKENS, LatencyProfile

    draft = costs.draft
    seconds = tuple(tuple(draft(b, n) for n in DRAFT_TOKENS) for b in draft.batch_sizes)
    return LatencyProfile(costs.target, LatencyTable(draft.batch_sizes, DRAFT_TOKENS, seconds), None, costs.meta)


def adaptive_or_alone(latency):
    """What ``blockspec generate`` decodes with at batch 1: the adaptive length over ``latency``, or the target alone
    where even its prior acceptance cannot pay for a drafted token."""
    from blockspec.auto import adaptive_policy
    from blockspec.defaults import ADAPTIVE_MAX_DRAFT
    from blockspec.policy import FixedLength

    return adaptive_policy(latency, 1, ADAPTIVE_MAX_DRAFT) or FixedLength(0)


def report(args) -> None:
    from blockspec.policy import FixedLength
    from blockspec.policy.latency import LatencyProfile

    with gzip.open(args.out / "records.jsonl.gz", "rt") as lines:
        records = [json.loads(line) for line in lines]
    sets = defaultdict(list)
    for row in records:
        sets[row["dataset"]].append(row)
    sets["all"] = records
    agrees = sum(r["target_agrees"] for r in records) / sum(len(r["match"]) for r in records)
    print(f"The target's batched argmax agreed with its greedy output at {agrees:.1%} of positions.")
    for path in sorted(args.out.glob("costs-*.json")):
        truth = LatencyProfile.load(path)
        policies: dict[str, Callable[[], object]] = {f"fixed K={k}": partial(FixedLength, k) for k in args.fixed}
        policies["auto"] = partial(adaptive_or_alone, probed(truth))  # a fresh policy per prompt, as per call
        print(f"\n## predicted speed over the target alone, {path.stem}\n")
        milliseconds = ", ".join(f"{1000 * truth.target(1, n):.1f}" for n in range(1, 6))
        catch_up = ", ".join(f"{1000 * truth.draft(1, n):.1f}" for n in CATCH_UP_TOKENS)
        print(f"Target over 1-5 tokens {milliseconds} ms; draft over {CATCH_UP_TOKENS} tokens {catch_up} ms.\n")
        columns = ("dataset", "prompts", "policy", "predicted x target alone (geometric mean)", "drafted / step")
        print(f"| {' | '.join(columns)} | plain steps |\n|{'---|' * (len(columns) + 1)}")
        for name, rows in sets.items():
            for label, make in policies.items():
                runs = [replay_prompt(make(), r["match"], r["max_new_tokens"], truth) for r in rows]
                speed = statistics.geometric_mean(run[0] for run in runs)
                steps = sum(run[1] for run in runs)
                plain, drafted = sum(run[2] for run in runs) / steps, sum(run[3] for run in runs) / steps
                print(f"| {name} | {len(rows)} | {label} | {speed:.3f}x | {drafted:.2f} | {plain:.0%} |")


if __name__ == "__main__":
    raise SystemExit(main())
