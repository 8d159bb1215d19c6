# vLLM lives in its own environment (scripts/setup_vllm.sh), not in the one pyright checks:
# pyright: reportMissingImports=false
"""``python -m blockspec.vllm.profile``: the latency profile SV prices vLLM's steps with, measured in vLLM.

Run it in vLLM's environment, with the models, dtype and thread settings vLLM will serve with. It starts vLLM's
offline engine with the target, the draft drafting K tokens a step and blockspec's plugin, and for each batch
size B decodes B requests while every request's drafts are cut to w tokens, w = 0..K (a cut that ignores the
drafts: a stopping rule, exact). It times the target's forward (``execute_model``) over the steps where all B
requests decode w + 1 tokens each, and the drafting (``propose_draft_token_ids``) that follows them. The profile's
target table is seconds(B, w + 1). vLLM's drafting reads in its first forward every token the step scored (w + 1
a request), then drafts K - 1 more tokens one forward each: D(w) = F(B, w + 1) + (K - 1) F(B, 1), so with
F(B, 1) = D(0) / K the draft table is F(B, n) = D(n - 1) - (K - 1) D(0) / K, n = 1..K + 1, the forward a
width causes in the next step, which SV charges it (it runs whether or not the next step drafts).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from datetime import UTC, datetime

# TIMES and WIDTH live in vLLM's worker, where the functions taking a ``worker`` run (``llm.collective_rpc``)
TIMES = {"target": [], "draft": []}  # in the worker: (requests, tokens, seconds) of each forward timed
WIDTH: dict[str, int | None] = {"verified": None}  # in the worker: the drafts each request has verified (None: all)


def timing(worker) -> None:
    """Time the target's forward and the drafting of every step from now on."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = type(worker.model_runner)
    if getattr(runner.execute_model, "timed", False):
        return
    execute, propose = runner.execute_model, GPUModelRunner.propose_draft_token_ids

    def timed_execute(self, scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        output = execute(self, scheduler_output, *args, **kwargs)
        TIMES["target"].append(
            (
                len(scheduler_output.num_scheduled_tokens),
                scheduler_output.total_num_scheduled_tokens,
                time.perf_counter() - start,
            )
        )
        return output

    def timed_propose(self, scheduler_output, *args, **kwargs):
        start = time.perf_counter()
        drafts = propose(self, scheduler_output, *args, **kwargs)
        seconds = time.perf_counter() - start
        if hasattr(drafts, "shape"):  # a tensor [B, K]: nothing cut yet
            TIMES["draft"].append((drafts.shape[0], drafts.shape[1], seconds))
            if WIDTH["verified"] is not None:
                drafts = [row[: WIDTH["verified"]] for row in drafts.tolist()]
        return drafts

    timed_execute.timed = True
    runner.execute_model = timed_execute
    GPUModelRunner.propose_draft_token_ids = timed_propose


def verify(worker, width: int | None) -> None:
    """Every request verifies ``width`` of its drafts from now on; forget the times so far."""
    WIDTH["verified"] = width
    for times in TIMES.values():
        times.clear()


def times(worker) -> dict:
    return {name: list(entries) for name, entries in TIMES.items()}


def measure(llm, batch_sizes, max_draft: int, context: int, repeats: int, log=print) -> tuple[dict, dict]:
    """{B: [seconds(B, w + 1) for w = 0..K]} of the target, {B: [F(B, n) for n = 1..K + 1]} of the draft's first
    forward (the module's docstring): medians over at least ``repeats`` steps each, after one warm-up step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.collective_rpc(timing)
    target, draft = {}, {}
    for batch in batch_sizes:
        target[batch], drafting = [], []  # drafting[w]: seconds of the drafting after steps verifying w a request
        vocab = llm.llm_engine.model_config.get_vocab_size()
        prompts = [
            TokensPrompt(prompt_token_ids=[2 + (7 * request + i) % min(vocab - 2, 4096) for i in range(context)])
            for request in range(batch)
        ]  # ordinary tokens, a different prompt for each request
        for width in range(max_draft + 1):
            llm.collective_rpc(verify, args=(width,))
            params = [
                SamplingParams(max_tokens=(repeats + 2) * (width + 1), ignore_eos=True, seed=request, temperature=1.0)
                for request in range(batch)
            ]
            llm.generate(prompts, params, use_tqdm=False)
            timed = llm.collective_rpc(times)[0]
            steps = [
                seconds
                for requests, tokens, seconds in timed["target"]
                if requests == batch and tokens == batch * (width + 1)
            ][1:]
            if len(steps) < repeats // 2:
                raise RuntimeError(
                    f"only {len(steps)} decoding steps of {batch} requests verifying {width} drafts "
                    "each were seen: is vLLM's batch limit (max_num_seqs) below the batch size?"
                )
            target[batch].append(round(statistics.median(steps), 6))
            drafted = [seconds for requests, k, seconds in timed["draft"] if requests == batch and k == max_draft][1:]
            if not drafted:
                raise RuntimeError(
                    f"no drafting of {batch} requests and {max_draft} drafts each was timed after the first: did vLLM "
                    "draft (its speculative config)?"
                )
            drafting.append(statistics.median(drafted))
            log(
                f"B={batch} w={width}: target {target[batch][-1] * 1e3:.1f} ms over {len(steps)} steps, "
                f"drafting {drafting[width] * 1e3:.1f} ms"
            )
        draft[batch] = first_forward_seconds(drafting, max_draft)
    llm.collective_rpc(verify, args=(None,))
    return target, draft


def first_forward_seconds(drafting: list[float], max_draft: int) -> list[float]:
    """The draft's first forward F(B, n), n = 1..K + 1, from the drafting D(w) timed after steps that verified
    w = 0..K drafts a request (the module's docstring): D(w) - (K - 1) D(0) / K, with F(B, 1) = D(0) / K."""
    later = (max_draft - 1) * drafting[0] / max_draft  # the K - 1 one-token forwards after the first
    # a forward takes no less than nothing, whatever the timing noise
    return [round(max(seconds - later, 0.0), 6) for seconds in drafting]


def profile(
    llm,
    target_name: str,
    draft_name: str,
    dtype: str,
    batch_sizes,
    max_draft: int,
    context: int,
    repeats: int,
    log=print,
):
    """The LatencyProfile of this vLLM engine (``measure``), with what it was measured on."""
    import torch

    from ..machine import cpu_flags
    from ..policy.base import LatencyTable
    from ..policy.latency import LatencyProfile

    target, draft = measure(llm, batch_sizes, max_draft, context, repeats, log)
    sizes = tuple(sorted(target))
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "target": target_name,
        "draft": draft_name,
        "companion": None,
        "dtype": dtype,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.platform(),
        "processor": " ".join([platform.processor() or platform.machine(), *cpu_flags()]),
        "context": context,
        "repeats": repeats,
    }
    return LatencyProfile(
        LatencyTable(sizes, tuple(range(1, max_draft + 2)), tuple(tuple(target[b]) for b in sizes)),
        LatencyTable(sizes, tuple(range(1, max_draft + 2)), tuple(tuple(draft[b]) for b in sizes)),
        None,
        meta,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m blockspec.vllm.profile",
        description=(__doc__ or "").split("\n\n")[1],
        epilog="Then serve with BLOCKSPEC_VLLM_RULE=block BLOCKSPEC_VLLM_SV=<calibration>:<latency> (the calibration "
        "profile from `blockspec sv calibrate`, made on blockspec's side of the same pair).",
    )
    parser.add_argument("--target", required=True, help="the target model, as vLLM is given it (a path)")
    parser.add_argument("--draft", required=True, help="the draft model, as vLLM is given it")
    parser.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (default: %(default)s)")
    parser.add_argument("--max-draft", type=int, default=4, help="tokens drafted a step, K (default: %(default)s)")
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1, 4, 16],
        help="requests decoding at once (default: %(default)s)",
    )
    parser.add_argument("--context", type=int, default=160, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=8, help="steps timed per point, at least (default: %(default)s)")
    parser.add_argument("--out", required=True, help="where to write the latency profile (JSON)")
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.max_draft < 1:
        parser.error("batch sizes and --max-draft must be at least 1")

    from vllm import LLM

    from ..policy.latency import dtype_name
    from .status import check
    from .switches import CUT_SWITCH, SV_SWITCH, SWITCH

    os.environ.setdefault(SWITCH, "block")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # sends the timing functions above to vLLM's worker
    for switch in (CUT_SWITCH, SV_SWITCH):  # the cut here is the profile's own
        os.environ.pop(switch, None)
    llm = LLM(
        model=args.target,
        dtype=args.dtype,
        seed=0,
        max_num_seqs=max(args.batch_sizes),
        max_model_len=args.context + (args.repeats + 2) * (args.max_draft + 1) + args.max_draft + 8,
        speculative_config={
            "method": "draft_model",
            "model": args.draft,
            "num_speculative_tokens": args.max_draft,
            "draft_sample_method": "probabilistic",
            "rejection_sample_method": "standard",
        },
    )
    check(llm)
    result = profile(
        llm,
        args.target,
        args.draft,
        dtype_name(llm.llm_engine.model_config.dtype),  # "auto" resolved: what the plugin compares with at serving
        sorted(set(args.batch_sizes)),
        args.max_draft,
        args.context,
        args.repeats,
    )
    result.save(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    # run as blockspec.vllm.profile, not __main__: functions of __main__ reach vLLM's worker as copies, each with
    # its own TIMES, while the module's are found there by name
    from blockspec.vllm.profile import main as run

    run()
