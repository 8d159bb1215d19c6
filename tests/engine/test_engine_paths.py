"""Multi-path drafting in the engine (``SpeculativeDecoder(..., paths=k, max_draft=L, paths_drawn=...)``): the output
law is exactly the target's under both drawings, greedy output is plain greedy decoding, rows do not depend on their
neighbours, and after every step both caches hold exactly the committed tokens they have read.

The law tests follow test_engine_tree.py, on a draft far from the target (so that the drawing scheme the verifier is
told matters at this N): the exact law of the engine's first LENGTH = 4 tokens (``enginekit.engine_tree_law`` over
every set of paths that multipathkit draws, merged into their prefix tree) against the target's, then SAMPLES rows of
the real engine, pooled joint chi-square at ALPHA, and a NEGATIVE CONTROL that must fail the same test: the engine
verifying the paths' prefix tree as if its siblings had been drawn i.i.d. (tree scheme "iid"), which is lossy for both
drawings (docs/algorithms.md, "Multi-path verification").

Figures (statistic vs threshold, power) are printed: run with ``pytest -s`` to see them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from kits import enginekit, lawkit
from kits.enginekit import CacheCheck, reference_greedy
from kits.tiny import perturbed, tiny_model

from blockspec import SamplingParams, SpeculativeDecoder, engine
from blockspec.drafting.lookup import PromptLookup
from blockspec.policy import FixedLength

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = 1e-4  # false-alarm probability of each chi-square test
MIN_POWER = 0.99  # required power of the same test against the control (from its exact law)
VOCAB, LENGTH, SAMPLES = 4, 4, 4000
POOLED = lawkit.PooledChiSquare(SAMPLES, ALPHA)
PROMPT = [1, 2, 3]
ENUMERATION_TOLERANCE = 1e-12  # the correct engine's enumerated law vs the target's, both float64
CONTROL_ERROR = 1e-5  # the control's enumerated law is at least this far from the target's
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]  # rows of different lengths
DRAWINGS = ("distinct", "iid")


@pytest.fixture(scope="module")
def tables(device):
    """The processed tables of a peaked target and a draft far from it, and the two models."""
    target = tiny_model(vocab=VOCAB, sharpness=3.0)
    draft = perturbed(target, scale=2.0, seed=1).to(device)
    target = target.to(device)
    logits = [lawkit.logit_tables(model, PROMPT, VOCAB, LENGTH) for model in (target, draft)]
    return target, draft, *(lawkit.processed(table, SamplingParams()) for table in logits)


def paths_law(target, draft, paths: int, length: int, drawn: str, rule: str, scheme: str = "distinct"):
    """The exact law of the engine's first LENGTH tokens with ``paths`` paths of ``length`` drawn as ``drawn``,
    verified under the tree ``scheme`` ("distinct": the engine's; "iid": the control)."""
    drafts = enginekit.path_drafts(paths, drawn)
    target, draft = enginekit.table_lookup(target, VOCAB), enginekit.table_lookup(draft, VOCAB)
    return enginekit.engine_tree_law(VOCAB, LENGTH, length, drafts, target, draft, rule, scheme=scheme)


@pytest.mark.parametrize("drawn", DRAWINGS)
@pytest.mark.parametrize("paths, length, rule", [(2, 1, "block"), (2, 2, "token"), (3, 1, "token"), (3, 2, "block")])
def test_the_exact_law_of_a_paths_decoder_is_the_target_law(tables, drawn, paths, length, rule):
    _, _, target, draft = tables
    law = lawkit.target_law(lawkit.Tables(VOCAB, target, target), LENGTH)
    assert lawkit.max_abs_error(paths_law(target, draft, paths, length, drawn, rule), law) < ENUMERATION_TOLERANCE
    wrong = paths_law(target, draft, paths, length, drawn, rule, scheme="iid")
    assert lawkit.max_abs_error(wrong, law) > CONTROL_ERROR, "the enumeration cannot tell the control"


@dataclass(frozen=True)
class Case:
    paths: int
    length: int
    drawn: str


CASES = {"iid": Case(3, 2, "iid"), "distinct": Case(3, 1, "distinct")}
CONTROL = 'the prefix tree verified under the tree scheme "iid"'


def iid_scheme(monkeypatch) -> dict[str, int]:
    """Patches the engine's block tree verifier into the control (CONTROL); returns a call counter."""
    verify = engine.TREE_VERIFIERS["block"]
    calls = {"tree": 0}

    def wrongly(*args, scheme, **kwargs):
        calls["tree"] += 1
        return verify(*args, scheme="iid", **kwargs)

    monkeypatch.setitem(engine.TREE_VERIFIERS, "block", wrongly)
    return calls


def run(decoder: SpeculativeDecoder):
    result = decoder.generate([PROMPT] * SAMPLES, max_new_tokens=LENGTH, seed=0, stop_on_eos=False)
    return lawkit.joint_counts(result.sequences, VOCAB), result


@pytest.mark.parametrize("name", CASES)
def test_first_tokens_of_a_paths_decoder_follow_the_target_law(tables, name, monkeypatch):
    case = CASES[name]
    target_model, draft_model, target, draft = tables
    law = lawkit.target_law(lawkit.Tables(VOCAB, target, target), LENGTH)
    wrong_law = paths_law(target, draft, case.paths, case.length, case.drawn, "block", scheme="iid")
    power = POOLED.power(law, wrong_law)
    assert power >= MIN_POWER, f"{name}: power {power:.3g} < {MIN_POWER} against the control"

    def decoder():
        return SpeculativeDecoder(
            target_model, draft_model, paths=case.paths, max_draft=case.length, paths_drawn=case.drawn
        )

    counts, result = run(decoder())
    test = POOLED.test(counts, law)
    assert test.passed, POOLED.describe(name, test)
    POOLED.describe(f"{name} (block efficiency {result.block_efficiency:.2f})", test)
    accepted = [a for s in result.stats for a in s.accepted]
    assert min(accepted) == 0 and max(accepted) == case.length, "paths were not both accepted and rejected"
    if case.drawn == "iid":  # agreeing paths were merged: some steps scored fewer nodes than k * L
        verified = [v for s in result.stats if s.drafted == case.length for v in s.verified]
        assert min(verified) < case.paths * case.length == max(verified)

    calls = iid_scheme(monkeypatch)
    counts, _ = run(decoder())
    assert calls["tree"] > 0, "the control's patch was never exercised"
    POOLED.check_control(f"{name} [{CONTROL}]", counts, law, wrong_law)


# --- greedy equivalence, rows, caches, refusals -------------------------------------------------------------------


@pytest.mark.parametrize("drawn", DRAWINGS)
def test_greedy_output_of_a_paths_decoder_equals_plain_greedy_decoding(pair, drawn):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, paths=3, max_draft=3, paths_drawn=drawn)
    result = decoder.generate(PROMPTS, max_new_tokens=24, sampling=GREEDY)
    for b, prompt in enumerate(PROMPTS):
        assert result.sequences[b] == reference_greedy(target, prompt, 24), f"row {b}"
    assert 1.3 < result.block_efficiency < 4  # drafts were both accepted and rejected
    # at temperature 0, i.i.d. paths are all the draft's greedy chain, one node per level; distinct paths rank 3
    assert max(v for s in result.stats for v in s.verified) == (3 if drawn == "iid" else 9)


