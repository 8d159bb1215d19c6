# vLLM lives in its own environment (scripts/setup_vllm.sh), not in the one pyright checks:
# pyright: reportMissingImports=false
"""The block rule on vLLM 0.32's rejection-sampling path (``BLOCKSPEC_VLLM_RULE=block``): vLLM's
``rejection_sample`` with its sampled requests verified by ``ragged.block_verify_ragged``, from the same random
draws; greedy requests, and steps without draft probabilities, stay on vLLM's own paths, and so does every step
with ``BLOCKSPEC_VLLM_RULE=token``. Either way the steps with sampled requests are counted by the rule that verified
them (``STATE.steps``), which ``status.check`` reads, and so are each request's drafted and accepted tokens
(``acceptance``)."""

from __future__ import annotations

import warnings

import torch

from .acceptance import count_step
from .ragged import block_verify_ragged, check_rows, expected_accepted_ragged, target_probs_with_spare_row
from .state import STATE
from .sv_hook import learn_from_verification


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
    vLLM's greedy kernel as before, and the all-greedy batch returns before anything is drawn. With the token
    rule in place (``STATE.rule``) everything stays on vLLM's own path, its steps with sampled requests counted.
    """
    from vllm.v1.sample import rejection_sampler as sampler

    token = STATE.rule != "block"  # BLOCKSPEC_VLLM_RULE=token: every step stays on vLLM's path
    if token or sampling_metadata.all_greedy or synthetic_mode or draft_probs is None:
        sampled_drafts = not (sampling_metadata.all_greedy or synthetic_mode) and any(num_draft_tokens)
        if sampled_drafts and (token or draft_probs is None):
            STATE.steps["token"] += 1
        if sampled_drafts and draft_probs is None and not token:
            warnings.warn(
                "blockspec: this drafter gives no draft probabilities (ngram, suffix or a custom "
                "proposer, or draft_sample_method is not 'probabilistic'); its drafts are verified by "
                "vLLM's token rule, which is exact for a draft scored as one-hot",
                stacklevel=2,
            )
        output = block_rejection_sample.stock(
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
        if not synthetic_mode:  # synthetic mode fakes its acceptance
            count_step("token", sampled_requests(sampling_metadata, len(num_draft_tokens)), num_draft_tokens, output)
        return output
    STATE.steps["block"] += 1
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
    counts = torch.tensor(num_draft_tokens, dtype=torch.long, device=device)
    rows = sampled.repeat_interleave(counts, output_size=len(draft_token_ids))  # [T]: sampled requests' rows
    check_rows(draft_probs, target_logits, rows, STATE.models)
    target_probs = target_probs_with_spare_row(target_logits, draft_probs.dtype)
    exponentials = recovery_exponentials(
        num_draft_tokens,
        target_probs.shape[-1],
        sampling_metadata.generators,
        torch.float64 if use_fp64_gumbel else torch.float32,
        device,
    )
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
    expected = None
    if STATE.analytic:
        expected = score_both_rules(draft_token_ids, counts, draft_probs, target_probs, sampled)
    if STATE.sv_policy is not None:
        learn_from_verification(STATE.sv_policy, draft_token_ids, counts, sampled, draft_probs, target_probs)
    # sampled [yes, no]: row 0 from the block rule, row 1 from vLLM's greedy kernel
    output = torch.where(sampled[:, None], block, output)
    count_step("block", sampled, num_draft_tokens, output, expected)
    return output


def sampled_requests(sampling_metadata, batch: int) -> torch.Tensor:
    """[B] bool: the requests sampled at temperature > 0 (the others are vLLM's greedy kernel's)."""
    from vllm.v1.sample.rejection_sampler import GREEDY_TEMPERATURE

    if sampling_metadata.all_greedy:
        return torch.zeros(batch, dtype=torch.bool)
    if sampling_metadata.all_random:
        return torch.ones(batch, dtype=torch.bool)
    return (sampling_metadata.temperature != GREEDY_TEMPERATURE).cpu()


def score_both_rules(draft_token_ids, counts, draft_probs, target_probs, sampled) -> dict[str, torch.Tensor]:
    """This step's expected accepted lengths under the token and the block rule, on the same drafts, [B] per rule,
    0 but for the sampled requests that drafted something; added up in ``STATE.expected`` (the paired analytic gain
    of the benchmarks)."""
    expected = expected_accepted_ragged(draft_token_ids, counts, draft_probs, target_probs)
    rows = sampled & (counts > 0)
    STATE.analytic_rows += int(rows.sum())
    for rule, values in expected.items():
        expected[rule] = values.masked_fill(~rows, 0.0)
        STATE.expected[rule] += float(expected[rule].sum())
    return expected


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
