"""Tree speculation, go or no-go: how often one of k distinct draft candidates is accepted (k = 1..4), measured
offline on the bench's prompts, and the speed this predicts for tree shapes against chains, from measured costs.

    python benchmarks/forward_costs.py --variants qwen2.5-coder-1.5b:bfloat16:int8 qwen2.5-coder-0.5b:bfloat16:int8 \\
        --tokens 1 2 3 4 5 6 8 10 12 16 24 32 48 64 --context 384 --out costs.json
    python benchmarks/tree_plan.py --costs costs.json --out plan.json
    python benchmarks/tree_plan.py --costs costs.json --acceptance plan.json --out plan2.json  # re-predict only

Acceptance. For each prompt and temperature the target writes --max-new-tokens tokens (sampled with a fixed seed,
or greedy); at every position t the target's processed distribution P_t and the draft's Q_t (the draft reading
the same text) are kept. alpha_k(t) is the probability that token-level verification (recursive rejection
sampling) accepts one of k candidates drawn from Q_t without replacement: exact given the candidates
(``expected_accepted_tree`` on a one-level tree), averaged over --draws candidate sets; alpha_1(t) is
sum_v min(P_t, Q_t) exactly. At temperature 0 the
candidates are the draft's k most likely tokens and alpha_k(t) says whether the target's argmax is among them.
P_t and Q_t are kept on the fewest tokens most likely under P_t + Q_t that leave out less than --rest of each,
plus one token holding the rest; the mass left out, which bounds the error this makes, is reported.

Prediction for a shape (k_1, ..., k_d), the children per node at each depth (a chain is all ones). A step that
starts at position t accepts E(t) = sum_j prod_{i <= j} alpha_{k_i}(t + i - 1) tokens in expectation, treating each
level's acceptance as depending on its position only; BE = 1 + the mean of E(t) over the positions. A step costs
the target's forward over the N + 1 tokens (N nodes), one draft forward per level over that level's parents
(1, n_1, ..., n_{d-1} tokens), and the time to draw the candidates and verify the tree (timed here, on synthetic
distributions over the target's vocabulary):
    speedup over the target alone = BE * t_T(1) / (t_T(N + 1) + sum_levels t_D(n) + overhead(N)).
The perfect-acceptance bound sets BE = d + 1. Forward costs are the medians of --costs (``forward_costs.py``:
forward and logits processing), interpolated linearly between the token counts measured; that file's variants
name the target and draft arithmetic. The target's tree forward is costed as a causal forward over as many
tokens (an ancestor mask changes only the attention's mask, not its size).

The acceptance and the prediction are the library's (``blockspec.policy.shapes``, which ``AdaptiveShape`` chooses each
step's shape by in the engine, from alpha learnt online instead).

Intervals: 95 % percentile bootstrap over the prompts (2000 resamples, seed 0), the best chain re-chosen in every
resample. Prints the tables; the last stdout line is the JSON also saved to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch

from blockspec.policy.shapes import (
    WIDTHS,
    candidate_acceptance,
    expected_accepted,
    level_sizes,
    ranked_acceptance,
    step_cost,
    tree_nodes,
    tree_shapes,
)

VOCAB = 151936  # the bundled pair's: the synthetic trees timed for the overhead span it
DATASETS = ("gsm8k", "translation", "humaneval", "sharegpt", "summarize", "lm1b")  # the paper preset's


def quant_name(text: str) -> str | None:
    """--target-quant / --draft-quant: "none" for an unquantized model."""
    return None if text == "none" else text


# --- acceptance, offline --------------------------------------------------------------------------------------


def write_and_read(
    target, draft, prompt: list[int], temperature: float, new_tokens: int, vocab: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The target writes up to ``new_tokens`` tokens after ``prompt``; returns the target's and the draft's logits
    [L, vocab] float32 at every written position (the draft reads the same text in one forward)."""
    from blockspec.sampling import SamplingParams, process, sample

    params = SamplingParams(temperature=temperature)
    for model in (target, draft):
        model.prefill([prompt[:-1]])
    one = torch.ones(1, 1, dtype=torch.bool)
    token, written, logits = prompt[-1], [], []
    for _ in range(new_tokens):
        step = target.forward(torch.tensor([[token]]), one)[0, -1, :vocab].float()
        uniform = torch.rand(1, generator=generator, dtype=torch.float64)
        token = int(sample(process(step[None], params), uniform)[0])
        logits.append(step)
        written.append(token)
        if token in target.eos_token_ids:
            break
    read = torch.tensor([[prompt[-1]] + written[:-1]])
    draft_logits = draft.forward(read, torch.ones_like(read, dtype=torch.bool))[0, :, :vocab].float()
    return torch.stack(logits), draft_logits


