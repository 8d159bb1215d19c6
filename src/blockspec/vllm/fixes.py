# vLLM lives in its own environment (scripts/setup_vllm.sh), not in the one pyright checks:
# pyright: reportMissingImports=false
"""What the plugin fixes in vLLM 0.32 under either rule: vLLM CPU's expand kernel, seeded requests' drafts drawn
from the global generator, vLLM CPU's death on a seeded request prefilled in chunks, and (refused, not fixed)
structured outputs with sampled drafts. Each defect, how it shows and why: docs/guide/vllm.md."""

from __future__ import annotations

import torch

from .state import STATE


def expand_in_place(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's expand kernel, correct for every dtype: request b's value (``replace_from`` -> ``replace_to``)
    written to its rows cu[b-1]..cu[b]-1 of ``output``, in place."""
    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input_val == replace_from, torch.tensor(replace_to, dtype=input_val.dtype), input_val)
    # cu [2, 2, 5] -> counts [2, 0, 3]; values [ta, tb, tc] -> output [ta, ta, tc, tc, tc]
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
        # 2 tokens a request: rows [a1, a2, b1, b2], request 1 (b) -> rows 2:4 = [b1, b2]
        rows = slice(request * per_request, (request + 1) * per_request)
        noise = empty_exponential_noise_like(probs[rows], self.use_fp64_gumbel).exponential_(generator=generator)
        tokens[rows] = sample_with_exponential_noise(probs[rows].clone(), noise)
    return tokens, probs


class ChunkDraws(torch.Generator):
    """A copy of a request's CPU generator that takes the draws vLLM throws away with a prefill chunk's sample;
    vLLM's rewind of it (``set_offset``, which only CUDA generators have) has nothing to undo."""

    def __new__(cls, original: torch.Generator):
        # torch's stub declares only __init__; the C type takes the device in __new__
        copy = super().__new__(cls, original.device)  # pyright: ignore[reportCallIssue]
        copy.set_state(original.get_state())
        return copy

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        pass


def sample_with_chunk_draws_apart(self, grammar_output):
    """vLLM's ``sample_tokens`` with the CPU generator of each request whose sample this step discards (its prompt
    is still being prefilled) replaced by a ``ChunkDraws`` copy for the step: the request's own generator never
    sees those draws, as vLLM's rewind intends on CUDA, and vLLM's rewind no longer kills the CPU engine. While it
    samples, ``STATE.req_ids`` names the batch's requests, by which the verification step counts acceptance."""
    generators = self.input_batch.generators  # the dict the sampling metadata holds too: changed in place
    # discard mask [False, True, True] (requests 1 and 2 still prefilling) -> [1, 2]
    discarded = self.discard_request_mask.np[: self.input_batch.num_reqs].nonzero()[0].tolist()
    own = {
        request: generators[request]
        for request in discarded
        if request in generators and generators[request].device.type == "cpu"
    }
    generators.update({request: ChunkDraws(generator) for request, generator in own.items()})
    STATE.chunks_drawn_apart += len(own)
    STATE.req_ids = self.input_batch.req_ids[: self.input_batch.num_reqs]  # a copy: the batch changes next step
    try:
        return sample_with_chunk_draws_apart.stock(self, grammar_output)
    finally:
        generators.update(own)
        STATE.req_ids = None


def refuse_cut_grammar_drafts(self, params, supported_tasks):
    """vLLM's request validation, refusing first a sampled request with structured outputs when the drafter
    samples its drafts: vLLM's synchronous scheduler (the only one on CPU) cuts such a draft at the first token
    the grammar refuses and verifies the rest as if nothing had been drafted there, which is not the target's
    law (ALGORITHMS.md's thinning keeps the refused token's position as a rejected sentinel). Greedy requests
    and one-hot drafters lose nothing to the cut. The asynchronous scheduler (GPU) keeps the position as -1,
    which the block rule verifies exactly, but vLLM's token rule there is untested, so both are refused. The refusal
    is vLLM's validation error, which vLLM's server answers with HTTP 400 and the reason (a ValueError raised here
    would come back as HTTP 500 without a message)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, SamplingType

    spec = self.speculative_config
    if (
        isinstance(params, SamplingParams)
        and params.structured_outputs is not None
        and params.sampling_type != SamplingType.GREEDY
        and spec is not None
        and spec.draft_sample_method == "probabilistic"
    ):
        raise VLLMValidationError(
            "blockspec: structured outputs at temperature > 0 with sampled drafts "
            "(draft_sample_method='probabilistic') are not exact in vLLM's synchronous scheduler: it "
            "cuts a draft at the first token the grammar refuses. Use temperature 0, "
            "draft_sample_method='greedy', or no speculative decoding for these requests.",
            parameter="structured_outputs",
        )
    return refuse_cut_grammar_drafts.stock(self, params, supported_tasks)
