"""Statistical tests: Monte-Carlo of the REAL batched verifiers against the target's exact joint law.

Each test drafts N blocks from a toy context-dependent draft (tests/kits/lawkit.py), verifies all of them in ONE
batched call of the real verifier (verify_token / verify_block, float64 and float32), completes every
emission to K + 1 tokens with exact target samples, and compares the counts of the JOINT (K + 1)-token
outcome with the target's exact law by Pearson's chi-square at alpha = 1e-4 (lawkit.chi_square). That test
also fails if a single sample lands on an outcome of exact probability 0. Seeds are fixed: deterministic.

Sample sizes are derived, not guessed (see ``_check_validity`` and the negative controls):
- validity: every possible outcome has an expected count >= 5 (Cochran's rule), so the chi-square threshold
  holds also for the sparse cells of peaked tables (one hit on a cell expecting 0.01 would add ~100);
- power: deliberately broken verifiers must FAIL the same test at the same N, and before sampling the test
  checks from their exact laws (lawkit.detection_power) that it rejects them with probability >= 0.99.

The exact law itself (enumeration, the three wrong variants by exact law) is tests/verify/test_exact_law.py.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from kits import lawkit
from kits.broken import all_verified, draw_randomness, emit, verify_block_unscaled_residual

from blockspec.verify import (
    RULES,
    accepted_length_law,
    block_acceptance,
    final_distributions,
    token_acceptance,
)

ALPHA = 1e-4  # false-alarm probability of every chi-square test here
MIN_EXPECTED = 5.0  # Cochran's rule for the chi-square approximation, checked on every possible outcome
MIN_POWER = 0.99  # required power of the test against each broken verifier (negative controls)

DTYPES = {"float64": torch.float64, "float32": torch.float32}

# Random context-dependent tables: (V, K, lawkit.random_tables seed, N). peaked=0.5 keeps the smallest
# nonzero joint probability large enough for Cochran's rule at a feasible N; ~20 % of entries are exactly 0.
# V=3, K=3, seed 96 was picked offline (seeds 0..99) as the table where the unscaled-residual mistake needs
# the fewest samples: its joint-law error is 1.6e-2 (max abs), power 0.99 needs N >= 8.6e3; validity needs
# N >= 5.9e3 (smallest possible-outcome probability 8.5e-4). V=4, K=3, seed 5: smallest probability 1.4e-4,
# so N >= 3.6e4; unscaled-residual error 7.0e-3 (power 0.99 from N = 5.5e3).
PEAKED = 0.5
TABLES = {"V3K3": (3, 3, 96, 30_000), "V4K3": (4, 3, 5, 60_000)}


@functools.cache
def random_case(name: str) -> lawkit.Tables:
    vocab, depth, seed, _ = TABLES[name]
    return lawkit.random_tables(vocab, depth, seed, peaked=PEAKED)


def _one_hot_rows(target: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    picks = torch.randint(0, target.shape[1], (target.shape[0],), generator=generator)
    return torch.nn.functional.one_hot(picks, target.shape[1]).to(target.dtype)


def _without_mode(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    draft = draft.scatter(-1, target.argmax(-1, keepdim=True), 0.0)
    return draft / draft.sum(-1, keepdim=True)


@functools.cache
def adversarial_case(name: str) -> lawkit.Tables:
    """The V3K3 target with an adversarial draft (the exact law is the target's, whatever the draft)."""
    base = random_case("V3K3")
    vocab, target = base.vocab, base.target
    if name == "draft_equals_target":  # every ratio is 1: all accepted, only the bonus is sampled
        draft = target
    elif name == "draft_misses_target_mode":  # the target's most likely token is never drafted
        full = lawkit.random_tables(vocab, len(target) - 1, 97, peaked=1.0, zeros=False).draft
        draft = [_without_mode(t, d) for t, d in zip(target, full)]
    elif name == "one_hot_draft":  # a greedy / n-gram drafter; verified with draft_probs=None
        generator = torch.Generator().manual_seed(0)
        draft = [_one_hot_rows(t, generator) for t in target]  # sometimes a token the target gives 0
    elif name == "reversed_target":  # the draft's order of preference is the target's, backwards
        draft = [t.flip(-1) for t in target]
    else:
        raise KeyError(name)
    return lawkit.Tables(vocab, target, draft)


ADVERSARIAL = ("draft_equals_target", "draft_misses_target_mode", "one_hot_draft", "reversed_target")


def _none_draft(verifier):
    """The verifier called with draft_probs=None (a one-hot draft), for tables whose draft rows are one-hot."""

    def call(draft_tokens, draft_probs, target_probs, *, generator=None):
        return verifier(draft_tokens, None, target_probs, generator=generator)

    return call


# --- deliberately broken verifiers (negative controls) ------------------------------------------------------
# Each is the correct rule assembled from the library's PUBLIC deterministic parts (block_acceptance,
# token_acceptance, final_distributions) with ONE thing changed; next to it, the closed form of its step law (a
# lawkit.StepLaw), from which lawkit.speculative_law gives the wrong joint law it actually produces.


def unscaled_residual_law(draft_tokens, draft_probs, target_probs):
    # Block's tau, token verification's (unscaled) residual; final_distributions("token") row K is the bonus.
    return (
        accepted_length_law(draft_tokens, draft_probs, target_probs, "block"),
        final_distributions(draft_tokens, draft_probs, target_probs, "token"),
    )


def verify_block_first_failure(draft_tokens, draft_probs, target_probs, *, generator=None):
    """BROKEN: Algorithm 2, but tau stops at the FIRST u_i >= h_i instead of taking the last hit."""
    randomness = draw_randomness(target_probs, draft_tokens.shape[1], generator)
    h, _ = block_acceptance(draft_tokens, draft_probs, target_probs, all_verified(draft_tokens))
    tau = (randomness.uniforms < h).long().cumprod(-1).sum(-1)  # THE BREAK: an early stop
    finals = final_distributions(draft_tokens, draft_probs, target_probs, "block")
    return emit(draft_tokens, tau, finals[torch.arange(len(tau)), tau], randomness.exponentials)


def first_failure_law(draft_tokens, draft_probs, target_probs):
    h, _ = block_acceptance(draft_tokens, draft_probs, target_probs, all_verified(draft_tokens))
    survival = torch.nn.functional.pad(h.cumprod(-1), (1, 0), value=1.0)  # P(tau >= i) = h_1 ... h_i
    tau_law = survival - torch.nn.functional.pad(survival[:, 1:], (0, 1), value=0.0)
    return tau_law, final_distributions(draft_tokens, draft_probs, target_probs, "block")


def verify_token_target_correction(draft_tokens, draft_probs, target_probs, *, generator=None):
    """BROKEN: token verification whose correction after a rejection is drawn from the target, not the residual."""
    randomness = draw_randomness(target_probs, draft_tokens.shape[1], generator)
    accept = token_acceptance(draft_tokens, draft_probs, target_probs, all_verified(draft_tokens))
    tau = (randomness.uniforms < accept).long().cumprod(-1).sum(-1)
    final = target_probs[torch.arange(len(tau)), tau]  # THE BREAK: the residual on a rejection
    return emit(draft_tokens, tau, final, randomness.exponentials)


def target_correction_law(draft_tokens, draft_probs, target_probs):
    return accepted_length_law(draft_tokens, draft_probs, target_probs, "token"), target_probs


def residual_ignored(rule: str):
    """BROKEN, for any rule with closed forms: tau drawn from the rule's own law given the block, but the token after
    a rejection drawn from the target instead of the rule's residual. Returns (verifier, closed form of its step)."""

    def law(draft_tokens, draft_probs, target_probs):
        return accepted_length_law(draft_tokens, draft_probs, target_probs, rule), target_probs

    def verify(draft_tokens, draft_probs, target_probs, *, generator=None):
        randomness = draw_randomness(target_probs, 1, generator)  # one uniform per row
        tau_law, final = law(draft_tokens, draft_probs, target_probs)
        # Inverse CDF: P(tau >= i) = P(u >= P(tau < i)); the clamp guards a CDF that rounds below 1 at K.
        tau = (tau_law.cumsum(-1) <= randomness.uniforms).sum(-1).clamp(max=draft_tokens.shape[1])
        return emit(draft_tokens, tau, final[torch.arange(len(tau)), tau], randomness.exponentials)

    return verify, law


BROKEN = {  # name -> (rule it breaks, verifier, closed form of its step)
    "block_unscaled_residual": ("block", verify_block_unscaled_residual, unscaled_residual_law),
    "block_first_failure": ("block", verify_block_first_failure, first_failure_law),
    "token_target_correction": ("token", verify_token_target_correction, target_correction_law),
}


# --- helpers --------------------------------------------------------------------------------------------------


def _check_validity(law: torch.Tensor, samples: int) -> float:
    """Asserts Cochran's rule (expected count >= 5 on every possible outcome); returns the smallest count."""
    smallest = samples * float(law[law > 0].min())
    assert smallest >= MIN_EXPECTED, (
        f"N = {samples} gives an expected count of {smallest:.2g} < {MIN_EXPECTED} on some outcome: the "
        "chi-square threshold would not hold; raise N or flatten the tables"
    )
    return smallest


def _powers(tables: lawkit.Tables, width: int, rule: str, law: torch.Tensor, samples: int) -> str:
    """The test's power at this N against each broken verifier of ``rule`` on these tables (informative)."""
    parts = []
    for name, (broken_rule, _, step) in BROKEN.items():
        if broken_rule == rule:
            wrong = lawkit.speculative_law(tables, width, step)
            parts.append(f"{name} {lawkit.detection_power(law, wrong, samples, ALPHA):.3g}")
    return "power vs " + ", ".join(parts)


def _samples_for_power(law: torch.Tensor, wrong_law: torch.Tensor, power: float = MIN_POWER) -> int:
    """The smallest N (to 1 %) at which the test rejects ``wrong_law`` with probability ``power``."""
    low, high = 10, 10
    while lawkit.detection_power(law, wrong_law, high, ALPHA) < power:
        low, high = high, high * 2
    while high > 1.01 * low:
        mid = (low + high) // 2
        low, high = (low, mid) if lawkit.detection_power(law, wrong_law, mid, ALPHA) >= power else (mid, high)
    return high


def _describe(label: str, result: lawkit.ChiSquare, samples: int, extra: str = "") -> str:
    line = (
        f"{label}: chi2 = {result.statistic:.1f}, threshold {result.threshold:.1f} (dof {result.dof}, "
        f"alpha {ALPHA:g}, N {samples}), {result.impossible} samples on zero-probability outcomes"
    )
    line = f"{line}; {extra}" if extra else line
    print(line)  # visible with pytest -s
    return line


def _run(tables, verifier, samples: int, seed: int, dtype=torch.float64):
    width = len(tables.target) - 1
    law = lawkit.target_law(tables, width + 1)
    _check_validity(law, samples)
    generator = torch.Generator().manual_seed(seed)
    counts = lawkit.sample_emissions(tables, width, samples, verifier, generator, dtype=dtype)
    assert int(counts.sum()) == samples
    return law, counts


# --- the real verifiers pass ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", TABLES)
def test_random_tables_match_target_law(case, sampled_rule, dtype):
    tables = random_case(case)
    width, samples = TABLES[case][1], TABLES[case][3]
    law, counts = _run(tables, RULES[sampled_rule].verify, samples, seed=1, dtype=DTYPES[dtype])
    result = lawkit.chi_square(counts, law, ALPHA)
    powers = _powers(tables, width, sampled_rule, law, samples)
    message = _describe(f"{case} {sampled_rule} {dtype}", result, samples, powers)
    assert result.passed, message


@pytest.mark.parametrize("case", ADVERSARIAL)
def test_adversarial_drafts_match_target_law(case, sampled_rule):
    tables = adversarial_case(case)
    width, samples = len(tables.target) - 1, TABLES["V3K3"][3]
    verifier = RULES[sampled_rule].verify
    if case == "one_hot_draft":
        verifier = _none_draft(verifier)
    law, counts = _run(tables, verifier, samples, seed=2)
    result = lawkit.chi_square(counts, law, ALPHA)
    # Some of these drafts cannot expose some mistakes at all: the powers printed say which. Draft = target never
    # rejects; with V = 3 a reversed target makes max(target - draft, 0) and max(w target - draft, 0) the same
    # one-hot row (the middle entry cancels, one end is negative), so the unscaled residual is exact there.
    message = _describe(f"{case} {sampled_rule}", result, samples, _powers(tables, width, sampled_rule, law, samples))
    assert result.passed, message


# --- negative controls: the same test at the same N must reject a broken verifier ------------------------------


@pytest.mark.parametrize("name", BROKEN)
def test_broken_verifier_fails_the_same_test(name):
    _, verifier, step = BROKEN[name]
    _negative_control(name, verifier, step)


def test_rule_with_its_residual_ignored_fails_the_same_test(sampled_rule):
    """The negative control every registered rule gets (``residual_ignored``)."""
    _negative_control(f"{sampled_rule}_residual_ignored", *residual_ignored(sampled_rule))


def _negative_control(name: str, verifier, step: lawkit.StepLaw) -> None:
    tables = random_case("V3K3")
    width, samples = TABLES["V3K3"][1], TABLES["V3K3"][3]  # the same N as the passing V3K3 tests
    law = lawkit.target_law(tables, width + 1)
    wrong_law = lawkit.speculative_law(tables, width, step)
    power = lawkit.detection_power(law, wrong_law, samples, ALPHA)
    error = lawkit.max_abs_error(law, wrong_law)
    needed = _samples_for_power(law, wrong_law)
    assert power >= MIN_POWER, f"{name}: power {power:.3g} < {MIN_POWER} at N {samples} (law error {error:.2g})"

    law, counts = _run(tables, verifier, samples, seed=1)
    result = lawkit.chi_square(counts, law, ALPHA)
    message = _describe(
        f"NEGATIVE CONTROL {name}",
        result,
        samples,
        f"power {power:.6f} (0.99 from N = {needed}), max joint-law error {error:.3g}",
    )
    assert not result.passed, "the broken verifier PASSED the test that should catch it: " + message

    # The failure is the predicted one: the broken verifier's samples do follow its own closed form (so the
    # power computed above is the power against what it actually does).
    _check_validity(wrong_law, samples)
    own = lawkit.chi_square(counts, wrong_law, ALPHA)
    assert own.passed, _describe(f"{name} against its own closed form", own, samples)


# --- the toy example of docs/algorithms.md through the real verifiers ----------------------------------------------


def test_toy_example_mean_accepted():
    """V = 2, context-free target (1/3, 2/3), draft (2/3, 1/3), K = 2: E[tau] = 10/9 (token), 11/9 (block)."""
    samples, width = 200_000, 2
    target = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64)
    draft = torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    # tau lies in [0, K], so its standard deviation is at most K / 2 (Popoviciu); 5 standard errors:
    tolerance = 5 * (width / 2) / math.sqrt(samples)
    assert 1 / 9 > 4 * tolerance  # the two rules are far apart at this N (gap 0.111 vs tolerance 0.011)
    expected = {"token": 10 / 9, "block": 11 / 9}
    means = {}
    for seed, rule in enumerate(("token", "block")):
        verifier = RULES[rule].verify
        generator = torch.Generator().manual_seed(10 + seed)
        draft_tokens = torch.multinomial(draft, samples * width, replacement=True, generator=generator)
        draft_tokens = draft_tokens.reshape(samples, width)
        out = verifier(
            draft_tokens, draft.expand(samples, width, 2), target.expand(samples, width + 1, 2), generator=generator
        )
        means[rule] = float(out.num_accepted.double().mean())
        print(
            f"toy {rule}: mean accepted {means[rule]:.4f}, exact {expected[rule]:.4f}, "
            f"tolerance {tolerance:.4f} (N {samples})"
        )
        assert abs(means[rule] - expected[rule]) <= tolerance, (
            f"toy {rule}: Monte-Carlo mean accepted {means[rule]:.4f}, exact {expected[rule]:.4f}, "
            f"tolerance {tolerance:.4f} (5 standard errors at N {samples})"
        )
    # Distinguishable: each estimate is much closer to its own rule's value than to the other's.
    assert means["block"] - means["token"] > 1 / 9 - 2 * tolerance, means
