"""Block verification on vLLM's flattened ragged layout.

vLLM's rejection sampler hands its verification rule every request's drafted tokens one after another:
    draft_token_ids      [T]       int: request b's n_b tokens at rows cu[b] - n_b .. cu[b] - 1
    num_draft_tokens     [B]       n_b, possibly 0 (a request that drafted nothing)
    cu_num_draft_tokens  [B]       cumulative n_b
    draft_probs          [T, V]    the distribution each drafted token was sampled from
    target_probs         [T, V]    the target's processed distribution at each drafted position; may be stored
                                   with one spare row after them (``target_probs_with_spare_row``)
    bonus_token_ids      [B, 1]    a token vLLM already sampled from the target after all n_b drafted tokens
and its random draws for the requests that sample, from each request's own generator when it has one:
    uniforms             [T]       float64, one per drafted token
    exponentials         [B, V]    Exp(1), one vector per request (the recovered token wins a race)
The output is vLLM's: [B, max_spec_len + 1] int32, the accepted tokens and then one more, -1 after.

``block_verify_ragged`` runs Sun et al.'s block verification (``verify_block``) on those rows with those draws:
the uniforms decide tau, the exponentials the token after a rejection, and after all n_b tokens are accepted
the token is the bonus token, which vLLM drew from the same target distribution. So each request's output
follows the target's law as under vLLM's token rule, and one random draw serves either rule.

A drafted token of -1 is a draft a grammar refused (vLLM keeps its position so). It is verified as the sentinel
of ALGORITHMS.md's thinning: a token of its own, outside the vocabulary, that the target never accepts. The
thinned draft row would be ``draft * allowed``, but the target rows vLLM verifies against are already masked
by the grammar, and block verification reads a draft row only through max(w * target - draft, 0) and at the
drafted token, so the unthinned row gives the same result wherever the target is positive.

When every request drafted the same number of tokens, the padded block is views of vLLM's tensors, not copies
(of [B, K, V] floats, which cost more than the rule's arithmetic at large batches): the target's row after a
request's drafted tokens is then the next request's first row (the spare row for the last request), which is
read only where the bonus token replaces the token drawn from it.
"""

from __future__ import annotations

import torch

from ..verify import Randomness, expected_accepted, verify_block

PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: an empty output slot, or a drafted token to be rejected


