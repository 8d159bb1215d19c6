"""Tree drafting in the engine (``SpeculativeDecoder(..., tree=shape)``): the output law is exactly the target's, greedy
output is plain greedy decoding, and after every step both caches hold exactly the committed tokens they have read.

The law test follows test_engine_sampling_law.py: SAMPLES rows of one prompt on a tiny model pair (V = 4 tokens), the
JOINT law of the first LENGTH = 4 tokens (256 outcomes) against the target's own law computed by enumeration, Pearson's
chi-square at ALPHA after pooling sparse outcomes. With LENGTH = 4 the first step drafts the whole tree (depth 3 for
(2, 1, 1)), later steps what still fits. Each case has a NEGATIVE CONTROL, a subtly wrong engine made by instance-level
patches, whose exact law (``enginekit.engine_tree_law``: every tree enumerated, the verifier's closed form) gives the
test's power against it (>= MIN_POWER, asserted before sampling) and which must fail the same test at the same N.

Figures (statistic vs threshold, power) are printed: run with ``pytest -s`` to see them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from kits import enginekit, lawkit, treekit
from kits.enginekit import CacheCheck, reference_greedy
from kits.tiny import perturbed, tiny_model

from blockspec import SamplingParams, SpeculativeDecoder, engine
from blockspec.drafting import TreeProposer
from blockspec.drafting.lookup import PromptLookup
from blockspec.models.hf import HFModel
from blockspec.policy import AdaptiveShape, FixedLength, LatencyTable
from blockspec.policy.latency import LatencyProfile
from blockspec.policy.shapes import tree_nodes

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHA = 1e-4  # false-alarm probability of each chi-square test
MIN_EXPECTED = 5.0  # Cochran's rule: outcomes expected fewer times are pooled
MIN_POWER = 0.99  # required power of the same test against each negative control (from its exact law)
VOCAB, LENGTH, SAMPLES = 4, 4, 4000
POOLED = lawkit.PooledChiSquare(SAMPLES, ALPHA, MIN_EXPECTED)
PROMPT = [1, 2, 3]
ENUMERATION_TOLERANCE = 1e-12  # the correct engine's enumerated law vs the target's, both float64
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]  # rows of different lengths


def parent_rows(target_probs: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """target_probs [B, N+1, V] with every node's row replaced by its parent's (the root's stays): the verifier is
    handed the target's law one token short of each node's path, a wrong node's row."""
    live = torch.arange(1, parents.shape[1] + 1, device=parents.device) <= num_nodes[:, None]  # [B, N]
    own = torch.arange(1, parents.shape[1] + 1, device=parents.device)  # padding keeps its own row
    above = torch.nn.functional.pad(parents.clamp(min=0).where(live, own), (1, 0))  # [B, N+1]
    return target_probs.gather(1, above[..., None].expand(-1, -1, target_probs.shape[-1]))


@dataclass(frozen=True)
class Case:
    sampling: SamplingParams
    shape: tuple[int, ...]
    rule: str


# The control of every case is ``parent_rows``. Telling the verifier the siblings were drawn i.i.d. is lossy too, but
# on these models its joint-law error is 2e-4 to 2e-3 (power < 0.001 at this N): a control this test cannot see.
CASES = {
    "block": Case(SamplingParams(), (2, 1, 1), "block"),
    "token": Case(SamplingParams(), (2, 1, 1), "token"),
    # top-k 2 leaves a root with 3 slots one child short: every tree has a hole, renumbered away
    "top_k_block": Case(SamplingParams(top_k=2), (3, 1), "block"),
}
CONTROL = "every node's target row replaced by its parent's"


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


def tree_law(target, draft, case: Case, *, wrong: bool = False) -> torch.Tensor:
    """The exact law of the engine's first LENGTH tokens, or of the control's (``wrong``)."""

    def verified(trees: treekit.Trees) -> torch.Tensor:
        return parent_rows(trees.target_probs, trees.parents, trees.num_nodes)

    return enginekit.engine_tree_law(
        VOCAB,
        LENGTH,
        len(case.shape),
        enginekit.tree_drafts(case.shape),
        enginekit.table_lookup(target, VOCAB),
        enginekit.table_lookup(draft, VOCAB),
        case.rule,
        verified=verified if wrong else None,
    )


# --- the engine, right and subtly wrong ---------------------------------------------------------------------------


def wrong_engine(case: Case, monkeypatch) -> dict[str, int]:
    """Patches the engine's tree verifier of ``case.rule`` (``engine.TREE_VERIFIERS``) into the control (CONTROL);
    returns a call counter, so the test can check the patch was exercised."""
    verify = engine.TREE_VERIFIERS[case.rule]
    calls = {"tree": 0}

    def wrongly(draft_tokens, parents, draft_probs, target_probs, *, num_nodes, **kwargs):
        calls["tree"] += 1
        target_probs = parent_rows(target_probs, parents, num_nodes)
        return verify(draft_tokens, parents, draft_probs, target_probs, num_nodes=num_nodes, **kwargs)

    monkeypatch.setitem(engine.TREE_VERIFIERS, case.rule, wrongly)
    return calls


def run(decoder: SpeculativeDecoder, case: Case):
    result = decoder.generate(
        [PROMPT] * SAMPLES, max_new_tokens=LENGTH, sampling=case.sampling, seed=0, stop_on_eos=False
    )
    return lawkit.joint_counts(result.sequences, VOCAB), result


@pytest.mark.parametrize("name", CASES)
def test_first_tokens_of_a_tree_decoder_follow_the_target_law(models, name, monkeypatch):
    case = CASES[name]
    target_model, draft_model, target_logits, draft_logits = models
    target, draft = lawkit.processed(target_logits, case.sampling), lawkit.processed(draft_logits, case.sampling)
    law = lawkit.target_law(lawkit.Tables(VOCAB, target, target), LENGTH)

    # Exact, before sampling: the correct engine's steps give the target's law, and the control's law is far enough
    # from it that this test at this N rejects it almost surely.
    assert lawkit.max_abs_error(tree_law(target, draft, case), law) < ENUMERATION_TOLERANCE
    wrong_law = tree_law(target, draft, case, wrong=True)
    power = POOLED.power(law, wrong_law)
    assert power >= MIN_POWER, f"{name}: power {power:.3g} < {MIN_POWER} against the control"

    decoder = SpeculativeDecoder(target_model, draft_model, rule=case.rule, tree=case.shape)
    counts, result = run(decoder, case)
    test = POOLED.test(counts, law)
    assert test.passed, POOLED.describe(name, test)
    POOLED.describe(f"{name} (block efficiency {result.block_efficiency:.2f})", test)
    accepted = [a for s in result.stats for a in s.accepted]
    assert min(accepted) == 0 and max(accepted) == len(case.shape), "trees were not both accepted and rejected"

    broken = SpeculativeDecoder(target_model, draft_model, rule=case.rule, tree=case.shape)
    calls = wrong_engine(case, monkeypatch)
    counts, _ = run(broken, case)
    assert calls["tree"] > 0, "the control's patch was never exercised"
    POOLED.check_control(f"{name} [{CONTROL}]", counts, law, wrong_law)


# --- the same law through llama.cpp's tree forward (models/llamacpp.py) ----------------------------------------------

# Rows per generate call on llama.cpp: a row and each leaf of its (2, 1, 1) tree beyond the first take one of the
# 256 sequence ids of a llama.cpp context
LLAMA_ROWS = 128


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory):
    """The block case's pair, as the ``models`` fixture builds it, written as GGUFs (kits/tinygguf.py), with its
    transformers tables."""
    pytest.importorskip("llama_cpp")
    from kits.tinygguf import save_gguf

    target = tiny_model(vocab=VOCAB, sharpness=3.0)
    draft = perturbed(target, scale=0.4, seed=1)
    folder = tmp_path_factory.mktemp("gguf")
    return (
        save_gguf(target, folder / "target.gguf"),
        save_gguf(draft, folder / "draft.gguf"),
        lawkit.logit_tables(target, PROMPT, VOCAB, LENGTH),
        lawkit.logit_tables(draft, PROMPT, VOCAB, LENGTH),
    )


