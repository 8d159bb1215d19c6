"""What the plugin runs with and has counted in this process: one ``PluginState``, ``STATE``, that the patched
steps update and the worker's status (``status.worker_status``) reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..verify import SAMPLED_RULES

if TYPE_CHECKING:
    from ..policy.latency import LatencyProfile
    from ..policy.predictor import Profile
    from ..policy.sv import SVPolicy


@dataclass
class RequestAcceptance:
    """One request's counts so far (``acceptance.count_step``), until it finishes."""

    counts: dict[str, list[int]] = field(default_factory=dict)  # rule -> [drafted, accepted]
    expected: dict[str, float] = field(default_factory=dict)  # rule -> E[accepted] of its drafts (analytic)

    def summary(self) -> str:
        """ "block: 12 drafted, 9 accepted; expected accepted: token 7.41, block 7.98 (block rule's gain +0.57)"."""
        parts = [f"{rule}: {drafted} drafted, {accepted} accepted" for rule, (drafted, accepted) in self.counts.items()]
        if self.expected:
            expected = ", ".join(f"{rule} {value:.2f}" for rule, value in self.expected.items())
            gain = self.expected["block"] - self.expected["token"]
            parts.append(f"expected accepted: {expected} (block rule's gain {gain:+.2f})")
        return "; ".join(parts)


@dataclass
class PluginState:
    """The stopping rule in place (a threshold or SV's profiles, at most one) and the plugin's counters."""

    rule: str | None = None  # BLOCKSPEC_VLLM_RULE: the rule verifying sampled drafts
    min_prob: float | None = None  # BLOCKSPEC_VLLM_MIN_DRAFT_PROB's threshold
    models: dict[str, str | None] = field(default_factory=dict)  # "target", "draft" -> the served models' names
    analytic: bool = False  # BLOCKSPEC_VLLM_ANALYTIC: score every block step's drafts under both rules
    sv_paths: list[str] | None = None  # BLOCKSPEC_VLLM_SV's (calibration, latency) profile paths
    sv_profiles: tuple[Profile, LatencyProfile] | None = None  # read from sv_paths when SV is put in place
    sv_policy: SVPolicy | None = None  # built from sv_profiles when the worker's model runner starts
    offset: float = 0.0  # what SV has learnt on its predictor's logits from the steps the block rule verified
    skipped: int = 0  # steps SV did not draft
    drafted: int = 0  # tokens drafted, and of them verified, while a stopping rule was in place
    verified: int = 0
    # verification steps with sampled requests, by the rule that verified them
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SAMPLED_RULES, 0))
    chunks_drawn_apart: int = 0  # samples of seeded requests' prefill chunks drawn from a copy of their generator
    analytic_rows: int = 0  # sampled request-steps with drafts scored under both rules (BLOCKSPEC_VLLM_ANALYTIC)
    expected: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SAMPLED_RULES, 0.0))  # sums of E[accepted]
    # drafted and accepted tokens by the rule that verified them: "block", "token", or "greedy" (vLLM's kernel)
    acceptance: dict[str, dict[str, int]] = field(default_factory=dict)
    req_ids: list[str] | None = None  # the model runner's requests in batch order, while it samples a step
    requests: dict[str, RequestAcceptance] = field(default_factory=dict)  # request id -> counts until it finishes


STATE = PluginState()
