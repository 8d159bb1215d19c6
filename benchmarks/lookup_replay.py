"""Prompt lookup replayed on the target's outputs: what a lookup policy gains, exactly, without timing it.

Greedy, a proposal's accepted length is its common prefix with the target's own continuation, so the steps prompt
lookup takes on a prompt follow from the target's greedy output alone. Priced by a latency table (the target's
forward over 1 to 33 tokens), they predict lookup's speed over the target alone with no timing noise (what the engine
spends around each forward left out). A sampled output replays the same way, as one draw of lookup's sampled
decoding: a one-hot proposal of x is accepted with the chance p(x) that the target's own token is x, and after a
rejection the target's token has the law of its own draw given that it is not x, so accepting a proposal while it
agrees with the sampled output gives lookup's steps their law at that temperature. A change to how lookup chooses its
lengths can be weighed here on many prompts before it is timed on a few.

    python benchmarks/lookup_replay.py record --out results/lookup-greedy.jsonl --seed 1
    python benchmarks/lookup_replay.py replay --records results/lookup-greedy.jsonl

`record` decodes each dataset's prompts with the target alone on llama.cpp (chat-formatted, batch 1; greedy, or at
--temperature with prompt i of a dataset drawing from seed 1000 * --seed + i) and saves prompt and output ids (JSON
lines; --records may be gzipped). `replay` runs blockspec's `PromptLookup` and `LookupState` over them, with
this machine's cached `lookup_latency` table (measured once if missing) or `--costs`: per dataset the predicted speed
over the target alone (geometric mean over prompts, and the worst prompt) and proposals per step; per match-length
class, how often the first proposed token and the later ones were accepted.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

DATASETS = ("humaneval", "humaneval-edit", "pydoc-qa", "gsm8k", "sharegpt", "summarize", "translation")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="greedy outputs of the target alone, to --out (JSON lines)")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--target", default="qwen2.5-coder-1.5b")
    rec.add_argument("--datasets", nargs="+", default=list(DATASETS))
    rec.add_argument("--prompts", type=int, default=6, help="per dataset")
    rec.add_argument("--seed", type=int, default=0, help="which prompts (and sampled, their streams)")
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--temperature", type=float, default=0.0)
    rep = sub.add_parser("replay", help="predict prompt lookup's speed over the target alone on --records")
    rep.add_argument("--records", type=Path, required=True)
    rep.add_argument("--target", default="qwen2.5-coder-1.5b", help="whose cached lookup latency prices the steps")
    rep.add_argument("--costs", type=Path, help="a latency table (JSON, as blockspec.auto.lookup_latency caches it)")
    args = parser.parse_args(argv)
    if args.command == "record":
        record(args)
    else:
        replay(args)
    return 0


def record(args) -> None:
    from blockspec import SamplingParams, SpeculativeDecoder
    from blockspec.bench import datasets
    from blockspec.models.chat import encode_prompt
    from blockspec.models.llamacpp import load_llamacpp

    target = load_llamacpp(args.target)
    decoder = SpeculativeDecoder(target)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        for name in args.datasets:
            for i, prompt in enumerate(datasets.load(name, n=args.prompts, seed=args.seed)):
                ids = encode_prompt(target.tokenizer, prompt.text, chat=True)
                sampling, seed = SamplingParams(temperature=args.temperature), 1000 * args.seed + i
                result = decoder.generate([ids], max_new_tokens=args.max_new_tokens, sampling=sampling, seed=seed)
                line = {"dataset": name, "prompt": prompt.id, "max_new_tokens": args.max_new_tokens}
                out.write(json.dumps({**line, "ids": ids, "output": result.sequences[0]}) + "\n")
                print(f"{prompt.id}: {result.new_tokens} tokens", flush=True)


def replay_prompt(lookup, prompt: list[int], output: list[int], max_new_tokens: int):
    """Prompt lookup's greedy decoding of ``output`` after ``prompt``, step by step as the engine runs it (each step
    proposes from the committed context, within the tokens left, and commits the accepted prefix and one token
    more): (its predicted speed over the target alone under ``lookup.costs``, and its proposals as (match-length
    class, tokens proposed, tokens accepted))."""
    from blockspec.drafting.lookup import LookupState

    state, cost = LookupState(lookup, 1), lookup.costs
    done, seconds, proposals = 0, 0.0, []
    while done < len(output):
        tokens = state.propose([0], [prompt + output[:done]], [max_new_tokens - done - 1])[0]
        accepted = 0
        while accepted < len(tokens) and done + accepted < len(output) and tokens[accepted] == output[done + accepted]:
            accepted += 1
        if tokens:
            proposals.append((state.pending[0][0], len(tokens), accepted))
        seconds += cost(1, len(tokens) + 1)
        done += accepted + 1
    return len(output) * cost(1, 1) / seconds, proposals


def replay(args) -> None:
    from blockspec import PromptLookup
    from blockspec.auto import lookup_latency
    from blockspec.policy.latency import table_from_dict

    if args.costs:
        costs = table_from_dict(json.loads(args.costs.read_text()), args.costs)
    else:
        from blockspec.models.llamacpp import load_llamacpp

        costs = lookup_latency(load_llamacpp(args.target), 1)
    lookup = PromptLookup(costs=costs)
    speeds, steps, proposed = defaultdict(list), defaultdict(int), defaultdict(int)
    classes = defaultdict(lambda: [0, 0, 0, 0])  # class -> first accepted, first tried, later accepted, later tried
    opened = gzip.open(args.records, "rt") if args.records.suffix == ".gz" else args.records.open()
    with opened as lines:
        records = [json.loads(line) for line in lines]
    for row in records:
        speed, proposals = replay_prompt(lookup, row["ids"], row["output"], row["max_new_tokens"])
        speeds[row["dataset"]].append(speed)
        proposed[row["dataset"]] += len(proposals)
        steps[row["dataset"]] += len(row["output"]) - sum(accepted for _, _, accepted in proposals)
        for n, k, accepted in proposals:
            counts = classes[n]
            counts[0] += accepted > 0
            counts[1] += 1
            if accepted:
                counts[2] += accepted - 1
                counts[3] += accepted - 1 + (accepted < k)
    print("| dataset | prompts | predicted x target alone (geometric mean) | worst prompt | proposals / step |")
    print("|---|---|---|---|---|")
    for name, values in speeds.items():
        print(
            f"| {name} | {len(values)} | {statistics.geometric_mean(values):.3f}x | {min(values):.3f}x | "
            f"{proposed[name] / steps[name]:.2f} |"
        )
    print("\n| match-length class | first token accepted | later tokens accepted |")
    print("|---|---|---|")
    for n in sorted(classes):
        first, tried, later, later_tried = classes[n]
        rate = f"{later / later_tried:.2f} ({later} of {later_tried})" if later_tried else "-"
        print(f"| {n} | {first / tried:.2f} ({first} of {tried}) | {rate} |")


if __name__ == "__main__":
    raise SystemExit(main())