def test_first_tokens_of_a_tree_decoder_on_llama_cpp_follow_the_target_law(gguf_models, monkeypatch):
    """The block case with target and draft on the llama.cpp adapter (its own f16 attention), in calls of LLAMA_ROWS
    rows: the law is transformers', whose logits llama.cpp's match to 4e-4 (tests/models/test_tinygguf.py), a change
    of the law this test cannot see at this N; the same control must fail it."""
    from blockspec.models.llamacpp import LlamaCppModel

    case = CASES["block"]
    target_path, draft_path, target_logits, draft_logits = gguf_models
    target, draft = lawkit.processed(target_logits, case.sampling), lawkit.processed(draft_logits, case.sampling)
    law = lawkit.target_law(lawkit.Tables(VOCAB, target, target), LENGTH)
    wrong_law = tree_law(target, draft, case, wrong=True)
    power = POOLED.power(law, wrong_law)
    assert power >= MIN_POWER, f"power {power:.3g} < {MIN_POWER} against the control"

    def sample() -> tuple[torch.Tensor, list[int]]:
        def model(path: str) -> LlamaCppModel:
            return LlamaCppModel(path, None, eos_token_ids=(VOCAB - 1,), threads=1)

        decoder = SpeculativeDecoder(model(target_path), model(draft_path), rule=case.rule, tree=case.shape)
        counts, accepted = torch.zeros([VOCAB] * LENGTH, dtype=torch.float64), []
        for start in range(0, SAMPLES, LLAMA_ROWS):
            rows = min(LLAMA_ROWS, SAMPLES - start)
            result = decoder.generate(
                [PROMPT] * rows, max_new_tokens=LENGTH, sampling=case.sampling, seed=start, stop_on_eos=False
            )
            counts += lawkit.joint_counts(result.sequences, VOCAB)
            accepted += [a for s in result.stats for a in s.accepted]
        return counts, accepted

    counts, accepted = sample()
    test = POOLED.test(counts, law)
    assert test.passed, POOLED.describe("llama.cpp block", test)
    POOLED.describe("llama.cpp block", test)
    assert min(accepted) == 0 and max(accepted) == len(case.shape), "trees were not both accepted and rejected"

    calls = wrong_engine(case, monkeypatch)
    counts, _ = sample()
    assert calls["tree"] > 0, "the control's patch was never exercised"
    POOLED.check_control(f"llama.cpp block [{CONTROL}]", counts, law, wrong_law)


