"""The drafting hook: how many of its drafts each request has verified, chosen after vLLM drafts by a stopping rule
(exact whatever it decides), SV (``BLOCKSPEC_VLLM_SV``) or the draft's top probability against a threshold
(``BLOCKSPEC_VLLM_MIN_DRAFT_PROB``); and SV's online step after the block rule verified. Design:
docs/guide/vllm.md."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

from .ragged import padded_block
from .state import STATE
from .switches import SV_SWITCH, requested_rule

if TYPE_CHECKING:
    from ..policy.latency import LatencyProfile
    from ..policy.predictor import Profile
    from ..policy.sv import SVPolicy


def use_sv(paths: tuple[str, str] | None) -> None:
    """Put SV in place with the profiles at ``paths`` (None: take it out), read and tried now
    (``checked_profiles``) so that a missing or broken profile fails where vLLM starts, not at its first request."""
    profiles = None if paths is None else checked_profiles(paths, requested_rule() or "token")
    STATE.sv_paths, STATE.sv_profiles = (None if paths is None else list(paths)), profiles
    STATE.sv_policy, STATE.offset = None, 0.0


def checked_profiles(paths: tuple[str, str], rule: str) -> tuple[Profile, LatencyProfile]:
    """The (calibration, latency) profiles at ``paths``, refused with ``BLOCKSPEC_VLLM_SV``'s name unless SV can
    decide with them under ``rule``: a draft-only predictor on blockspec's draft features with finite weights, a
    prior of gains in [0, 1], a latency profile whose target takes time everywhere (its tables are finite and
    non-negative, ``LatencyTable``), and one trial step (does drafting pay? then a request's verified length)
    that runs. Without them SV would raise inside vLLM's worker mid-serving, or never draft."""
    from ..policy.features import DRAFT_FEATURES
    from ..policy.latency import LatencyProfile
    from ..policy.predictor import Profile

    calibration_path, latency_path = paths
    try:
        calibration = Profile.load(calibration_path)
        try:  # a hand-edited profile of another shape (a list for the prior, say)
            predictor, prior = calibration.predictor(rule, "draft"), calibration.prior.get(rule)
        except (AttributeError, KeyError) as error:
            raise ValueError(f"it is not shaped as a calibration profile ({type(error).__name__}: {error})") from None
        if predictor.features != DRAFT_FEATURES:
            raise ValueError(
                f"its {rule!r} draft predictor reads {predictor.features}, not the draft features "
                f"{DRAFT_FEATURES}: run `blockspec sv calibrate` with this blockspec"
            )
        if len(predictor.weights) != len(DRAFT_FEATURES) or not all(math.isfinite(w) for w in predictor.weights):
            raise ValueError(
                f"its {rule!r} draft predictor needs {len(DRAFT_FEATURES)} finite weights, got {predictor.weights}"
            )
        if not prior or not all(0.0 <= gain <= 1.0 for gain in prior):  # NaN fails too
            raise ValueError(
                f"its {rule!r} prior must list the expected gain (in [0, 1]) of each position, got {prior}"
            )
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"{SV_SWITCH}: calibration profile {calibration_path}: {error}") from None
    try:
        latency = LatencyProfile.load(latency_path)
        if not min(min(row) for row in latency.target.seconds) > 0:
            raise ValueError(f"its target table must be > 0 seconds everywhere, got {latency.target.seconds}")
        if max(latency.target.tokens) < 2:
            raise ValueError("its target table has no width with drafts (tokens per request up to 1)")
        if max(latency.draft.tokens) < max(latency.target.tokens):
            raise ValueError(
                f"its draft table times the draft's first forward up to {max(latency.draft.tokens)} tokens a "
                f"request, but that forward reads every token the target scored, up to {max(latency.target.tokens)}: "
                "measure it again with this blockspec's python -m blockspec.vllm.profile"
            )
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(f"{SV_SWITCH}: latency profile {latency_path}: {error}") from None
    try:
        trial_step(new_policy(calibration, latency, rule, max(latency.target.tokens) - 1))
    except (ValueError, TypeError, ArithmeticError, IndexError, RuntimeError) as error:
        raise ValueError(
            f"{SV_SWITCH}: SV's trial step on {calibration_path} and {latency_path} failed: {error}"
        ) from error
    return calibration, latency


def new_policy(calibration: Profile, latency: LatencyProfile, rule: str, max_draft: int) -> SVPolicy:
    """The plugin's kind of SVPolicy: draft-only predictor, each request paying its own tokens, whole drafts."""
    from ..policy.sv import SVPolicy

    return SVPolicy(calibration, latency, rule=rule, kind="draft", ragged=True, whole_drafts=True, max_draft=max_draft)


def trial_step(policy: SVPolicy) -> None:
    """SV's two decisions in vLLM on one request that drafted ``max_draft`` tokens from a uniform draft."""
    policy.draft_budget(1, 1)
    drafts = torch.zeros(1, policy.max_draft, dtype=torch.long)
    sv_lengths(policy, drafts, torch.full((1, policy.max_draft, 2), 0.5))


def sv_policy(runner) -> SVPolicy:
    """This worker's SVPolicy, built once the model runner is known (its K), with the latency profile checked
    against what the runner serves (``check_served``)."""
    if STATE.sv_policy is None:
        if STATE.sv_profiles is None or STATE.sv_paths is None:
            raise RuntimeError("blockspec: SV is not in place (use_sv)")
        calibration, latency = STATE.sv_profiles
        check_served(latency, STATE.sv_paths[1], runner)
        STATE.sv_policy = new_policy(
            calibration, latency, requested_rule() or "token", runner.speculative_config.num_speculative_tokens
        )
    return STATE.sv_policy


def check_served(latency: LatencyProfile, path: str, runner) -> None:
    """Refuse, with ``BLOCKSPEC_VLLM_SV``'s name, a latency profile measured on other models, another dtype or
    device than vLLM's model ``runner`` serves, or up to fewer drafts than it verifies: SV would price its steps
    with another engine's seconds. (The calibration profile is made on blockspec's side, under its own names for
    the pair, so only its predictor was checked, ``checked_profiles``.)"""
    from ..policy.latency import dtype_name

    spec = runner.speculative_config
    served = {
        "target": runner.model_config.model,
        "draft": spec.model,
        "dtype": dtype_name(runner.model_config.dtype),
        "device": torch.device(runner.device).type,
    }
    for field, value in served.items():
        if not same(latency.meta.get(field), value):
            raise ValueError(
                f"{SV_SWITCH}: latency profile {path} was measured with {field} {latency.meta.get(field)!r}, but vLLM "
                f"serves {value!r}: measure it with python -m blockspec.vllm.profile on what vLLM serves"
            )
    measured = max(latency.target.tokens) - 1
    if spec.num_speculative_tokens > measured:
        raise ValueError(
            f"{SV_SWITCH}: latency profile {path} was measured up to {measured} drafts a request, but vLLM drafts "
            f"{spec.num_speculative_tokens}: measure it with --max-draft {spec.num_speculative_tokens}"
        )


def same(measured, served: str) -> bool:
    """Whether a profile's ``measured`` field names ``served``: the same text, or two paths to one file."""
    if measured == served:
        return True
    return (
        isinstance(measured, str)
        and os.path.exists(measured)
        and os.path.exists(served)
        and os.path.samefile(measured, served)
    )


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
