"""The engine's output law is exactly the target's under top-k, top-p and a draft sampled at other settings.

Each test runs ``SpeculativeDecoder(...).generate`` on a tiny in-process model pair (tests/kits/tiny.py, V = 6 tokens)
for SAMPLES rows of one prompt, and compares the JOINT law of the first LENGTH = 3 generated tokens (216 outcomes)
with the target's own law, computed exactly by enumeration from the target's processed probabilities
(``blockspec.sampling.process`` with the same SamplingParams, float64 after processing). With DRAFT_LEN = 2 the
first step drafts 2 tokens and verifies them with the rule under test; later steps draft what still fits.

The test is Pearson's chi-square at ALPHA on the joint outcome, fixed seeds (row b uses seed b), after pooling:
outcomes expected fewer than MIN_EXPECTED times share one cell (lawkit.sparse_cell_groups), outcomes of exact
probability 0 (cut by top-k / top-p) form a cell that no sample may reach, and the threshold is the chi-square
quantile at 1 - ALPHA for the degrees of freedom left after pooling.

Every test has a NEGATIVE CONTROL: the same decoder turned into a subtly wrong engine by instance-level patches
(nothing in src/ changes), which must fail the same test at the same sample size. Before sampling, each test
computes the control's exact output law (``engine_law``: the engine's steps enumerated through the verifiers'
closed forms) and asserts the test's power against it is >= MIN_POWER; after sampling it asserts that the control's
statistic exceeds the threshold, and that the control's samples do follow that predicted wrong law.

Figures (statistic vs threshold, power) are printed: run with ``pytest -s`` to see them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from kits import enginekit, lawkit
from kits.tiny import perturbed, tiny_model

from blockspec import SamplingParams, SpeculativeDecoder, checks
from blockspec.drafting import DraftProposer
from blockspec.drafting import proposer as proposer_module
from blockspec.sampling import process
from blockspec.verify import SAMPLED_RULES, expected_accepted

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = 1e-4  # false-alarm probability of each chi-square test
MIN_EXPECTED = 5.0  # Cochran's rule: outcomes expected fewer times are pooled
MIN_POWER = 0.99  # required power of the same test against each negative control (from its exact law)
# SAMPLES: every control is already rejected with power >= 0.99999 at N = 3000 (from the exact laws); N = 4000
# leaves a margin and keeps the file near 45 s on one thread (two 4000-row generate calls per test).
VOCAB, LENGTH, DRAFT_LEN, SAMPLES = 6, 3, 2, 4000
POOLED = lawkit.PooledChiSquare(SAMPLES, ALPHA, MIN_EXPECTED)
PROMPT = [1, 2, 3]
SUPPORT_MARGIN = 1e-4  # top-k / top-p cuts this far from a tie (forwards differ by ~1e-6 in the last bits)
ENUMERATION_TOLERANCE = 1e-12  # the correct engine's enumerated law vs the target's, both float64
# Block verification must accept more than token verification on these drafts (draft-weighted E[tau] of the first
# step), or the block tests would only repeat the token tests: with top-p 0.8 at temperature 1 on these models, for
# example, every first drafted token has ratio 0 or >= 1 and the two rules make identical decisions.
MIN_BLOCK_GAIN = 3e-3


@dataclass(frozen=True)
class Control:
    """A subtly wrong engine: the target's scoring logits processed with ``target`` instead of the call's sampling,
    or the draft's probabilities handed to the verifier processed with ``draft_reported`` while the draft sampled
    from the ones its ``draft_sampling`` gives (what it "tells" verification is not what it did)."""

    description: str
    target: SamplingParams | None = None
    draft_reported: SamplingParams | None = None


@dataclass(frozen=True)
class Case:
    sampling: SamplingParams  # the target's
    draft_sampling: SamplingParams | None  # the draft's; None: the target's
    control: Control

    @property
    def draft(self) -> SamplingParams:
        return self.draft_sampling or self.sampling


CASES = {
    "top_k": Case(
        SamplingParams(top_k=3),
        None,
        Control(
            "the draft samples from its top-k distribution but reports the softmax before the top-k cut",
            draft_reported=SamplingParams(),
        ),
    ),
    "top_p": Case(
        SamplingParams(top_p=0.75),
        None,
        Control(
            "the target's scoring probabilities skip top-p (the cut applied to the draft only)", target=SamplingParams()
        ),
    ),
    "hotter_draft": Case(
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.5),
        Control(
            "verification is told the draft used the target's temperature 0.7 while it sampled at 1.5",
            draft_reported=SamplingParams(temperature=0.7),
        ),
    ),
    "top_p_target_hotter_draft": Case(
        SamplingParams(temperature=0.8, top_p=0.85),
        SamplingParams(temperature=2.0),
        Control(
            "verification is told the draft used the target's temperature 0.8 while it sampled at 2.0",
            draft_reported=SamplingParams(temperature=0.8),
        ),
    ),
    "top_k_target_colder_top_p_draft": Case(
        SamplingParams(temperature=1.2, top_k=4),
        SamplingParams(temperature=0.7, top_p=0.7),
        Control(
            "draft_sampling is ignored when the draft's probabilities are handed to verification (they are "
            "processed with the target's temperature 1.2 and top-k 4)",
            draft_reported=SamplingParams(temperature=1.2, top_k=4),
        ),
    ),
}


# --- exact laws from the models' processed tables ---------------------------------------------------------------


@pytest.fixture(scope="module")
def models(device):
    target = tiny_model(vocab=VOCAB, sharpness=3.0)
    draft = perturbed(target, scale=0.4, seed=1).to(device)
    target = target.to(device)
    return (
        target,
        draft,
        lawkit.logit_tables(target, PROMPT, VOCAB, LENGTH),
        lawkit.logit_tables(draft, PROMPT, VOCAB, LENGTH),
    )


def assert_stable_support(logits: list[torch.Tensor], params: SamplingParams) -> None:
    """Top-k and top-p keep the same tokens here as in the engine's (cached, batched) forwards: no cut lies within
    SUPPORT_MARGIN of a tie. Otherwise a last-bit difference in the logits could flip a token in or out of the
    support and the exact law would not be the engine's."""
    for table in logits:
        scaled = table.double() / params.temperature
        if 0 < params.top_k < VOCAB:
            ranked = scaled.sort(-1, descending=True).values
            gap = float((ranked[:, params.top_k - 1] - ranked[:, params.top_k]).min())
            assert gap > SUPPORT_MARGIN, f"{params}: a top-k cut {gap:.2g} from a tie"
        if params.top_p < 1:
            kept = process(table, params) > 0
            for shifted in (params.top_p - SUPPORT_MARGIN, min(1.0, params.top_p + SUPPORT_MARGIN)):
                assert torch.equal(process(table, replace(params, top_p=shifted)) > 0, kept), (
                    f"{params}: a top-p cut within {SUPPORT_MARGIN} of the mass reached by a token"
                )