# --- an adaptive shape: the tree or chain of each step chosen from costs and the alpha learnt so far ---------------

# A flat target forward and a draft forward a tenth of it make the choice turn on alpha. From LOW_PRIOR (one candidate
# seldom accepted, two nearly always) the first step drafts the tree (3,); once alpha is learnt from the tiny pairs
# (alpha_1 about 0.9), a chain. memory=0: each step's alpha is the previous step's own.
FLAT = LatencyProfile(LatencyTable((1,), (1,), ((1.0,),)), LatencyTable((1,), (1,), ((0.1,),)), None, meta={})
LOW_PRIOR = (0.3, 0.95, 0.99, 1.0)


def adaptive(monkeypatch, max_draft: int = 3) -> tuple[AdaptiveShape, list[tuple[int, ...]], list[int]]:
    """An ``AdaptiveShape`` over FLAT from LOW_PRIOR, the list of the shapes it chooses, step by step, and the list of
    the catch-ups it was asked at."""
    shape, chosen, catch_ups = AdaptiveShape(FLAT, max_draft=max_draft, prior=LOW_PRIOR, memory=0.0), [], []
    choose = shape.choose

    def recorded(batch: int, catch_up: int = 1) -> tuple[int, ...]:
        chosen.append(choose(batch, catch_up))
        catch_ups.append(catch_up)
        return chosen[-1]

    monkeypatch.setattr(shape, "choose", recorded)
    return shape, chosen, catch_ups


def shapes_law(target, draft, shapes: list[tuple[int, ...]], rule: str, *, wrong: bool = False) -> torch.Tensor:
    """The exact law of the engine's first LENGTH tokens when step i drafts ``shapes[i]`` (the last one on, at steps
    a run did not reach), or of the control's (``wrong``)."""

    def verified(trees: treekit.Trees) -> torch.Tensor:
        return parent_rows(trees.target_probs, trees.parents, trees.num_nodes)

    return enginekit.engine_shapes_law(
        VOCAB,
        LENGTH,
        shapes + [shapes[-1]] * LENGTH,
        enginekit.table_lookup(target, VOCAB),
        enginekit.table_lookup(draft, VOCAB),
        rule,
        verified=verified if wrong else None,
    )


