"""Offline evaluation of length policies on recorded steps (``calibrate.Recording``) against a latency profile.

Recorded rows are regrouped into steps of ``batch`` rows (a fixed-seed sample), so one recording serves every
batch size. Each policy picks per-row lengths from the recorded features; a step emits, in expectation,
sum_b (1 + sum_{i <= L_b} g_b,i) tokens with the exact gains g (an unbiased stand-in for the realised count)
and costs what the latency profile predicts for the forwards it runs: drafting, the companion, the target.
A step's first draft forward reads CATCH_UP tokens (at batch >= 4 some row nearly always accepted its whole
block or did not draft the step before, so it reads two), each later one a single token.
The hindsight oracle knows each row's accepted length tau under the token rule with all K drafts verified and
picks each step's width so that the run's pooled goodput is the highest possible (``oracle``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..policy import SVPolicy
from ..policy.features import DRAFT_FEATURES
from .calibrate import Recording

CATCH_UP = 2  # tokens the draft's first forward of a step reads


@dataclass(frozen=True)
class Outcome:
    emitted: float  # expected tokens emitted over all replayed steps
    seconds: float  # predicted seconds of those steps
    verified: float  # drafted tokens verified
    drafted: float  # drafted tokens (per row, summed over rows)

    @property
    def goodput(self) -> float:
        return self.emitted / self.seconds


def replay(
    recording: Recording,
    profile,
    latency,
    *,
    batch: int,
    rule: str,
    fixed: tuple[int, ...] = (1, 2, 4, 8),
    steps: int = 200,
    seed: int = 0,
) -> dict[str, Outcome]:
    """Outcomes of target-only, fixed K in ``fixed``, SV (draft-only and companion predictors) and the oracle."""
    rows = torch.randint(len(recording.prompt), (steps, batch), generator=torch.Generator().manual_seed(seed))
    max_draft = recording.draft.shape[1]
    labels, tau = recording.labels[rule].double(), recording.accepted
    target = latency.target

    def outcome(lengths_per_step, drafted_per_step, companion: bool, realised: bool = False) -> Outcome:
        """``realised``: the lengths are accepted counts (the oracle's), not verification lengths."""
        emitted = seconds = verified = drafted_total = 0.0
        for chosen, lengths, drafted in zip(rows, lengths_per_step, drafted_per_step):
            reach = torch.arange(max_draft)[None, :] < lengths[:, None]
            emitted += batch + (float(lengths.sum()) if realised else float((labels[chosen] * reach).sum()))
            width = int(lengths.max())
            seconds += target(batch, 1 + width) + latency.drafting(batch, drafted, CATCH_UP, companion)
            verified += float(lengths.sum())
            drafted_total += drafted * batch
        return Outcome(emitted, seconds, verified, drafted_total)

    results = {"target-only": outcome([torch.zeros(batch, dtype=torch.long)] * steps, [0] * steps, False)}
    for k in fixed:
        if k <= max_draft:
            lengths = [recording.num_verified[chosen].clamp(max=k) for chosen in rows]
            results[f"fixed K={k}"] = outcome(lengths, [k] * steps, False)
    for kind in ("draft", "companion"):
        if kind == "companion" and (latency.companion is None or not recording.companion):
            continue  # measured or recorded without a companion (as on llama.cpp)
        policy = SVPolicy(profile, latency, rule=rule, max_draft=max_draft, kind=kind)
        lengths, drafted = zip(*(_sv_step(policy, recording, chosen, kind, rule) for chosen in rows))
        results[f"SV {kind}"] = outcome(lengths, drafted, kind == "companion")
    verified = [recording.num_verified[chosen] for chosen in rows]  # every drafted token, as recorded
    lengths, drafted = zip(*oracle([tau[chosen] for chosen in rows], verified, latency, batch))
    results["oracle"] = outcome(lengths, drafted, False, realised=True)
    return results


def _sv_step(policy: SVPolicy, recording: Recording, chosen: torch.Tensor, kind: str, rule: str):
    """One step of the real SVPolicy on recorded rows: (lengths [B], draft forwards run)."""
    budget = policy.draft_budget(len(chosen), CATCH_UP)
    drafted = forwards = 0
    prefix = recording.draft[chosen, :, DRAFT_FEATURES.index("log_prefix_prob")]  # [B, K]: before each x_i
    while drafted < budget and (drafted == 0 or policy.draft_next(drafted + 1, prefix[:, drafted])):
        forwards += 1  # a stop at keep_drafting still paid for the forward that decided it
        if not policy.keep_drafting_given(recording.draft[chosen, drafted]):
            break
        drafted += 1
    if drafted == 0:
        return torch.zeros(len(chosen), dtype=torch.long), forwards
    features = recording.features(kind, rule)[chosen, :drafted]
    lengths = policy.lengths_given(features, recording.num_verified[chosen].clamp(max=drafted))
    policy.learn(recording.labels[rule][chosen, :drafted], lengths)  # as observe() after the target's forward
    return lengths, forwards


def oracle(taus: list[torch.Tensor], drafted: list[torch.Tensor], latency, batch: int) -> list[tuple]:
    """Hindsight widths for steps whose rows' accepted lengths ``taus`` [B] (all drafts verified) are known:
    (lengths [B], width) per step, maximising the run's pooled goodput sum_t emitted_t / sum_t seconds_t, where a
    step of width w emits sum_b (1 + min(tau_b, w)). Dinkelbach's iteration: at the current rate r, each step
    takes the width maximising emitted - r * seconds; the pooled rate of those choices is the next r, until it
    stops growing (a per-step argmax of emitted / seconds is not the run's optimum)."""

    def seconds(w: int) -> float:
        return latency.target(batch, 1 + w) + latency.drafting(batch, w, CATCH_UP, companion=False)

    options = [
        [(float((1 + tau.clamp(max=w)).sum()), seconds(w)) for w in range(int(n.max()) + 1)]
        for tau, n in zip(taus, drafted)
    ]  # (emitted, seconds) per width, per step
    rate = 0.0
    while True:
        widths = [max(range(len(o)), key=lambda w, o=o: o[w][0] - rate * o[w][1]) for o in options]
        pooled = sum(o[w][0] for o, w in zip(options, widths)) / sum(o[w][1] for o, w in zip(options, widths))
        if pooled <= rate:
            return [(tau.clamp(max=w), w) for tau, w in zip(taus, widths)]
        rate = pooled