def target_probs_with_spare_row(target_logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax(target_logits) [T, V] in ``dtype``, stored with one more (uniform) row after it, so that
    ``padded_block`` can view equal-length drafts' target rows instead of copying them."""
    total, vocab = target_logits.shape
    buffer = torch.empty(total + 1, vocab, dtype=dtype, device=target_logits.device)
    buffer[total] = 1.0 / vocab
    return torch.softmax(target_logits, -1, dtype=dtype, out=buffer[:total])


def has_spare_row(rows: torch.Tensor) -> bool:
    """Whether contiguous ``rows`` [T, V] are followed in their storage by one more row of their own."""
    needed = (rows.storage_offset() + (len(rows) + 1) * rows.shape[-1]) * rows.element_size()
    return rows.is_contiguous() and rows.untyped_storage().nbytes() >= needed


def pad_ragged(flat: torch.Tensor, num_draft_tokens: torch.Tensor, width: int, fill) -> torch.Tensor:
    """[T, ...] rows, request by request, -> [B, width, ...]: request b's n_b rows first, then ``fill``; a view
    of ``flat`` when every request has ``width`` rows."""
    if len(flat) == len(num_draft_tokens) * width:  # counts are at most width and sum to T: all equal width
        return flat.reshape(len(num_draft_tokens), width, *flat.shape[1:])
    real = torch.arange(width, device=flat.device) < num_draft_tokens[:, None]  # [B, width]
    padded = torch.full((len(num_draft_tokens), width, *flat.shape[1:]), fill, dtype=flat.dtype, device=flat.device)
    padded[real] = flat  # row-major order over `real` is request by request: the flattened order
    return padded


def block_verify_ragged(
    draft_token_ids: torch.Tensor,  # [T] int
    num_draft_tokens: torch.Tensor,  # [B] int64
    max_spec_len: int,
    draft_probs: torch.Tensor,  # [T, V] float
    target_probs: torch.Tensor,  # [T, V] float
    bonus_token_ids: torch.Tensor,  # [B, 1] int
    uniforms: torch.Tensor,  # [T] float64
    exponentials: torch.Tensor,  # [B, V] float
) -> torch.Tensor:
    """vLLM's output [B, max_spec_len + 1] int32 under block verification; every request given samples (the
    caller keeps greedy requests on vLLM's greedy path). A drafted -1 is never accepted (the sentinel above)."""
    num_draft_tokens = num_draft_tokens.to(torch.long)
    if int(num_draft_tokens.sum()) != len(draft_token_ids) or bool((num_draft_tokens > max_spec_len).any()):
        raise ValueError(
            f"num_draft_tokens {num_draft_tokens.tolist()} must sum to the {len(draft_token_ids)} drafted "
            f"tokens, each at most max_spec_len = {max_spec_len}"
        )
    tokens, draft, target, exponentials = padded_block(
        draft_token_ids, num_draft_tokens, draft_probs, target_probs, exponentials
    )
    randomness = Randomness(pad_ragged(uniforms, num_draft_tokens, tokens.shape[1], 0.5), exponentials)
    out = verify_block(tokens, draft, target, num_verified=num_draft_tokens, randomness=randomness, validate=False)
    emitted = out.tokens  # [B, width + 1]: x_1..x_tau, then one more token, -1 after
    all_accepted = out.num_accepted == num_draft_tokens
    emitted[all_accepted, num_draft_tokens[all_accepted]] = bonus_token_ids[all_accepted, 0].to(emitted.dtype)
    output = torch.full(
        (len(num_draft_tokens), max_spec_len + 1), PLACEHOLDER, dtype=torch.int32, device=emitted.device
    )
    output[:, : emitted.shape[1]] = emitted.to(torch.int32)
    return output


def padded_block(draft_token_ids, num_draft_tokens, draft_probs, target_probs, exponentials=None):
    """The ragged rows as one padded block for ``blockspec.verify``: (tokens [B, W], draft [B, W, V'],
    target [B, W + 1, V'], exponentials [B, V'] or None), W the longest draft (at least 1); a drafted -1
    becomes the sentinel, token V of a vocabulary one longer (V' = V + 1), only if some token is -1."""
    batch, vocab = len(num_draft_tokens), target_probs.shape[-1]
    sentinel = draft_token_ids == PLACEHOLDER
    if bool(sentinel.any()):  # one more token, V: drafted with some probability, never by the target
        draft_token_ids = draft_token_ids.masked_fill(sentinel, vocab)
        draft_probs = torch.cat([draft_probs, sentinel[:, None].to(draft_probs.dtype)], dim=1)
        target_probs = torch.nn.functional.pad(target_probs, (0, 1))
        if exponentials is not None:  # the sentinel never wins a race
            exponentials = torch.nn.functional.pad(exponentials, (0, 1), value=1.0)
    width = max(int(num_draft_tokens.max()), 1) if batch else 1
    tokens = pad_ragged(draft_token_ids.to(torch.long), num_draft_tokens, width, 0)
    draft = pad_ragged(draft_probs, num_draft_tokens, width, 1.0 / vocab)
    # row n_b, the target after all drafted tokens, is padding: the token drawn from it is replaced by the bonus
    if len(target_probs) == batch * width and has_spare_row(target_probs):  # see the module's docstring
        target = target_probs.as_strided(
            (batch, width + 1, vocab), (width * vocab, vocab, 1), target_probs.storage_offset()
        )
    else:
        target = pad_ragged(target_probs, num_draft_tokens, width + 1, 1.0 / vocab)
    return tokens, draft, target, exponentials


def expected_accepted_ragged(draft_token_ids, num_draft_tokens, draft_probs, target_probs) -> dict[str, torch.Tensor]:
    """E[accepted | the drafted tokens] per request [B] under the token and the block rule: both rules scored on
    the same drafts, so their ratio carries no sampling noise (``blockspec.verify.expected_accepted``)."""
    num_draft_tokens = num_draft_tokens.to(torch.long)
    tokens, draft, target, _ = padded_block(draft_token_ids, num_draft_tokens, draft_probs, target_probs)
    return {
        method: expected_accepted(tokens, draft, target, method, num_draft_tokens, validate=False)
        for method in ("token", "block")
    }