def test_first_tokens_of_a_decoder_choosing_tree_or_chain_each_step_follow_the_target_law(models, monkeypatch):
    """The shapes change between steps (a tree, then chains), chosen from what earlier steps verified: the joint law
    is still the target's, exactly (enumerated for the shapes the run chose) and in the engine's samples."""
    case = Case(SamplingParams(), (), "block")
    target_model, draft_model, target_logits, draft_logits = models
    target, draft = lawkit.processed(target_logits, case.sampling), lawkit.processed(draft_logits, case.sampling)
    law = lawkit.target_law(lawkit.Tables(VOCAB, target, target), LENGTH)

    shape, chosen, _ = adaptive(monkeypatch)
    counts, result = run(SpeculativeDecoder(target_model, draft_model, rule=case.rule, tree=shape), case)
    assert chosen[0] == (3,) and all(s and max(s) == 1 for s in chosen[1:]), chosen
    assert lawkit.max_abs_error(shapes_law(target, draft, chosen, case.rule), law) < ENUMERATION_TOLERANCE
    test = POOLED.test(counts, law)
    assert test.passed, POOLED.describe("adaptive", test)
    POOLED.describe(f"adaptive {chosen} (block efficiency {result.block_efficiency:.2f})", test)

    shape, chosen, _ = adaptive(monkeypatch)
    broken = SpeculativeDecoder(target_model, draft_model, rule=case.rule, tree=shape)
    calls = wrong_engine(case, monkeypatch)
    counts, _ = run(broken, case)
    assert calls["tree"] > 0 and len(set(chosen)) > 1, chosen
    wrong_law = shapes_law(target, draft, chosen, case.rule, wrong=True)
    power = POOLED.power(law, wrong_law)
    assert power >= MIN_POWER, f"power {power:.3g} < {MIN_POWER} against the control"
    POOLED.check_control(f"adaptive [{CONTROL}]", counts, law, wrong_law)


def test_greedy_output_of_a_decoder_choosing_tree_or_chain_equals_plain_greedy_decoding(pair, monkeypatch):
    target, draft = pair
    shape, chosen, catch_ups = adaptive(monkeypatch, max_draft=4)
    result = SpeculativeDecoder(target, draft, tree=shape).generate(PROMPTS, max_new_tokens=24, sampling=GREEDY)
    for b, prompt in enumerate(PROMPTS):
        assert result.sequences[b] == reference_greedy(target, prompt, 24), f"row {b}"
    assert any(max(s) > 1 for s in chosen) and any(max(s) == 1 for s in chosen), chosen
    # every step drafts, so the draft has 1 token to read, 2 after a step that accepted a whole path
    assert catch_ups[0] == 1 and set(catch_ups) == {1, 2}, catch_ups


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams()], ids=["greedy", "sampled"])
def test_after_every_step_of_a_changing_shape_the_caches_hold_the_committed_tokens(pair, sampling, monkeypatch):
    target, draft = pair
    shape, chosen, _ = adaptive(monkeypatch, max_draft=4)
    decoder = SpeculativeDecoder(target, draft, tree=shape)
    check = CacheCheck(decoder, {"target": target, "draft": draft}, monkeypatch)
    result = decoder.generate(PROMPTS, max_new_tokens=24, sampling=sampling, seed=0)
    assert check.steps == len(result.stats) and len(set(chosen)) > 1, chosen
    for shape, step in zip(chosen, result.stats, strict=True):  # each step drafted the shape chosen for it
        assert step.drafted <= len(shape) and max(step.verified) <= tree_nodes(shape), (shape, step)
    assert result.stats[0].drafted == len(chosen[0]) and max(result.stats[0].verified) == tree_nodes(chosen[0])


def test_the_shape_estimator_draws_from_its_own_generator(pair, monkeypatch):
    """An adaptive shape that chooses the tree (2, 1, 1) every step, whose widest shape has as many nodes (so the rows
    draw as much randomness a step), decodes the static tree's tokens: learning alpha, with its own generator,
    consumed none of the rows' randomness, nor the global generator's."""
    target, draft = pair
    shape = AdaptiveShape(FLAT, max_draft=6)
    monkeypatch.setattr(shape, "choose", lambda batch, catch_up: (2, 1, 1))
    static = SpeculativeDecoder(target, draft, tree=(2, 1, 1)).generate(PROMPTS, max_new_tokens=20, seed=5)
    state = torch.get_rng_state()
    adaptive_run = SpeculativeDecoder(target, draft, tree=shape).generate(PROMPTS, max_new_tokens=20, seed=5)
    assert torch.equal(torch.get_rng_state(), state)
    assert adaptive_run.sequences == static.sequences
    assert not torch.equal(shape.alpha, shape.prior)  # it did learn