def acceptance(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    temperature: float,
    draws: int,
    rest: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha [L, WIDTHS], left [L, 2]): alpha[t, k - 1] = alpha_k(t); left = the mass of P_t, Q_t left out."""
    from blockspec.sampling import SamplingParams, process

    if temperature == 0:
        return ranked_acceptance(target_logits, draft_logits), torch.zeros(len(target_logits), 2, dtype=torch.float64)
    params = SamplingParams(temperature=temperature)
    p, q = process(target_logits, params), process(draft_logits, params)
    return candidate_acceptance(p, q, draws=draws, rest=rest, generator=generator)


def measure_acceptance(args) -> list[dict]:
    """One entry per (prompt, temperature): its alpha [L, WIDTHS] as lists, and the mass left out."""
    from blockspec.bench import datasets
    from blockspec.models.base import target_vocabulary
    from blockspec.models.chat import encode_prompt
    from blockspec.models.load import load_model

    target = load_model(args.target, dtype=args.dtype, quant=args.target_quant, progress=False)
    draft = load_model(args.draft, dtype=args.dtype, quant=args.draft_quant, progress=False)
    vocab = target_vocabulary(target)
    generator = torch.Generator().manual_seed(args.seed)
    sequences = []
    prompts = [p for name in args.datasets for p in datasets.load(name, n=args.prompts, seed=args.seed)]
    for n, prompt in enumerate(prompts):
        ids = encode_prompt(target.tokenizer, prompt.text)
        for temperature in args.temperatures:
            start = time.perf_counter()
            with torch.inference_mode():
                target_logits, draft_logits = write_and_read(
                    target, draft, ids, temperature, args.max_new_tokens, vocab, generator
                )
                alpha, rest = acceptance(target_logits, draft_logits, temperature, args.draws, args.rest, generator)
            sequences.append(
                {
                    "prompt": prompt.id,
                    "dataset": prompt.dataset,
                    "temperature": temperature,
                    "alpha": alpha.round(decimals=5).tolist(),
                    "rest_max": rest.max(0).values.tolist(),
                    "rest_mean": rest.mean(0).tolist(),
                }
            )
            print(
                f"[{n + 1}/{len(prompts)}] {prompt.id} T={temperature}: {len(alpha)} positions, alpha_1..4 = "
                + " ".join(f"{a:.3f}" for a in alpha.mean(0).tolist())
                + f" ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    return sequences


# --- costs ----------------------------------------------------------------------------------------------------


def forward_cost(costs: dict, variant: str):
    """t(n) in ms for a variant of a forward_costs.py result, interpolated linearly between measured n (the
    engine's own ``LatencyTable``, at batch 1); n outside the measured range is refused, not extrapolated."""
    from blockspec.policy.base import LatencyTable

    measured = sorted((int(n), ms) for n, ms in costs["ms"][variant].items())
    tokens, ms = zip(*measured)
    table = LatencyTable((1,), tokens, (ms,))

    def cost(n: int) -> float:
        if not tokens[0] <= n <= tokens[-1]:
            raise ValueError(f"{variant}: {n} tokens lie outside the measured {tokens[0]}..{tokens[-1]}")
        return table(1, n)

    return cost


def synthetic_tree(shape: tuple[int, ...], vocab: int, generator: torch.Generator):
    """A tree of ``shape`` over softmax-of-Gaussian distributions (draft correlated with target), nodes numbered
    level by level, its candidates drawn without replacement: what a step would hand to verification."""
    parents, level = [], [0]
    for k in shape:
        first = len(parents) + 1
        parents += [parent for parent in level for _ in range(k)]
        level = list(range(first, len(parents) + 1))
    count = len(parents)
    target_logits = 3.0 * torch.randn(1, count + 1, vocab, generator=generator)
    draft_probs = (target_logits + torch.randn(1, count + 1, vocab, generator=generator)).softmax(-1)
    return torch.tensor([parents]), draft_probs, target_logits.softmax(-1)


def overhead_ms(shape: tuple[int, ...], vocab: int, repeats: int, generator: torch.Generator) -> float:
    """Median ms to draw a tree's candidates and verify it at batch 1, as the engine would: each level's children
    by sequential sampling without replacement (one inversion per child over its parent's renormalised row, all
    of a level's parents at once) and verification by the rule the engine runs (the chain's ``verify_block`` for
    a chain, Traversal Verification for a tree), without input validation."""
    from blockspec.sampling import sample
    from blockspec.verify import verify_block
    from blockspec.verify.tree import verify_tree_block

    parents, draft_probs, target_probs = synthetic_tree(shape, vocab, generator)
    levels, first = [torch.tensor([0])], 1
    for size in level_sizes(shape)[:-1]:
        levels.append(torch.arange(first, first + size))
        first += size
    times = []
    for _ in range(repeats + 1):  # the first call warms up and is dropped
        start = time.perf_counter()
        tokens = []
        for level, k in zip(levels, shape):
            left, children = draft_probs[0, level], []  # [n, V]: the level's parents' rows
            for _ in range(k):
                drawn = sample(left, torch.rand(len(level), generator=generator, dtype=torch.float64))
                children.append(drawn)
                left = left.scatter(-1, drawn[:, None], 0.0)
            tokens.append(torch.stack(children, 1).reshape(-1))  # each parent's children together
        tokens = torch.cat(tokens)[None]
        if max(shape) == 1:
            verify_block(tokens, draft_probs[:, :-1], target_probs, generator=generator, validate=False)
        else:
            verify_tree_block(
                tokens, parents, draft_probs, target_probs, scheme="distinct", generator=generator, validate=False
            )
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times[1:])


