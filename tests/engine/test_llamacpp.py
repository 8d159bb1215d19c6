"""The llama.cpp adapter (``blockspec.models.llamacpp.LlamaCppModel``) on tiny GGUFs written from in-process
transformers models (``kits.tinygguf.save_gguf``): the ``LanguageModel`` contract, greedy equality with llama.cpp's
own decoding, tree drafting through the adapter's tree forward (its contract: tests/models/test_tree_protocol.py and
test_tree_llamacpp.py; its law: tests/engine/test_engine_tree.py), and the engine's exact law at temperature 1
through the adapter.

Tolerances. llama.cpp keeps K and V in an f16 cache (its default, the adapter's): attention reads values rounded to
11 significant bits (unit roundoff 4.9e-4), an error the output head scales and the context accumulates. Measured
|adapter - transformers| on the sharpness-5, V = 48 model of these tests (30 random rows): at most 6.6e-4 within 8
positions, 2.3e-3 within 64 (tests/models/test_tinygguf.py: 3.4e-4 at sharpness 3 over 40 positions; the error
scales with the head). Rows here stay under 64 tokens: F16_ATOL = 5e-3, twice the worst measured. The bugs these
tests are after are far bigger: a context token dropped or duplicated moves these logits by 0.07 to 0.11, a
neighbouring slot's logits differ by O(1), and where a near miss is at hand the tests assert that it fails.

Decodes of other shapes are not bitwise equal. Below about 45 tokens in one ``llama_decode`` they differ by at most
5e-7 (float reassociation), from about 64 tokens at the f16 level (measured: a row's logits move by 1.6e-4 when 60
other tokens share its prefill, 1.2e-3 between a 64-token forward and 64 one-token forwards). So rows batched vs
decoded alone, and a cache rebuilt by one prefill vs grown token by token, are compared at F16_ATOL; only a replay
(the same decode on the same cache) is compared bit for bit. Greedy paths here come within 1.4e-3 of a tie (the
top-2 logit gap at token 29 after the prompt [14]; 2.5e-3 after [8, 9]): above the 5e-7 of the engine's small
decodes, so greedy outputs are compared exactly, and a divergence is reported with its gap.

A hole that took a position cannot shift logits silently: llama.cpp refuses a batch whose positions do not follow
its row's cache (``llama_decode`` fails). RoPE being relative, such a gap would move these logits by only 1e-3 to
3e-3 (measured), below F16_ATOL, so the tests rely on that refusal and on the exact replay, not on the tolerance.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from kits import enginekit, lawkit
from kits.svkit import hand_profile, profile
from kits.tiny import VOCAB, perturbed, tiny_model
from kits.tinygguf import save_gguf

from blockspec import PromptLookup, SamplingParams, SpeculativeDecoder
from blockspec.models import llamacpp
from blockspec.models.llamacpp import MAX_ROWS, LlamaCppModel
from blockspec.models.vocab_cut import VocabularyCut, cut_vocabulary, read_cut
from blockspec.policy import AdaptiveLength, SVPolicy
from blockspec.sampling import process
from blockspec.verify import RULES

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = pytest.mark.usefixtures("one_thread", "probes_in_a_temporary_cache")

F16_ATOL = 5e-3  # |llama.cpp with its f16 KV cache - transformers| on rows under 64 tokens (module docstring)
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]  # [14]: the engine prefills an empty row
NEW_TOKENS = 30

# The law test: V = 6 tokens, so the first LENGTH = 3 tokens have 216 outcomes; DRAFT_LEN = 2 drafts 2 tokens in the
# first step, then what still fits (the step's last token is the target's own).
LAW_VOCAB, LENGTH, DRAFT_LEN, LAW_PROMPT = 6, 3, 2, [1, 2, 3]
LAW_CUT = 3  # a cut draft keeps tokens 0-2 and EOS (5): 3 and 4 never drafted; 3 in the prompt reads as 0
ALPHA = 1e-4  # false-alarm probability of the chi-square test
MIN_EXPECTED = 5.0  # Cochran's rule: outcomes expected fewer times share one pooled cell
MIN_POWER = 0.99  # required power of the same test against the negative control, from its exact law
# SAMPLES: from the exact laws, the test rejects the control with power 0.997 (block) and 0.994 (token) at N = 1024
# and above 0.9999999 for both from N = 1536. N = 4096 (16 generate calls of MAX_ROWS = 256, llama.cpp's limit on rows
# in one batch; ~5 s per rule) also gives power 0.993 against a target whose wide (verification) forwards return 1.3
# times its logits, a bug of the adapter rather than of the engine (1.15 times: 0.03; the contract tests above see
# that one, at 0.25 from transformers' logits).
SAMPLES = 4096
POOLED = lawkit.PooledChiSquare(SAMPLES, ALPHA, MIN_EXPECTED)


@dataclass(frozen=True)
class Files:
    target: object  # the transformers model the target GGUF was written from
    target_path: str
    draft_path: str
    draft: object  # the transformers model the draft GGUF was written from


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Files:
    folder = tmp_path_factory.mktemp("gguf")
    target = tiny_model(sharpness=5.0)
    draft = perturbed(target, scale=0.3, seed=1)
    return Files(target, save_gguf(target, folder / "target.gguf"), save_gguf(draft, folder / "draft.gguf"), draft)


@pytest.fixture(scope="module")
def law_files(tmp_path_factory) -> tuple[str, str]:
    """The pair of test_engine_sampling_law (V = 6, sharpness 3, a draft perturbed at scale 0.4) as GGUFs."""
    folder = tmp_path_factory.mktemp("gguf_law")
    target = tiny_model(vocab=LAW_VOCAB, sharpness=3.0)
    draft = perturbed(target, scale=0.4, seed=1)
    return save_gguf(target, folder / "target.gguf"), save_gguf(draft, folder / "draft.gguf")


def adapter(path: str | Path, vocab: int = VOCAB) -> LlamaCppModel:
    return LlamaCppModel(path, None, eos_token_ids=(vocab - 1,), threads=1)


def every(rows: int, width: int) -> torch.Tensor:
    return torch.ones(rows, width, dtype=torch.bool)


def transformers_logits(model, row: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([row])).logits[0]  # [len(row), V]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    error = float((actual - expected).abs().max()) if actual.numel() else 0.0
    assert actual.shape == expected.shape and error <= F16_ATOL, f"{label}: max |difference| {error:.3g}"


# --- 1. the LanguageModel contract ---------------------------------------------------------------------------------


def test_a_forward_after_prefill_gives_the_models_logits(files):
    """Rows of different lengths, prefilled together, then 3 tokens each: the logits at those positions are
    transformers' on the whole sequence."""
    model = adapter(files.target_path)
    assert (model.vocab_size, model.max_length) == (VOCAB, 256)
    rows = PROMPTS
    model.prefill(rows)
    new = torch.tensor([[20, 21, 22], [23, 24, 25], [26, 27, 28], [29, 30, 31]])
    logits = model.forward(new, every(4, 3))  # [4, 3, V]
    assert model.lengths.tolist() == [len(r) + 3 for r in rows]
    for b, row in enumerate(rows):
        expected = transformers_logits(files.target, row + new[b].tolist())  # [len + 3, V]
        assert_close(logits[b], expected[len(row) :], f"row {b}")
        # the tolerance sees a slot misalignment: the logits one position earlier are far outside it
        assert float((logits[b] - expected[len(row) - 1 : -1]).abs().max()) > 10 * F16_ATOL


