"""Calling vLLM 0.32's rejection sampler exactly as its V1 model runner does, on small exact tables.

``configure(rule)`` puts one verification rule in place in this process:
    "stock"  vLLM CPU as shipped: the token rule with the CPU expand kernel that writes into a copy
    "token"  the token rule with blockspec's expand kernel
    "block"  blockspec's block rule with blockspec's expand kernel
and two broken block rules that the law tests must catch (``BROKEN``).
``Batch`` lays requests out as vLLM does (each request's drafted rows, then its bonus row, in one logits
tensor) and ``Batch.run`` calls ``RejectionSampler.forward``: penalties, temperature and the bonus token's
sampling included.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import vllm.utils.cpu_triton_utils as cpu_kernels
import vllm.v1.sample.rejection_sampler as sampler
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from blockspec.verify import VerifyOutput

STOCK_EXPAND = cpu_kernels._expand_kernel_impl  # taken before blockspec's plugin replaces it
STOCK_RULE = sampler.rejection_sample
EXPAND = [STOCK_EXPAND]  # the expand kernel in place; a kernel override is registered once per process


def expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    EXPAND[0](output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS)


cpu_kernels._expand_kernel_impl = expand
CpuPlatform.register_triton_kernel_overrides()  # what vLLM's CPU worker does after loading the plugins


def configure(rule: str) -> None:
    from blockspec.vllm import plugin
    from blockspec.vllm.fixes import expand_in_place
    from blockspec.vllm.rejection import block_rejection_sample
    from blockspec.vllm.switches import SWITCH

    os.environ[SWITCH] = "block"
    plugin.register()  # keeps the stock rule for the greedy and probability-less paths
    os.environ.pop(SWITCH)
    EXPAND[0] = STOCK_EXPAND if rule == "stock" else expand_in_place
    sampler.rejection_sample = {
        "stock": STOCK_RULE,
        "token": STOCK_RULE,
        "block": block_rejection_sample,
        **BROKEN,
    }[rule]


def temperature_twice(*args, **kwargs):
    """Broken: divides the processed target logits by the temperature again."""
    target_logits, metadata = args[5], args[7]
    temperature = metadata.temperature.masked_fill(metadata.temperature == 0, 1.0)
    temperature = temperature.repeat_interleave(torch.tensor(args[1]))
    return block_rule()(*args[:5], target_logits / temperature[:, None], *args[6:], **kwargs)


def draft_rows_one_late(*args, **kwargs):
    """Broken: each drafted token's distribution read one row late."""
    return block_rule()(*args[:4], args[4].roll(-1, 0), *args[5:], **kwargs)


def block_rule():
    from blockspec.vllm.rejection import block_rejection_sample

    return block_rejection_sample


BROKEN = {"temperature applied twice": temperature_twice, "draft rows one late": draft_rows_one_late}


@dataclass
class Batch:
    """Requests in vLLM's layout: request b drafted ``drafts[b]`` (maybe none) from ``draft_probs`` rows (one per
    drafted token, flattened) and the target's logits at its drafted positions and after them."""

    drafts: list[list[int]]
    draft_probs: torch.Tensor | None  # [T, V] float32, or None for a drafter without probabilities
    logits: torch.Tensor  # [T + B, V] float32: request b's n_b + 1 rows, request after request
    temperature: list[float]  # 0 = greedy
    seeds: dict[int, int] = field(default_factory=dict)  # request -> seed of its own generator
    repetition_penalty: float = 1.0
    history: list[list[int]] | None = None  # tokens each request already generated (the penalties read them)

    def run(self, max_num_logprobs: int | None = None, generators: dict | None = None):
        counts = [len(d) for d in self.drafts]
        batch, total = len(counts), sum(counts)
        cu_draft = torch.tensor(counts).cumsum(0).to(torch.int32)
        cu_sampled = torch.tensor([n + 1 for n in counts]).cumsum(0).to(torch.int32)
        starts = (cu_sampled - torch.tensor(counts) - 1).tolist()
        spec = SpecDecodeMetadata(
            draft_token_ids=torch.tensor(sum(self.drafts, []), dtype=torch.int32),
            num_draft_tokens=counts,
            cu_num_draft_tokens=cu_draft,
            cu_num_sampled_tokens=cu_sampled,
            target_logits_indices=torch.tensor(
                [s + j for s, n in zip(starts, counts) for j in range(n)], dtype=torch.int32
            ),
            bonus_logits_indices=torch.tensor([s + n for s, n in zip(starts, counts)], dtype=torch.int32),
            logits_indices=torch.arange(total + batch, dtype=torch.int32),
        )
        temperature = torch.tensor(self.temperature, dtype=torch.float32)
        greedy = temperature == 0
        if generators is None:
            generators = {b: torch.Generator().manual_seed(s) for b, s in self.seeds.items()}
        history = self.history or [[] for _ in range(batch)]
        metadata = SamplingMetadata(
            temperature=temperature,
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            top_p=None,
            top_k=None,
            generators=generators,
            max_num_logprobs=max_num_logprobs,
            no_penalties=self.repetition_penalty == 1.0,
            prompt_token_ids=torch.full((batch, 1), -1, dtype=torch.long) if self.repetition_penalty != 1.0 else None,
            frequency_penalties=torch.zeros(batch),
            presence_penalties=torch.zeros(batch),
            repetition_penalties=torch.full((batch,), self.repetition_penalty),
            output_token_ids=history,
            allowed_token_ids_mask=None,
            bad_words_token_ids={},
            logitsprocs=LogitsProcessors(),
            spec_token_ids=self.drafts,
        )
        rejection_sampler = sampler.RejectionSampler(Sampler())
        return rejection_sampler(spec, self.draft_probs, self.logits.clone(), metadata)


def emitted(sampled_token_ids: torch.Tensor) -> list[list[int]]:
    return [[t for t in row if t != sampler.PLACEHOLDER_TOKEN_ID] for row in sampled_token_ids.tolist()]


class OneStep:
    """A blockspec-style verifier over vLLM's rejection sampler, for ``lawkit.sample_emissions``: every row a
    request drafting K tokens at ``temperature``; the target's logits are temperature * log(target), so that
    vLLM's processed target is exactly the table's."""

    def __init__(self, temperature: float = 1.0, with_draft_probs: bool = True):
        self.temperature, self.with_draft_probs = temperature, with_draft_probs

    def __call__(self, draft_tokens, draft_probs, target_probs, generator=None):
        rows, width, vocab = draft_probs.shape
        logits = (self.temperature * target_probs.log()).reshape(rows * (width + 1), vocab).float()
        batch = Batch(
            drafts=draft_tokens.tolist(),
            draft_probs=draft_probs.reshape(rows * width, vocab).float() if self.with_draft_probs else None,
            logits=logits,
            temperature=[self.temperature] * rows,
        )
        tokens = batch.run().sampled_token_ids.long()
        return VerifyOutput(tokens, (tokens != sampler.PLACEHOLDER_TOKEN_ID).sum(-1) - 1)