# --- prediction -----------------------------------------------------------------------------------------------


def step_sums(alpha: np.ndarray, shape: tuple[int, ...]) -> tuple[float, int]:
    """(sum over start positions t of E(t), number of start positions) for one sequence's alpha [L, WIDTHS]: the
    library's ``expected_accepted`` of a step starting at t, level i reading alpha at t + i."""
    positions = len(alpha) - len(shape) + 1
    if positions <= 0:
        return 0.0, 0
    windows = np.stack([alpha[i : i + positions] for i in range(len(shape))], 1)  # [positions, d, WIDTHS]
    return float(expected_accepted(torch.from_numpy(windows), shape).sum()), positions


def predict(sequences: list[dict], shapes, cost_target, cost_draft, overhead: dict, resamples: int) -> dict:
    """Per shape: BE, the perfect-acceptance bound, and the predicted speedup over the target alone and over the
    best chain, with the measured overhead and with none ("free": a bound on what faster verification could give)."""
    table = np.array([[step_sums(np.array(s["alpha"]), shape) for shape in shapes] for s in sequences])
    sums, counts = table[..., 0], table[..., 1]  # [prompts, shapes]
    picks = np.random.default_rng(0).integers(len(sequences), size=(resamples, len(sequences)))
    weights = np.vstack([np.ones(len(sequences))] + [np.bincount(p, minlength=len(sequences)) for p in picks])
    be = 1 + (weights @ sums) / np.maximum(weights @ counts, 1)  # [1 + R, shapes]; row 0: the prompts as measured
    forwards = np.array([step_cost(s, cost_target, cost_draft) for s in shapes])
    extra = np.array([overhead[s] for s in shapes])
    plain, chains = cost_target(1), np.array([max(s) == 1 for s in shapes])
    rows = [
        {
            "shape": list(s),
            "depth": len(s),
            "nodes": tree_nodes(s),
            "be": round(float(be[0, j]), 4),
            "forward_ms": round(float(forwards[j]), 1),
            "overhead_ms": round(float(extra[j]), 2),
            "bound": round((len(s) + 1) * plain / float(forwards[j] + extra[j]), 4),
        }
        for j, s in enumerate(shapes)
    ]
    for key, step_ms in (("measured", forwards + extra), ("free", forwards)):
        speedup = be * plain / step_ms
        ratio = speedup / speedup[:, chains].max(1, keepdims=True)  # the best chain re-chosen per resample
        for j, row in enumerate(rows):
            lo, hi = np.percentile(ratio[1:, j], [2.5, 97.5])
            row[key] = {
                "speedup": round(float(speedup[0, j]), 4),
                "vs_best_chain": round(float(ratio[0, j]), 4),
                "ci": [round(float(lo), 4), round(float(hi), 4)],
            }
    return {"target_ms_1": plain, "shapes": rows}