def test_holes_take_no_position_and_rows_do_not_see_each_other(files):
    """Two forwards with holes (leading, inner, trailing, a whole row of them): each row's logits equal that row
    decoded alone without the holes, and transformers'; the holes' logits are finite."""
    rows = [[1, 2, 3, 4, 5], [6], [7, 8, 9], [10, 11]]
    steps = [
        (
            torch.tensor([[20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 31], [32, 33, 34, 35]]),
            torch.tensor([[0, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool),
        ),
        (
            torch.tensor([[36, 37, 38], [39, 40, 41], [42, 43, 44], [45, 46, 1]]),
            torch.tensor([[1, 0, 0], [0, 0, 1], [1, 1, 0], [0, 1, 1]], dtype=torch.bool),
        ),
    ]
    model = adapter(files.target_path)
    model.prefill(rows)
    batched = []
    for tokens, valid in steps:
        logits = model.forward(tokens, valid)
        assert torch.isfinite(logits).all(), "a hole's logits must be finite (the engine checks every logit)"
        batched.append(logits)
    assert model.lengths.tolist() == [len(r) + int(sum(v[b].sum() for _, v in steps)) for b, r in enumerate(rows)]

    for b, row in enumerate(rows):
        alone = adapter(files.target_path)
        alone.prefill([row])
        context = list(row)
        for (tokens, valid), logits in zip(steps, batched):
            new = tokens[b][valid[b]]
            if len(new) == 0:
                continue
            own = alone.forward(new[None], every(1, len(new)))[0]
            assert_close(logits[b][valid[b]], own, f"row {b} batched with holes vs alone")
            expected = transformers_logits(files.target, context + new.tolist())
            assert_close(logits[b][valid[b]], expected[len(context) :], f"row {b} vs transformers")
            last = int(valid[b].nonzero().max())
            if not bool(valid[b, :last].all()):  # a hole before the last token: had it been read as a token, the
                # last token's logits would be far outside the tolerance
                read = transformers_logits(files.target, context + tokens[b].tolist())[len(context) + last]
                assert float((logits[b, last] - read).abs().max()) > 10 * F16_ATOL
            context += new.tolist()


def test_rollback_then_replay_gives_the_same_logits_bit_for_bit(files):
    """40 random steps (1-4 tokens per row, some holes, then a random rollback, a row leaving at step 20): every
    forward, rolled back and replayed, gives the same logits EXACTLY, and they are transformers' on the row.

    Exact, not within a tolerance: the replay is the same llama_decode (tokens, positions, sequences) over the same
    cache, whose rollback freed exactly the cells the forward filled, and llama.cpp's CPU kernels are deterministic
    for a given shape (measured: bitwise equal at every step). A stale cell left by the rollback would be a whole
    extra token in the context (>= 0.07 here), but the exact check also pins the cache's state to the last bit."""
    model = adapter(files.target_path)
    gen = torch.Generator().manual_seed(0)
    rows = [[1, 2, 3, 4, 5], [6], [9, 9], [7, 8, 9]]
    model.prefill(rows)
    for step in range(40):
        width = 1 + step % 4
        tokens = torch.randint(1, 40, (len(rows), width), generator=gen)
        valid = torch.rand(len(rows), width, generator=gen) < 0.8
        before = model.lengths.clone()
        logits = model.forward(tokens, valid)
        model.rollback(before)
        assert model.lengths.tolist() == before.tolist()
        replayed = model.forward(tokens, valid)
        assert torch.equal(replayed, logits), f"step {step}: max |difference| {(replayed - logits).abs().max():.3g}"
        for b, row in enumerate(rows):
            new = tokens[b][valid[b]].tolist()
            if new:
                expected = transformers_logits(files.target, row + new)[len(row) :]
                assert_close(logits[b][valid[b]], expected, f"step {step}, row {b}")
            row += new
        drop = torch.randint(0, 3, (len(rows),), generator=gen)
        keep = torch.minimum(model.lengths, (model.lengths - drop).clamp(min=1))
        model.rollback(keep)
        rows = [row[: int(k)] for row, k in zip(rows, keep)]
        if step == 20:
            model.select(torch.tensor([3, 0, 2]))
            rows = [rows[3], rows[0], rows[2]]
    assert model.lengths.tolist() == [len(r) for r in rows]
    assert max(len(r) for r in rows) < 64  # the range F16_ATOL was measured on


def test_select_keeps_the_given_rows_in_that_order(files):
    """select([2, 0]) after a forward: the batch is rows 2 and 0, in that order; their next logits are those of
    the same rows in a batch that kept every row, and llama.cpp holds nothing of the dropped rows."""
    rows = [[1, 2, 3, 4, 5], [6], [7, 8, 9]]
    first = torch.tensor([[20, 21], [22, 23], [24, 25]]), torch.tensor([[1, 1], [0, 1], [1, 0]], dtype=torch.bool)
    second = torch.tensor([[30, 31, 32], [33, 34, 35], [36, 37, 38]]), every(3, 3)
    kept, everyone = adapter(files.target_path), adapter(files.target_path)
    for model in (kept, everyone):
        model.prefill(rows)
        model.forward(*first)
    lengths = everyone.lengths
    kept.select(torch.tensor([2, 0]))
    assert kept.lengths.tolist() == [int(lengths[2]), int(lengths[0])]
    selected = kept.forward(second[0][[2, 0]], second[1][[2, 0]])  # [2, 3, V]
    reference = everyone.forward(*second)  # [3, 3, V]
    assert_close(selected[0], reference[2], "kept row 0 (was row 2)")
    assert_close(selected[1], reference[0], "kept row 1 (was row 0)")
    # the order check has teeth: rows 0 and 2 are far apart
    assert float((reference[0] - reference[2]).abs().max()) > 10 * F16_ATOL
    # the dropped row's cells are freed (through llama.cpp's C API: the interface has no way to ask)
    lib = llamacpp.library()
    memory = lib.llama_get_memory(kept._context)
    occupied = [int(lib.llama_memory_seq_pos_max(memory, s)) for s in range(3)]
    assert occupied[1] == -1 and occupied[0] >= 0 and occupied[2] >= 0, occupied


def test_the_cache_growing_mid_generation_keeps_the_logits(files, monkeypatch, caplog):
    """With MIN_CELLS = 32 the context is outgrown (and rebuilt from every row's tokens) several times while 3 rows
    decode with holes, rollbacks and a select: every forward's logits are those of a context big enough from the
    start. Not bitwise: the rebuilt cache comes from one prefill, the big one from many small decodes (docstring)."""

    def run() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(3)
        model = adapter(files.target_path)
        model.prefill([[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]])
        out = []
        for step in range(24):
            rows = len(model.lengths)
            tokens = torch.randint(1, 40, (rows, 3), generator=gen)
            valid = torch.rand(rows, 3, generator=gen) < 0.8
            out.append(model.forward(tokens, valid)[valid])
            model.rollback(model.lengths - torch.randint(0, 2, (rows,), generator=gen))
            if step == 12:
                model.select(torch.tensor([2, 0]))
        out.append(model.lengths)
        return out

    big = run()
    monkeypatch.setattr(llamacpp, "MIN_CELLS", 32)
    with caplog.at_level(logging.INFO, logger=llamacpp.__name__):
        grown = run()
    growths = [r for r in caplog.records if "KV cache grown" in r.getMessage()]
    assert len(growths) >= 2, f"the cache grew {len(growths)} times: the test did not exercise growth"
    assert torch.equal(grown[-1], big[-1]) and int(big[-1].max()) < 64
    for step, (small, reference) in enumerate(zip(grown[:-1], big[:-1])):
        assert_close(small, reference, f"step {step}")


def test_a_sequence_longer_than_the_context_is_refused(files):
    model = adapter(files.target_path)
    context = model.max_length
    assert context == 256
    with pytest.raises(ValueError, match="exceeds the context of 256"):
        model.prefill([[1, 2], [3] * (context + 1)])
    model.prefill([[1, 2], [3] * context])  # a full context is fine
    with pytest.raises(ValueError, match="outgrew the model's context of 256"):
        model.forward(torch.tensor([[4], [5]]), every(2, 1))
    assert model.lengths.tolist() == [2, context], "a refused forward must leave the rows as they were"
    # a hole takes no position: the full row may take a hole beside the other row's token
    logits = model.forward(torch.tensor([[4], [5]]), torch.tensor([[True], [False]]))
    assert torch.isfinite(logits).all() and model.lengths.tolist() == [3, context]


# --- 2. greedy decoding --------------------------------------------------------------------------------------------


def llama_cpp_greedy(path: str, prompt: list[int], new_tokens: int) -> list[int]:
    """llama.cpp's own greedy decoding (llama-cpp-python's Llama.generate at temperature 0), from a fresh context."""
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=1, verbose=False)
    try:
        out = []
        for token in llm.generate(prompt, temp=0.0, top_k=1):
            out.append(int(token))
            if len(out) == new_tokens:
                return out
        return out
    finally:
        llm.close()


def top2_gap(path: str, context: list[int]) -> float:
    """The gap between the adapter's two largest logits after ``context`` (one row, decoded alone)."""
    model = adapter(path)
    model.prefill([context[:-1]])
    top = model.forward(torch.tensor([context[-1:]]), every(1, 1))[0, 0].topk(2).values
    return float(top[0] - top[1])


def assert_same_greedy(got: list[int], expected: list[int], prompt: list[int], path: str, label: str) -> None:
    """Equality, or a failure that says how near a tie the first divergence is: batched and one-token forwards
    differ in the last bits (docstring), which can break an exact tie of logits either way without a bug."""
    if got == expected:
        return
    at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    gap = top2_gap(path, prompt + expected[:at])
    pair = f"{got[at : at + 1]} vs {expected[at : at + 1]}"
    pytest.fail(
        f"{label}: diverges at token {at} ({pair}); the top-2 logit gap there is {gap:.3g} (a gap of the order of "
        "1e-3 or below is a near tie that the forwards' shapes may break either way)"
    )


def test_greedy_through_the_adapter_equals_llama_cpps_own_greedy_decoding(files):
    decoder = SpeculativeDecoder(adapter(files.target_path), None)
    result = decoder.generate(PROMPTS, max_new_tokens=NEW_TOKENS, sampling=GREEDY, stop_on_eos=False)
    for b, prompt in enumerate(PROMPTS):
        expected = llama_cpp_greedy(files.target_path, prompt, NEW_TOKENS)
        assert len(expected) == NEW_TOKENS
        assert_same_greedy(result.sequences[b], expected, prompt, files.target_path, f"row {b}")


def test_speculative_greedy_equals_the_target_alone(files, rule):
    plain = SpeculativeDecoder(adapter(files.target_path), None)
    expected = plain.generate(PROMPTS, max_new_tokens=NEW_TOKENS, sampling=GREEDY, stop_on_eos=False).sequences
    decoder = SpeculativeDecoder(adapter(files.target_path), adapter(files.draft_path), rule=rule, max_draft=3)
    result = decoder.generate(PROMPTS, max_new_tokens=NEW_TOKENS, sampling=GREEDY, stop_on_eos=False)
    for b, prompt in enumerate(PROMPTS):
        assert_same_greedy(result.sequences[b], expected[b], prompt, files.target_path, f"{rule}, row {b}")
    # the equality means something only if drafts were both accepted and rejected
    assert 1.3 < result.block_efficiency < 4, result.block_efficiency


@pytest.mark.parametrize("policy", ["adaptive", "sv-draft", "lookup"])
def test_the_length_policies_and_prompt_lookup_keep_the_greedy_output(files, policy):
    """What `generate` runs on llama.cpp besides fixed K: AdaptiveLength, SV's draft-only predictor (toy profiles
    under which both draft 1 to 3 tokens), prompt lookup alone, on the same prompts and the target alone."""
    plain = SpeculativeDecoder(adapter(files.target_path), None)
    expected = plain.generate(PROMPTS, max_new_tokens=NEW_TOKENS, sampling=GREEDY, stop_on_eos=False).sequences
    target, draft = adapter(files.target_path), adapter(files.draft_path)
    latency = profile([100, 110, 120, 130, 140], draft_ms=5)
    decoder = {
        "adaptive": lambda: SpeculativeDecoder(target, draft, policy=AdaptiveLength(latency, max_draft=3)),
        "sv-draft": lambda: SpeculativeDecoder(
            target, draft, policy=SVPolicy(hand_profile(), latency, rule="block", max_draft=3, kind="draft")
        ),
        "lookup": lambda: SpeculativeDecoder(target, lookup=PromptLookup()),
    }[policy]()
    result = decoder.generate(PROMPTS, max_new_tokens=NEW_TOKENS, sampling=GREEDY, stop_on_eos=False)
    for b, prompt in enumerate(PROMPTS):
        assert_same_greedy(result.sequences[b], expected[b], prompt, files.target_path, f"{policy}, row {b}")
    assert any(sum(step.verified) for step in result.stats), f"{policy} never verified a drafted token"


# --- 3. trees: the tree drafter on llama.cpp's tree forward (models/llamacpp.py) ----------------------------------

TREES = {"tree 2,1,1": {"tree": (2, 1, 1)}, "tree 3,2": {"tree": (3, 2)}, "3 paths of 3": {"paths": 3, "max_draft": 3}}


@pytest.mark.parametrize("shape", TREES)
def test_a_tree_decoder_on_llama_cpp_gives_the_greedy_output_of_the_target_alone(files, shape):
    """Static trees and paths, drafted and verified on llama.cpp's own f16 attention, over rows of different lengths
    (one of them a single token, which the engine prefills as an empty row)."""
    plain = SpeculativeDecoder(adapter(files.target_path), None)
    expected = plain.generate(PROMPTS, max_new_tokens=NEW_TOKENS, sampling=GREEDY, stop_on_eos=False).sequences
    decoder = SpeculativeDecoder(adapter(files.target_path), adapter(files.draft_path), **TREES[shape])
    result = decoder.generate(PROMPTS, max_new_tokens=NEW_TOKENS, sampling=GREEDY, stop_on_eos=False)
    for b, prompt in enumerate(PROMPTS):
        assert_same_greedy(result.sequences[b], expected[b], prompt, files.target_path, f"{shape}, row {b}")
    assert 1.3 < result.block_efficiency, result.block_efficiency  # drafts were accepted
    assert any(a < s.drafted for s in result.stats for a in s.accepted), "no draft was ever rejected"


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams()], ids=["greedy", "sampled"])
def test_after_every_tree_step_on_llama_cpp_the_caches_hold_the_committed_tokens(files, sampling, monkeypatch):
    """Each step's commit and roll back leave both adapters holding exactly the committed tokens they have read:
    their next logits are transformers' on the whole row (kits/enginekit.py's CacheCheck), at 1e-5 with f32 attention
    (tests/models/test_tinygguf.py)."""
    monkeypatch.setattr(llamacpp, "F32_ATTENTION", True)
    decoder = SpeculativeDecoder(adapter(files.target_path), adapter(files.draft_path), tree=(2, 1, 1))
    check = enginekit.CacheCheck(decoder, {"target": files.target, "draft": files.draft}, monkeypatch)
    result = decoder.generate(PROMPTS, max_new_tokens=24, sampling=sampling, seed=0)
    assert check.steps == len(result.stats) and result.block_efficiency > 1.3