# --- greedy equivalence, caches, rows, refusals -------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 1, 1), (3, 2), (1, 1, 1, 1)])
def test_greedy_output_of_a_tree_decoder_equals_plain_greedy_decoding(pair, shape):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, tree=shape)
    result = decoder.generate(PROMPTS, max_new_tokens=24, sampling=GREEDY)
    for b, prompt in enumerate(PROMPTS):
        assert result.sequences[b] == reference_greedy(target, prompt, 24), f"row {b}"
    assert 1.3 < result.block_efficiency < len(shape) + 1  # drafts were both accepted and rejected


def first_path(self, rows, proposal, target_probs, out):
    """A broken ``TreeProposer.observe``: the draft keeps the path of first children (nodes 1, 3, 5 of a full
    (2, 1, 1) tree) as deep as the accepted one, not the accepted path."""
    if self.waiting:
        path = out.accepted_nodes
        first = torch.tensor([1, 3, 5], device=path.device)[: path.shape[1]]
        self.accepted = torch.where(path >= 0, first, -1)


# The broken run fails only if some accepted path left the first children: that it fails shows that paths did.
@pytest.mark.parametrize("broken", [False, True], ids=["right", "keeps the first path"])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams()], ids=["greedy", "sampled"])
def test_after_every_tree_step_the_caches_hold_the_committed_tokens(pair, sampling, broken, monkeypatch):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, tree=(2, 1, 1))
    check = CacheCheck(decoder, {"target": target, "draft": draft}, monkeypatch)
    if broken:
        monkeypatch.setattr(TreeProposer, "observe", first_path)
        with pytest.raises(AssertionError, match="draft"):
            decoder.generate(PROMPTS, max_new_tokens=24, sampling=sampling, seed=0)
        return
    result = decoder.generate(PROMPTS, max_new_tokens=24, sampling=sampling, seed=0)
    assert check.steps == len(result.stats) and result.block_efficiency > 1.3


def test_a_row_does_not_depend_on_its_neighbours(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, tree=(2, 1, 1))
    together = decoder.generate(PROMPTS, max_new_tokens=20, seed=[11, 12, 13, 14])
    for b, prompt in enumerate(PROMPTS):
        alone = decoder.generate([prompt], max_new_tokens=20, seed=[11 + b])
        assert alone.sequences[0] == together.sequences[b]


class ChainOnly(HFModel):
    """A LanguageModel that does not score trees: HFModel with forward_tree and commit set to None, which a
    runtime-checkable protocol reads as absent (a ``__getattr__`` proxy would not do: from Python 3.12 on,
    ``isinstance`` reads a protocol's members statically, so a proxy is no LanguageModel at all)."""

    forward_tree = None  # type: ignore[assignment]
    commit = None  # type: ignore[assignment]


def test_what_a_tree_needs_is_checked(pair):
    target, draft = pair
    for shape, message in [
        ((), "non-empty"),
        ((2, 0), "ints >= 1"),
        ("21", "non-empty sequence"),
        ((2.0,), ">= 1"),
        ((1000, 1000, 1000), "more than 64"),  # counted, not built
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeDecoder(target, draft, tree=shape)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drafted by a draft model"):
        SpeculativeDecoder(target, tree=(2, 1))
    with pytest.raises(ValueError, match="no length policy"):
        SpeculativeDecoder(target, draft, tree=(2, 1), policy=FixedLength(3))
    with pytest.raises(ValueError, match="no length policy"):
        SpeculativeDecoder(target, draft, tree=(2, 1), policy="sv")
    with pytest.raises(ValueError, match="prompt lookup"):
        SpeculativeDecoder(target, draft, tree=(2, 1), lookup=PromptLookup())
    for role, models in (("target", (ChainOnly(target), draft)), ("draft", (target, ChainOnly(draft)))):
        with pytest.raises(ValueError, match=f"needs a {role} that scores trees"):
            SpeculativeDecoder(*models, tree=(2, 1))
    decoder = SpeculativeDecoder(target, draft, tree=(2, 1))
    with pytest.raises(ValueError, match="temperature 0 only"):
        decoder.generate(PROMPTS, max_new_tokens=4, draft_sampling=GREEDY)
