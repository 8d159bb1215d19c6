"""Block verification on vLLM's flattened ragged layout; imports torch and blockspec's ``verify`` and ``sampling``
only, never vLLM.

vLLM's rejection sampler hands its rule every request's drafted tokens one after another (B requests, T drafted
tokens in all, V tokens in the vocabulary, request b drafted n_b >= 0 tokens, cu the cumulative n_b):
    draft_token_ids [T] int, request b's at rows cu[b] - n_b .. cu[b] - 1; -1 for a draft a grammar refused
    draft_probs [T, V], target_probs [T, V]: the draft's and the target's (processed) distribution there
    bonus_token_ids [B, 1]: a token vLLM sampled from the target after all n_b drafted tokens
    uniforms [T] float64, exponentials [B, V] Exp(1): the draws vLLM's token rule consumes
and takes back [B, max_spec_len + 1] int32: the accepted tokens and one more, -1 after. Why this is exact, and the
views that save copies: docs/guide/vllm.md.
"""

from __future__ import annotations

import torch

from ..sampling import NonFiniteLogitsError
from ..verify import SAMPLED_RULES, Randomness, expected_accepted, verify_block

PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID: an empty output slot, or a drafted token to be rejected


def target_probs_with_spare_row(target_logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax(target_logits) [T, V] in ``dtype``, stored with one more (uniform) row after it, so that
    ``padded_block`` can view equal-length drafts' target rows instead of copying them."""
    total, vocab = target_logits.shape
    buffer = torch.empty(total + 1, vocab, dtype=dtype, device=target_logits.device)
    buffer[total] = 1.0 / vocab
    return torch.softmax(target_logits, -1, dtype=dtype, out=buffer[:total])


def check_rows(draft_probs: torch.Tensor, target_logits: torch.Tensor, rows: torch.Tensor, names: dict) -> None:
    """Raise NonFiniteLogitsError naming the model unless every verified row (``rows`` [T] bool) of the target's
    processed logits [T, V] has a finite maximum and every one of ``draft_probs`` [T, V] a finite positive one.
    One maximum per row, as blockspec's engine checks: it is NaN if any entry is, +inf if any is, and -inf
    (target) or 0 (draft) only if every token is masked; the rule would read such a row as a distribution and
    emit token 0. ``names``: "target" and "draft" -> the models' names."""
    target_peaks, draft_peaks = target_logits.amax(-1), draft_probs.amax(-1)  # [T] each
    bad = {
        "target": rows & ~torch.isfinite(target_peaks),
        "draft": rows & ~(torch.isfinite(draft_peaks) & (draft_peaks > 0)),
    }
    if not bool((bad["target"] | bad["draft"]).any()):  # one synchronisation for both
        return
    role = "target" if bool(bad["target"].any()) else "draft"
    what = "logits" if role == "target" else "probabilities"
    first = int(bad[role].nonzero()[0, 0])
    peak = float((target_peaks if role == "target" else draft_peaks)[first])
    raise NonFiniteLogitsError(
        f"the {role} model ({names.get(role, 'unknown')}) gave non-finite or fully masked {what} at "
        f"{int(bad[role].sum())} of {len(rows)} drafted positions (first at row {first}, maximum {peak}): a float16 "
        "overflow, a broken checkpoint, or a logits processor that masks every token? Try bfloat16 or float32"
    )


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
    # row-major order over `real` is request by request, the flattened order:
    # [a1, a2, c1] with counts [2, 0, 1], width 2 -> [[a1, a2], [fill, fill], [c1, fill]]
    padded[real] = flat
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
    caller keeps greedy requests on vLLM's greedy path). A drafted -1 is never accepted (``padded_block``)."""
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
    # the token after all n_b drafts is vLLM's bonus token: n = [1, 2], request 1 accepted both of its drafts:
    # its row [x1, x2, t] -> [x1, x2, bonus] (t was drawn from padding, row n_b of ``padded_block``'s target)
    emitted[all_accepted, num_draft_tokens[all_accepted]] = bonus_token_ids[all_accepted, 0].to(emitted.dtype)
    output = torch.full(
        (len(num_draft_tokens), max_spec_len + 1), PLACEHOLDER, dtype=torch.int32, device=emitted.device
    )
    output[:, : emitted.shape[1]] = emitted.to(torch.int32)  # width + 1 <= max_spec_len + 1 columns, -1 after
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
    # row n_b, the target after all drafted tokens, is padding: the token drawn from it is replaced by the bonus.
    # Every request drafted W tokens: a view, request b's rows b * W .. b * W + W, the last one shared with the
    # next request (or the spare row): W = 2, rows [a1, a2, b1, b2, spare] -> [[a1, a2, b1], [b1, b2, spare]]
    if len(target_probs) == batch * width and has_spare_row(target_probs):
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
        rule: expected_accepted(tokens, draft, target, rule, num_draft_tokens, validate=False) for rule in SAMPLED_RULES
    }