# --- 4. the exact law at temperature 1 -----------------------------------------------------------------------------


def law_adapter(path: str, cut: bool = False) -> LlamaCppModel | VocabularyCut:
    """The law pair's model on the adapter; ``cut``: its vocabulary cut to LAW_CUT tokens and EOS (``vocab_cut``)."""
    if not cut:
        return adapter(path, LAW_VOCAB)
    copy = cut_vocabulary(Path(path), LAW_CUT)
    return VocabularyCut(LlamaCppModel(copy, None, threads=1), *read_cut(copy), eos_token_ids=(LAW_VOCAB - 1,))


def adapter_tables(model: LlamaCppModel | VocabularyCut) -> list[torch.Tensor]:
    """tables[L]: the ADAPTER's processed distributions [V**L, V] float64 (temperature 1) after LAW_PROMPT + each
    continuation of length L (lawkit.all_blocks order), L = 0..LENGTH-1: every context the first LENGTH tokens see.
    Each table is one batch, prefilled and scored by a one-token forward, as the engine scores."""
    tables = []
    for length in range(LENGTH):
        contexts = [LAW_PROMPT + c for c in lawkit.all_blocks(LAW_VOCAB, length).tolist()]
        model.prefill([c[:-1] for c in contexts])
        last = torch.tensor([c[-1:] for c in contexts])  # [V**L, 1]
        logits = model.forward(last, every(len(contexts), 1))[:, 0]  # [V**L, V]
        probs = process(logits, SamplingParams()).double()
        tables.append(probs / probs.sum(-1, keepdim=True))
    return tables