def show(temperature: float, prediction: dict, top: int) -> None:
    rows = prediction["shapes"]
    chains = [r for r in rows if max(r["shape"]) == 1]
    trees = sorted((r for r in rows if max(r["shape"]) > 1), key=lambda r: -r["measured"]["speedup"])
    print(f"\nT={temperature}: chains, then the {top} trees predicted fastest; speedups over the target alone")
    print(
        f"{'shape':>12s} {'nodes':>5s} {'BE':>6s} {'fwd ms':>7s} {'ovh ms':>7s} {'bound':>6s} {'speedup':>8s}"
        f" {'x best chain (CI)':>24s} {'free ovh':>8s} {'x best chain (CI)':>24s}"
    )
    for r in chains + trees[:top]:
        cells = "".join(
            f" {r[k]['speedup']:8.3f} {r[k]['vs_best_chain']:8.3f} [{r[k]['ci'][0]:.3f}, {r[k]['ci'][1]:.3f}]"
            for k in ("measured", "free")
        )
        print(
            f"{','.join(map(str, r['shape'])):>12s} {r['nodes']:5d} {r['be']:6.3f} {r['forward_ms']:7.1f}"
            f" {r['overhead_ms']:7.2f} {r['bound']:6.3f}{cells}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--costs", required=True, help="a forward_costs.py result file")
    parser.add_argument("--target-variant", default="qwen2.5-coder-1.5b:bfloat16:int8", help="a variant in --costs")
    parser.add_argument("--draft-variant", default="qwen2.5-coder-0.5b:bfloat16:int8", help="a variant in --costs")
    parser.add_argument("--acceptance", help="reuse the acceptance of an earlier result file instead of measuring it")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--target-quant", default="int8", type=quant_name, help="int8, or none")
    parser.add_argument("--draft-quant", default="int8", type=quant_name, help="int8, or none")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--prompts", type=int, default=4, help="per dataset")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draws", type=int, default=16, help="candidate sets per position")
    parser.add_argument(
        "--rest", type=float, default=1e-4, help="the most mass of P_t or Q_t left out of a position's support"
    )
    parser.add_argument("--max-depth", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per shape for the overhead")
    parser.add_argument("--top", type=int, default=12, help="trees shown per temperature")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/tree_plan.json")
    args = parser.parse_args()

    import provenance

    from blockspec import machine

    costs = json.loads(Path(args.costs).read_text())
    cost_target, cost_draft = forward_cost(costs, args.target_variant), forward_cost(costs, args.draft_variant)
    most = max(int(n) for n in costs["ms"][args.target_variant]) - 1
    shapes = tree_shapes(args.max_depth, most)
    if args.acceptance:
        earlier = json.loads(Path(args.acceptance).read_text())
        sequences, measured = earlier["sequences"], earlier["acceptance"]
    else:
        sequences, measured = (
            measure_acceptance(args),
            {
                k: v
                for k, v in vars(args).items()
                if k
                in (
                    "target",
                    "draft",
                    "dtype",
                    "target_quant",
                    "draft_quant",
                    "datasets",
                    "prompts",
                    "max_new_tokens",
                    "draws",
                    "rest",
                    "seed",
                )
            }
            | {"machine": machine.facts()},
        )
    generator = torch.Generator().manual_seed(args.seed)
    start = machine.cpu_clock()
    overhead = {s: overhead_ms(s, VOCAB, args.repeats, generator) for s in shapes}
    load = machine.others_load(start, machine.cpu_clock())
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "commit": provenance.commit(),
        "command": "python benchmarks/tree_plan.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if v is not None
        ),
        **machine.facts(),
        **load,
        "costs": {
            "file": args.costs,
            "date": costs["date"],
            "cpu_flags": costs["cpu_flags"],
            "context": costs["context"],
        },
        "acceptance": measured,
        "predictions": {},
    }
    for temperature in sorted({s["temperature"] for s in sequences}, reverse=True):
        group = [s for s in sequences if s["temperature"] == temperature]
        alpha = np.concatenate([np.array(s["alpha"]) for s in group])
        print(
            f"\nT={temperature}: {len(group)} prompts, {len(alpha)} positions; mean alpha_1..{WIDTHS} = "
            + " ".join(f"{a:.3f}" for a in alpha.mean(0))
            + f"; mass left out of P, Q: mean {np.mean([s['rest_mean'] for s in group], 0).round(6).tolist()},"
            f" max {np.max([s['rest_max'] for s in group], 0).round(6).tolist()}"
        )
        prediction = predict(group, shapes, cost_target, cost_draft, overhead, resamples=2000)
        prediction["alpha_mean"] = alpha.mean(0).round(4).tolist()
        result["predictions"][str(temperature)] = prediction
        show(temperature, prediction, args.top)
    result["sequences"] = sequences
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "sequences"}))


if __name__ == "__main__":
    main()
