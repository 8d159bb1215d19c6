"""The engine's references: plain greedy decoding by transformers, and a plausible engine bug (``off_by_one``)."""

from __future__ import annotations

import torch

from .tiny import EOS


def reference_greedy(target, prompt, max_new_tokens, eos: int | None = EOS):
    out = target.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def off_by_one(verify):
    """A plausible engine bug: target distributions shifted one position against the drafts."""

    def broken(draft_tokens, draft_probs, target_probs, **kwargs):
        return verify(draft_tokens, draft_probs, target_probs.roll(1, dims=1), **kwargs)

    return broken