def _at(table: list[torch.Tensor], contexts: torch.Tensor) -> torch.Tensor:
    """Rows [N, V] of a table list for contexts [N, L] (continuations after PROMPT)."""
    weights = VOCAB ** torch.arange(contexts.shape[1] - 1, -1, -1)
    return table[contexts.shape[1]][(contexts * weights).sum(-1)]


def engine_law(
    target: list[torch.Tensor], draft_sampled: list[torch.Tensor], draft_reported: list[torch.Tensor], rule: str
) -> torch.Tensor:
    """The exact joint law [V] * LENGTH of the engine's first LENGTH tokens, step by step as the engine runs them.

    After g tokens a step drafts k = min(DRAFT_LEN, LENGTH - 1 - g) tokens from ``draft_sampled`` (the engine leaves
    room for the step's own last token), hands ``draft_reported`` and ``target`` to the verifier, whose law of tau
    and of the emitted token given the block are its closed forms (blockspec.verify); k = 0 is a plain target step.
    With ``draft_reported`` = ``draft_sampled`` this is the correct engine and must be the target's law.
    """
    return enginekit.engine_law(
        VOCAB,
        LENGTH,
        DRAFT_LEN,
        lambda contexts: _at(target, contexts),
        lambda contexts: _at(draft_sampled, contexts),
        rule,
        reported=lambda contexts: _at(draft_reported, contexts),
    )


def first_step_accepted(target: list[torch.Tensor], draft: list[torch.Tensor], rule: str) -> float:
    """E[tau] of the first step (DRAFT_LEN drafted tokens), exactly: the draft-weighted mean over every block."""
    blocks = lawkit.all_blocks(VOCAB, DRAFT_LEN)
    draft_probs = torch.stack([_at(draft, blocks[:, :i]) for i in range(DRAFT_LEN)], 1)  # [N, K, V]
    target_probs = torch.stack([_at(target, blocks[:, :i]) for i in range(DRAFT_LEN + 1)], 1)  # [N, K+1, V]
    block_prob = draft_probs.gather(-1, blocks[..., None]).squeeze(-1).prod(-1)
    drafted = block_prob > 0
    accepted = expected_accepted(blocks[drafted], draft_probs[drafted], target_probs[drafted], rule, validate=False)
    return float((block_prob[drafted] * accepted).sum())


# --- the engine, right and subtly wrong ---------------------------------------------------------------------------