def engine_law(tables: lawkit.Tables, rule: str, shift: bool) -> torch.Tensor:
    """The exact joint law [V] * LENGTH of the engine's first LENGTH tokens, step by step as the engine runs them:
    after g tokens a step drafts k = min(DRAFT_LEN, LENGTH - 1 - g) tokens from the draft table and verifies them
    through the rule's closed forms (k = 0: a plain target step). ``shift``: the verifier is handed each row's target
    distributions rotated by one position (``shifted_within_rows``). Unshifted, this must be the target's law."""
    rotated = (lambda target: target.roll(1, dims=1)) if shift else None  # every row verifies all k: the width rotates
    return enginekit.engine_law(
        tables.vocab, LENGTH, DRAFT_LEN, tables.target_at, tables.draft_at, rule, verified=rotated
    )


def shifted_within_rows(verify):
    """A plausible engine bug: each row's target distributions [pending, x_1..x_n] rotated by one position among its
    own n + 1 verified slots, so x_i is judged by the distribution of another position. (``enginekit.off_by_one``
    rolls the padded width instead: a row verifying fewer slots than the batch then reads a hole's distribution,
    which depends on how the adapter fills holes and on which rows share the step, and has no per-row exact law.)"""

    def broken(draft_tokens, draft_probs, target_probs, *, num_verified, **kwargs):
        slots = torch.arange(target_probs.shape[1], device=target_probs.device)[None]  # [1, W+1]
        verified = num_verified[:, None] + 1  # [B, 1]
        source = torch.where(slots < verified, (slots - 1) % verified, slots)  # [B, W+1]: slot j reads j - 1 (mod n+1)
        shifted = target_probs.gather(1, source[..., None].expand_as(target_probs))
        return verify(draft_tokens, draft_probs, shifted, num_verified=num_verified, **kwargs)

    return broken