@pytest.mark.parametrize("drawn", DRAWINGS)
def test_a_row_of_a_paths_decoder_does_not_depend_on_its_neighbours(pair, drawn):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, paths=3, max_draft=2, paths_drawn=drawn)
    together = decoder.generate(PROMPTS, max_new_tokens=20, seed=[11, 12, 13, 14])
    for b, prompt in enumerate(PROMPTS):
        alone = decoder.generate([prompt], max_new_tokens=20, seed=[11 + b])
        assert alone.sequences[0] == together.sequences[b]


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams()], ids=["greedy", "sampled"])
def test_after_every_step_of_iid_paths_the_caches_hold_the_committed_tokens(pair, sampling, monkeypatch):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, paths=3, max_draft=3, paths_drawn="iid")
    check = CacheCheck(decoder, {"target": target, "draft": draft}, monkeypatch)
    result = decoder.generate(PROMPTS, max_new_tokens=24, sampling=sampling, seed=0)
    assert check.steps == len(result.stats) and result.block_efficiency > 1.3


def test_what_paths_need_is_checked(pair):
    target, draft = pair
    for kwargs, message in [
        ({"paths": 0}, "paths must be an int >= 1"),
        ({"paths": 2.0}, "paths must be an int >= 1"),
        ({"paths": 2, "paths_drawn": "sorted"}, "paths_drawn must be one of"),
        ({"paths": 9, "max_draft": 8}, "72 nodes per step, more than 64"),
        ({"paths": 2, "tree": (2, 1)}, "pass one of them"),
        ({"paths_drawn": "iid"}, "pass paths too"),
        ({"paths": 2, "policy": FixedLength(3)}, "no length policy"),
        ({"paths": 2, "lookup": PromptLookup()}, "prompt lookup"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeDecoder(target, draft, **kwargs)
    with pytest.raises(ValueError, match="paths are drafted by a draft model"):
        SpeculativeDecoder(target, paths=2)