def wrong_engine(control: Control, monkeypatch) -> dict[str, int]:
    """Patches the engine into the one ``control`` describes; returns call counters, so a test can check the patch
    was exercised. Relies on two hooks: ``checks.probabilities(model, role, logits, sampling, vocab)`` (every
    model's logits -> processed probabilities, as the engine and the proposer call it) and
    ``DraftProposer._draft(unseen, limit, uniforms)`` -> (tokens, probs), the drafting of one step; if they are
    renamed, this raises instead of silently testing a correct engine."""
    probabilities, draft = checks.probabilities, DraftProposer._draft
    reported: list[torch.Tensor] = []
    calls = {"target": 0, "draft": 0}

    def probabilities_wrongly(model, role, logits, sampling, vocab):
        if role == "target" and control.target is not None:
            calls["target"] += 1
            sampling = control.target
        if role == "draft" and control.draft_reported is not None:
            calls["draft"] += 1
            reported.append(probabilities(model, role, logits, control.draft_reported, vocab))  # what verification sees
        return probabilities(model, role, logits, sampling, vocab)  # what the draft samples from

    def draft_and_misreport(self, unseen, limit, uniforms):
        reported.clear()
        tokens, probs = draft(self, unseen, limit, uniforms)
        if control.draft_reported is not None and probs.shape[1] > 0:
            assert len(reported) == probs.shape[1], "one draft forward per drafted position"
            probs = torch.stack(reported, dim=1)  # [B, n, V]
        return tokens, probs

    monkeypatch.setattr(checks, "probabilities", probabilities_wrongly)  # the engine's
    monkeypatch.setattr(proposer_module, "probabilities", probabilities_wrongly)  # the proposer's
    monkeypatch.setattr(DraftProposer, "_draft", draft_and_misreport)
    return calls


def run(decoder: SpeculativeDecoder, case: Case, seed: int):
    result = decoder.generate(
        [PROMPT] * SAMPLES,
        max_new_tokens=LENGTH,
        sampling=case.sampling,
        draft_sampling=case.draft_sampling,
        seed=seed,
        stop_on_eos=False,
    )
    return lawkit.joint_counts(result.sequences, VOCAB), result


@pytest.mark.parametrize("rule", SAMPLED_RULES)
@pytest.mark.parametrize("name", CASES)
def test_first_tokens_follow_the_processed_target_law(models, name, rule, monkeypatch):
    case = CASES[name]
    target_model, draft_model, target_logits, draft_logits = models
    for logits, params in ((target_logits, case.sampling), (draft_logits, case.draft)):
        assert_stable_support(logits, params)
    target = lawkit.processed(target_logits, case.sampling)
    draft = lawkit.processed(draft_logits, case.draft)
    law = lawkit.target_law(lawkit.Tables(VOCAB, target, target), LENGTH)
    if rule == "block":
        gain = first_step_accepted(target, draft, "block") - first_step_accepted(target, draft, "token")
        assert gain > MIN_BLOCK_GAIN, f"{name}: block verification accepts only {gain:.2g} more than token here"

    # Exact, before sampling: the correct engine's steps give the target's law (so ``engine_law`` is the engine's
    # law), and the control's law is far enough from it that this test at this N rejects it almost surely.
    assert lawkit.max_abs_error(engine_law(target, draft, draft, rule), law) < ENUMERATION_TOLERANCE
    control = case.control
    wrong_law = engine_law(
        lawkit.processed(target_logits, control.target) if control.target else target,
        draft,
        lawkit.processed(draft_logits, control.draft_reported) if control.draft_reported else draft,
        rule,
    )
    power = POOLED.power(law, wrong_law)
    assert power >= MIN_POWER, f"{name} {rule}: power {power:.3g} < {MIN_POWER} against the control"

    decoder = SpeculativeDecoder(target_model, draft_model, rule=rule, max_draft=DRAFT_LEN)
    counts, result = run(decoder, case, seed=0)
    test = POOLED.test(counts, law)
    assert test.passed, POOLED.describe(f"{name} {rule}", test)
    POOLED.describe(f"{name} {rule} (acceptance rate {result.acceptance_rate:.2f})", test)
    assert 0.05 < result.acceptance_rate < 0.95, "the drafts were not both accepted and rejected"

    broken = SpeculativeDecoder(target_model, draft_model, rule=rule, max_draft=DRAFT_LEN)
    calls = wrong_engine(control, monkeypatch)
    counts, _ = run(broken, case, seed=0)
    assert calls["target"] + calls["draft"] > 0, "the control's patch was never exercised"
    POOLED.check_control(f"{name} {rule} [{control.description}]", counts, law, wrong_law)
