"""The drafting hook: how many of its drafts each request has verified, chosen after vLLM drafts by a stopping rule
(exact whatever it decides), SV (``BLOCKSPEC_VLLM_SV``) or the draft's top probability against a threshold
(``BLOCKSPEC_VLLM_MIN_DRAFT_PROB``); and SV's online step after the block rule verified. Design:
docs/guide/vllm.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .ragged import padded_block
from .state import STATE
from .switches import requested_rule

if TYPE_CHECKING:
    from ..policy.sv import SVPolicy


def use_sv(paths: tuple[str, str] | None) -> None:
    """Put SV in place with the profiles at ``paths`` (None: take it out), reading them now so that a missing or
    broken profile fails where vLLM starts."""
    from ..policy.latency import LatencyProfile
    from ..policy.predictor import Profile

    profiles = None if paths is None else (Profile.load(paths[0]), LatencyProfile.load(paths[1]))
    STATE.sv_paths, STATE.sv_profiles = (None if paths is None else list(paths)), profiles
    STATE.sv_policy, STATE.offset = None, 0.0


def sv_policy(runner) -> SVPolicy:
    """This worker's SVPolicy, built at its first step (the number of drafted tokens is the runner's)."""
    if STATE.sv_policy is None:
        from ..policy.sv import SVPolicy

        if STATE.sv_profiles is None:
            raise RuntimeError("blockspec: SV is not in place (use_sv)")
        calibration, latency = STATE.sv_profiles
        STATE.sv_policy = SVPolicy(
            calibration,
            latency,
            rule=requested_rule() or "token",
            kind="draft",
            ragged=True,
            whole_drafts=True,
            max_draft=runner.speculative_config.num_speculative_tokens,
        )
    return STATE.sv_policy


def plan_drafts(self, scheduler_output, *args, **kwargs):
    """vLLM's ``propose_draft_token_ids``, with the drafts each request has verified chosen by a stopping rule.

    SV first decides whether drafting pays at this batch size (if not, vLLM runs the draft only to keep its cache,
    as for vLLM's own batch-size schedule at K = 0), then each request's verified length from its drafts'
    predicted gains; or each request's drafts are cut before the first position where the draft's top
    probability is below ``STATE.min_prob``. Whether x_i is verified depends on the distribution x_i was drawn
    from and on x_<i, never on x_i, so verification stays exact (ALGORITHMS.md). vLLM verifies a request's first
    ``num_draft_tokens`` rows of draft probabilities, which the cut keeps aligned; the model runner takes drafts
    as one list per request, as the ngram drafter gives them. Without draft probabilities (greedy batches,
    drafters without them) nothing is cut.
    """
    policy = sv_policy(self) if STATE.sv_paths is not None else None
    if policy is not None and scheduler_output.num_spec_tokens_to_schedule > 0:
        if policy.draft_budget(self.input_batch.num_reqs, 1) == 0:
            scheduler_output.num_spec_tokens_to_schedule = 0
            STATE.skipped += 1
    drafts = plan_drafts.stock(self, scheduler_output, *args, **kwargs)
    if (
        (policy is None and STATE.min_prob is None)
        or not torch.is_tensor(drafts)
        or not drafts.numel()
        or self._draft_probs is None
    ):
        return drafts
    # the distributions the drafter drew from, [B, K, V]: drafts[b, i] was drawn from probs[b, i]
    probs = self._draft_probs[: len(drafts), : drafts.shape[1]]
    if policy is not None:
        lengths = sv_lengths(policy, drafts.long(), probs)
    else:
        # top probabilities [0.9, 0.2, 0.8] >= 0.5 -> [1, 0, 1] -> cumprod [1, 0, 0] -> length 1
        lengths = (probs.amax(-1) >= STATE.min_prob).cumprod(-1).sum(-1)
    lengths = lengths.tolist()
    STATE.drafted += drafts.numel()
    STATE.verified += sum(lengths)
    if min(lengths) == drafts.shape[1]:
        return drafts  # nothing cut: vLLM's own path for a tensor of drafts, faster than its path for lists
    # [[a1, a2, a3], [b1, b2, b3]] with lengths [1, 3] -> [[a1], [b1, b2, b3]]
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

    verified = counts.masked_fill(~sampled, 0)  # counts [3, 0, 2], sampled [yes, yes, no] -> [3, 0, 0]
    if not bool((verified > 0).any()):
        return
    tokens, draft, target, _ = padded_block(draft_token_ids, counts, draft_probs, target_probs)
    predicted = policy.predict("draft", draft_features(draft, prefix_logprob(tokens, draft)))
    policy.learn(position_gains(tokens, draft, target, policy.rule), verified, {"draft": predicted})
    STATE.offset = policy.offsets["draft"]