def sample(decoder: SpeculativeDecoder) -> tuple[torch.Tensor, float]:
    """Counts [V] * LENGTH of the first LENGTH tokens of SAMPLES rows of LAW_PROMPT (row b seeded b), in calls of
    MAX_ROWS rows (llama.cpp's limit), and the acceptance rate of the drafts."""
    counts = torch.zeros([LAW_VOCAB] * LENGTH, dtype=torch.float64)
    accepted = verified = 0
    for start in range(0, SAMPLES, MAX_ROWS):
        rows = min(MAX_ROWS, SAMPLES - start)
        result = decoder.generate([LAW_PROMPT] * rows, max_new_tokens=LENGTH, seed=start, stop_on_eos=False)
        counts += lawkit.joint_counts(result.sequences, LAW_VOCAB)
        accepted += sum(sum(s.accepted) for s in result.stats)
        verified += sum(sum(s.verified) for s in result.stats)
    return counts, accepted / verified


@pytest.mark.parametrize("cut", [False, True], ids=["draft", "cut-draft"])
def test_law_of_the_first_tokens_through_llama_cpp_is_the_targets(law_files, sampled_rule, cut, monkeypatch):
    """Chi-square of the joint law of the first 3 tokens (216 outcomes, pooled) of the engine on the llama.cpp pair
    against the exact law from the ADAPTER's own logits; the same test on an engine whose verifier sees each row's
    target distributions shifted by one position must fail it, with power >= MIN_POWER computed from its exact law.
    ``cut``: the draft's vocabulary cut to LAW_CUT of its 6 tokens and EOS, so the draft proposes some tokens with
    probability zero and reads one of the prompt's tokens as another.

    The tables are scored in other batch shapes than the engine's forwards (a few 1e-4 apart in the logits,
    docstring): a change of the law of that order, whose noncentrality N * sum (delta^2 / law) is ~1e-3 here,
    far below what the test can see."""
    target_path, draft_path = law_files
    tables = lawkit.Tables(
        LAW_VOCAB, adapter_tables(law_adapter(target_path)), adapter_tables(law_adapter(draft_path, cut))
    )
    law = lawkit.target_law(tables, LENGTH)
    # the enumeration of the engine's steps is right: unshifted, it is the target's law
    assert lawkit.max_abs_error(engine_law(tables, sampled_rule, shift=False), law) < 1e-12
    wrong_law = engine_law(tables, sampled_rule, shift=True)
    power = POOLED.power(law, wrong_law)
    assert power >= MIN_POWER, f"power {power:.4g} against the shifted verifier at N = {SAMPLES}"

    def decoder() -> SpeculativeDecoder:
        target, draft = adapter(target_path, LAW_VOCAB), law_adapter(draft_path, cut)
        return SpeculativeDecoder(target, draft, rule=sampled_rule, max_draft=DRAFT_LEN)

    counts, acceptance = sample(decoder())
    test = POOLED.test(counts, law)
    assert test.passed, f"{sampled_rule}: {test}"
    assert 0.05 < acceptance < 0.95, f"acceptance rate {acceptance:.2f}: drafts must be both accepted and rejected"

    rule = RULES[sampled_rule]
    monkeypatch.setitem(RULES, sampled_rule, replace(rule, verify=shifted_within_rows(rule.verify)))
    counts, _ = sample(decoder())
    broken = POOLED.test(counts, law)
    assert broken.statistic > broken.threshold, f"the shifted verifier PASSED: {broken} (power {power:.4g})"
    # the failure is the predicted one: the control's samples follow its own exact law
    own = POOLED.test(counts, wrong_law)
    assert own.passed, f"the shifted verifier against its own exact law: {own}"
    print(  # with pytest -s
        f"{sampled_rule}: chi2 {test.statistic:.1f}, threshold {test.threshold:.1f} (dof {test.dof} after pooling), "
        f"acceptance rate {acceptance:.2f}; control: chi2 {broken.statistic:.1f} (power {power:.6f}), "
        f"against its own law {own.statistic:.1f}"
    )
