"""Bad models and bad input: a clear error before any work, or the right answer; never a silent wrong answer.

The tables below map an input to the error it must raise (type and a fragment of the message); extend them when
a new way to go wrong turns up. Then: models that return NaN or inf, adapters shared between roles, rows near the
end of their context (drafting cut per row, never past a model's context), and stop strings looked for in a
bounded window of tokens.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from kits import lawkit
from kits.enginekit import off_by_one, reference_greedy
from kits.svkit import flat_latency, hand_profile
from kits.tiny import exact_law_of_first_tokens, perturbed, tiny_model, tiny_tokenizer

from blockspec import SamplingParams, SpeculativeDecoder
from blockspec.models.hf import HFModel
from blockspec.policy import FixedLength, SVPolicy
from blockspec.sampling import NonFiniteLogitsError
from blockspec.stopping import Stopper
from blockspec.verify import RULES

GREEDY, SAMPLED = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
PROMPTS = [[1, 2, 3, 4, 5], [6, 7]]


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(sharpness=5.0)
    return target, perturbed(target, scale=0.3, seed=1)


# --- bad input: input -> error ----------------------------------------------------------------------------------

BAD_SAMPLING = [  # SamplingParams(**kwargs) -> (error, message)
    ({"temperature": 1e-39}, ValueError, "use 0 for greedy"),
    ({"temperature": 5e-5}, ValueError, "use 0 for greedy"),
    ({"temperature": float("inf")}, ValueError, "finite number"),
    ({"temperature": float("nan")}, ValueError, "finite number"),
    ({"temperature": -1.0}, ValueError, "finite number"),
    ({"temperature": True}, ValueError, "finite number"),
    ({"top_k": True}, ValueError, "top_k must be an int"),
    ({"top_k": 2.0}, ValueError, "top_k must be an int"),
    ({"top_p": float("nan")}, ValueError, "top_p must lie in"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_SAMPLING, ids=lambda v: repr(v)[:30])
def test_sampling_values_that_overflow_or_make_no_sense_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


BAD_GENERATE = [  # decoder.generate(PROMPTS or prompts, max_new_tokens=4, **kwargs) -> (error, message)
    ({"stop_strings": "T?"}, TypeError, r"a single stop string: \['T\?'\]"),
    ({"stop_strings": [""]}, ValueError, "empty string"),
    ({"stop_strings": [None]}, TypeError, "must be a list of strings"),
    ({"seed": "12"}, TypeError, "seed must be an int"),
    ({"seed": 5.0}, TypeError, "seed must be an int"),
    ({"seed": [1.0, 2.0]}, TypeError, "seed must be an int"),
    ({"seed": [True, False]}, TypeError, "seed must be an int"),
    ({"max_new_tokens": True}, ValueError, "max_new_tokens must be an int"),
    ({"max_new_tokens": 4.0}, ValueError, "max_new_tokens must be an int"),
    ({"prompts": [[1.0, 2.0]]}, TypeError, "token ids must be ints"),
    ({"prompts": [["1", "2"]]}, TypeError, "token ids must be ints"),
    ({"prompts": [[True, 2]]}, TypeError, "holds a bool"),
    ({"prompts": [b"\x01\x02"]}, TypeError, "prompt 0 is a bytes: give a string or a list of int token ids"),
    ({"prompts": [[1, 2], bytearray(b"\x01")]}, TypeError, "prompt 1 is a bytearray"),
    ({"prompts": [{1: 2, 3: 4}]}, TypeError, "prompt 0 is a dict"),
    ({"prompts": [{1, 2}]}, TypeError, "prompt 0 is a set"),
    ({"prompts": [[1] * 250], "max_new_tokens": 10}, ValueError, r"250 \+ 10 = 260 exceeds the context of 256"),
    ({"prompts": ["ab\udcffc"]}, ValueError, "prompt 0 is not valid UTF-8 text: character 2 is U[+]DCFF"),
    ({"stop_strings": ["a\ud800"]}, ValueError, "stop string 0 is not valid UTF-8 text: character 1 is U[+]D800"),
    ({"seed": -1}, ValueError, r"seed -1 is out of range: .* \[0, 2\*\*64 - 2\]"),  # -1 would alias 2**64 - 1
    ({"seed": 2**64 - 1}, ValueError, "out of range: row b uses seed [+] b"),  # row 1 would overflow
    ({"seed": [0, 2**64]}, ValueError, r"the seed of prompt 1, 18446744073709551616, is out of range"),
    ({"seed": [-1, 0]}, ValueError, "the seed of prompt 0, -1, is out of range"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_GENERATE, ids=lambda v: repr(v)[:30])
def test_bad_generate_input_is_refused_before_any_forward(pair, kwargs, error, message):
    decoder = SpeculativeDecoder(*pair, max_draft=3)
    decoder.target.prefill = decoder.draft.prefill = lambda rows: pytest.fail("a model ran before the input check")
    arguments = {"prompts": PROMPTS, "max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=message):
        decoder.generate(arguments.pop("prompts"), sampling=SAMPLED, **arguments)


def test_prompts_as_tuples_arrays_and_tensors_are_token_ids(pair):
    decoder = SpeculativeDecoder(*pair, max_draft=3)
    expected = decoder.generate(PROMPTS, max_new_tokens=6, sampling=GREEDY).sequences
    for kind in (tuple, np.array, torch.tensor):
        assert decoder.generate([kind(p) for p in PROMPTS], max_new_tokens=6, sampling=GREEDY).sequences == expected


def test_stop_strings_given_as_a_generator_are_read_once_and_used(pair):
    """A generator is read once, then validated and used: validating it must not leave an empty remainder."""
    target, draft = pair
    decoder = SpeculativeDecoder(HFModel(target, tiny_tokenizer()), HFModel(draft, tiny_tokenizer()), max_draft=3)
    free = decoder.generate(PROMPTS[:1], max_new_tokens=12, sampling=GREEDY, stop_on_eos=False)
    assert free.texts is not None and len(free.texts[0]) > 6
    stop = free.texts[0][3:5]  # text the row produces after a few tokens
    for strings in ([stop], (s for s in [stop])):
        result = decoder.generate(PROMPTS[:1], max_new_tokens=12, sampling=GREEDY, stop_strings=strings)
        assert result.finish_reasons == ["stop"] and result.texts is not None and stop in result.texts[0]


def short_logits(target):
    """A draft that shares the target's tokenizer but has fewer logits (40 of 48)."""
    draft = tiny_model(vocab=40, seed=2)
    return HFModel(target, tiny_tokenizer()), HFModel(draft, tiny_tokenizer())


def test_a_shared_vocabulary_is_compared_once_per_pair_until_a_tokenizer_grows(pair, monkeypatch):
    """Every decoder built checks that its draft shares the target's vocabulary, and get_vocab builds the whole of it
    (a quarter of a second for Qwen2.5's): a pair found to share it is remembered. A token added to one tokenizer
    compares them again, refused as long as the other lacks it; a refusal is never remembered."""
    target, draft = pair
    tokenizers = tiny_tokenizer(), tiny_tokenizer()
    built = []
    for tokenizer in tokenizers:
        monkeypatch.setattr(tokenizer, "get_vocab", lambda get=tokenizer.get_vocab: built.append(1) or get())
    models = HFModel(target, tokenizers[0]), HFModel(draft, tokenizers[1])
    for _ in range(3):
        SpeculativeDecoder(*models, max_draft=2)
    assert len(built) == 2  # each vocabulary built once
    tokenizers[1].add_tokens(["zz"])
    for _ in range(2):
        with pytest.raises(ValueError, match="different tokenizers"):
            SpeculativeDecoder(*models, max_draft=2)
    assert len(built) == 6
    tokenizers[0].add_tokens(["zz"])
    SpeculativeDecoder(*models, max_draft=2)
    SpeculativeDecoder(*models, max_draft=2)
    assert len(built) == 8


BAD_DECODER = [  # SpeculativeDecoder(*make(target, draft)[0], **make(...)[1]) -> (error, message)
    (lambda t, d: ((t, d), {"max_draft": True}), ValueError, "max_draft must be an int"),
    (lambda t, d: ((t, d), {"max_draft": 10**7}), ValueError, "not below the target's context of 256"),
    (lambda t, d: (short_logits(t), {}), ValueError, "has 40 logits but the target's vocabulary has 48"),
    (lambda t, d: ((same := HFModel(t), same), {}), ValueError, "different model objects"),
    (
        lambda t, d: ((same := HFModel(t), HFModel(d)), {"companion": same, "policy": Scored(2)}),
        ValueError,
        "different model objects",
    ),
    (
        lambda t, d: ((t, d), {"rule": "token", "policy": sv_policy("block")}),
        ValueError,
        "built for the block rule but rule='token'",
    ),
]


@pytest.mark.parametrize(("make", "error", "message"), BAD_DECODER, ids=[m for _, _, m in BAD_DECODER])
def test_bad_models_and_decoder_arguments_are_refused(pair, make, error, message):
    models, kwargs = make(*pair)
    with pytest.raises(error, match=message):
        SpeculativeDecoder(*models, **kwargs)


def sv_policy(rule: str) -> SVPolicy:
    return SVPolicy(hand_profile(), flat_latency((1.0, 1.0), 1e-9), rule=rule, max_draft=3, kind="draft")


class Scored(FixedLength):
    """A fixed length whose drafts the companion scores (what SV does), without SV's decisions."""

    needs_companion = True


# --- inputs that look odd but are fine ----------------------------------------------------------------------------


def test_numpy_and_torch_integers_are_accepted_as_seeds_and_token_ids(pair):
    decoder = SpeculativeDecoder(*pair, max_draft=3)
    plain = decoder.generate(PROMPTS, max_new_tokens=6, seed=5).sequences
    assert decoder.generate([np.array(p) for p in PROMPTS], max_new_tokens=6, seed=np.int64(5)).sequences == plain
    assert decoder.generate([torch.tensor(p) for p in PROMPTS], max_new_tokens=6, seed=[5, 6]).sequences == plain
    for seeds in (np.array([5, 6]), torch.tensor([5, 6]), torch.tensor(5)):
        assert decoder.generate(PROMPTS, max_new_tokens=6, seed=seeds).sequences == plain
    with pytest.raises(ValueError, match="one int per prompt"):
        decoder.generate(PROMPTS, max_new_tokens=6, seed=torch.tensor([5]))  # one seed in a list is not a base seed


def test_numpy_integers_are_accepted_wherever_python_ints_are(pair):
    """max_new_tokens, top_k, max_draft and PromptLookup's lengths take NumPy integers, stored as Python's."""
    from blockspec.drafting import PromptLookup

    python = SpeculativeDecoder(*pair, max_draft=3).generate(
        PROMPTS, max_new_tokens=6, sampling=SamplingParams(top_k=3), seed=1
    )
    numpy = SpeculativeDecoder(*pair, max_draft=np.int64(3)).generate(
        PROMPTS, max_new_tokens=np.int32(6), sampling=SamplingParams(top_k=np.int64(3)), seed=1
    )
    assert numpy.sequences == python.sequences
    assert type(SamplingParams(top_k=np.int16(3)).top_k) is int
    lookup = PromptLookup(max_draft=np.int64(4), max_ngram=np.uint8(2))  # pyright: ignore[reportArgumentType]
    assert lookup == PromptLookup(max_draft=4, max_ngram=2)
    with pytest.raises(ValueError, match="max_draft must be an int >= 0, got 2.5"):
        FixedLength(2.5)  # pyright: ignore[reportArgumentType]


def test_one_decoder_used_from_two_threads_refuses_the_second_call_clearly(pair):
    """Two calls on one decoder's models at once would mix their rows in one KV cache: the second is refused while
    the first runs (also from another decoder on the same adapter), and the first is unharmed."""
    import threading

    decoder = SpeculativeDecoder(*pair, max_draft=3)
    expected = decoder.generate(PROMPTS, max_new_tokens=8, sampling=GREEDY).sequences
    started, release, results = threading.Event(), threading.Event(), []

    def hold(row, tokens):
        started.set()
        release.wait(timeout=60)

    def first():
        results.append(decoder.generate(PROMPTS, max_new_tokens=8, sampling=GREEDY, on_tokens=hold).sequences)

    thread = threading.Thread(target=first)
    thread.start()
    assert started.wait(timeout=60)
    try:
        with pytest.raises(RuntimeError, match="already generating .* give each thread its own SpeculativeDecoder"):
            decoder.generate(PROMPTS, max_new_tokens=8, sampling=GREEDY)
        other = SpeculativeDecoder(decoder.target, None)  # another decoder on the same (busy) target adapter
        with pytest.raises(RuntimeError, match="already generating"):
            other.generate(PROMPTS, max_new_tokens=8, sampling=GREEDY)
    finally:
        release.set()
        thread.join(timeout=60)
    assert results == [expected]
    assert decoder.generate(PROMPTS, max_new_tokens=8, sampling=GREEDY).sequences == expected  # free again


def test_one_transformers_model_as_target_and_draft_gets_two_caches(pair):
    """The same PreTrainedModel passed twice is wrapped twice: two adapters, two caches, the target's output."""
    target, _ = pair
    for models in ((target, target), (HFModel(target), HFModel(target))):
        decoder = SpeculativeDecoder(*models, max_draft=3)
        result = decoder.generate(PROMPTS, max_new_tokens=12, sampling=GREEDY)
        assert result.sequences == [reference_greedy(target, p, 12) for p in PROMPTS]
        assert result.block_efficiency > 3.5  # the draft is the target: nearly everything accepted


def test_a_policy_drafting_more_than_max_draft_samples_without_index_errors(pair):
    """The engine's width is the policy's max_draft; the decoder's max_draft argument only builds the default policy."""
    decoder = SpeculativeDecoder(*pair, max_draft=2, policy=FixedLength(6))
    assert decoder.max_draft == 6
    result = decoder.generate(PROMPTS, max_new_tokens=20, sampling=SAMPLED, seed=0, stop_on_eos=False)
    assert max(k for step in result.stats for k in step.verified) == 6
    assert [len(s) for s in result.sequences] == [20, 20]


# --- bad models: NaN and inf logits --------------------------------------------------------------------------------


def poisoned(model, value: float, token: int = 3):
    """A copy of ``model`` whose logit for ``token`` is ``value`` (NaN) or non-finite (inf weights) everywhere."""
    import copy

    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.lm_head.weight[token] = value
    return bad


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("role", ["target", "draft", "companion"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_non_finite_logits_raise_naming_the_model(pair, role, value, sampling):
    target, draft = pair
    models = {"target": target, "draft": draft, "companion": target}
    models[role] = poisoned(models[role], value)
    decoder = SpeculativeDecoder(models["target"], models["draft"], policy=Scored(3), companion=models["companion"])
    with pytest.raises(NonFiniteLogitsError, match=f"the {role} model .* non-finite logits"):
        decoder.generate(PROMPTS, max_new_tokens=8, sampling=sampling, seed=0)


# --- context: refused up front, drafting cut per row near the end --------------------------------------------------


def with_context(model, context: int) -> HFModel:
    adapter = HFModel(model)
    adapter.max_length = context  # the adapter refuses any position past it
    return adapter


def alone_and_batched(decoder, prompts, max_new_tokens):
    """Each row's tokens decoded alone and in one batch (float32, temperature 1, row b seeded with 100 + b)."""
    seeds = [100 + b for b in range(len(prompts))]
    kwargs = {"max_new_tokens": max_new_tokens, "sampling": SAMPLED, "stop_on_eos": False}
    together = decoder.generate(prompts, seed=seeds, **kwargs)
    alone = [decoder.generate([p], seed=[s], **kwargs).sequences[0] for p, s in zip(prompts, seeds)]
    return alone, together


def test_a_row_near_its_context_end_does_not_make_its_neighbours_draft_past_theirs(pair):
    """Rows whose prompt and new tokens fill the 12-token context exactly, batched with short rows: when a long row
    has accepted more than a short one, the short one still drafts 4 tokens. A draft that read the batch's full
    width in every row would go past the long row's context and lose the whole batch."""
    target, draft = pair
    decoder = SpeculativeDecoder(with_context(target, 12), with_context(draft, 12), max_draft=4)
    alone, together = alone_and_batched(decoder, [[1] * 6, [2, 3]] * 4, max_new_tokens=6)
    assert together.sequences == alone


@pytest.mark.parametrize("scored", [False, True], ids=["draft", "draft-and-companion"])
def test_rows_cut_by_a_shorter_draft_context_give_the_same_tokens_alone_and_batched(pair, scored):
    """The draft's context (9) is shorter than the target's (12): the 6-token prompts draft less and less, then
    steps go without drafts; the 3-token ones draft freely. Float32: the same tokens alone and batched. With a
    companion of the same context scoring every draft, rows of every verified length share its forwards."""
    target, draft = pair
    scoring = {"policy": Scored(2), "companion": with_context(target, 9)} if scored else {"max_draft": 2}
    decoder = SpeculativeDecoder(with_context(target, 12), with_context(draft, 9), **scoring)
    alone, together = alone_and_batched(decoder, [[1, 2, 3], [4, 5, 6, 7, 8, 9]] * 4, max_new_tokens=6)
    assert together.sequences == alone
    long_rows = [k for step in together.stats for b, k in zip(step.rows, step.verified) if b % 2]
    assert {0, 1, 2} <= set(long_rows)  # the long rows drafted 2, then 1, then nothing


def test_a_prompt_longer_than_the_drafts_context_decodes_with_the_target_alone(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(with_context(target, 64), with_context(draft, 8), max_draft=3)
    result = decoder.generate([[1] * 20, [2, 3]], max_new_tokens=10, sampling=GREEDY, stop_on_eos=False)
    assert result.sequences == [reference_greedy(target, p, 10, eos=None) for p in ([1] * 20, [2, 3])]
    assert all(step.verified[0] == 0 for step in result.stats)


def test_law_of_the_first_tokens_when_a_rows_drafting_is_cut_by_its_context(monkeypatch):
    """Joint chi-square of the first 3 tokens (6**3 outcomes) against the exact target law for rows whose drafting
    the draft's context cuts (prompt of 6 tokens, draft context 6: 1 drafted, then none) batched with rows that
    draft 2 (all that max_new_tokens leaves room for); a verifier that sees misaligned target distributions must fail
    the same test."""
    vocab, length, samples = 6, 3, 3000
    target = tiny_model(vocab=vocab, sharpness=5.0)
    draft = perturbed(target, scale=0.6, seed=1)
    long, short = [1, 2, 3, 4, 5, 1], [1, 2, 3]
    laws = {tuple(p): exact_law_of_first_tokens(target, p, length) for p in (long, short)}
    decoder = SpeculativeDecoder(with_context(target, 9), with_context(draft, 6), rule="block", max_draft=3)

    def tests():
        result = decoder.generate([long, short] * samples, max_new_tokens=length, seed=0, stop_on_eos=False)
        outcome = {}
        for prompt, start in ((long, 0), (short, 1)):
            counts = lawkit.joint_counts(result.sequences[start::2], vocab)
            outcome[tuple(prompt)] = lawkit.chi_square(counts, laws[tuple(prompt)])
        return outcome, result

    outcome, result = tests()
    assert all(test.passed for test in outcome.values()), outcome
    first = result.stats[0]
    assert set(first.verified[0::2]) == {1} and set(first.verified[1::2]) == {2}  # cut and uncut rows, one step
    monkeypatch.setitem(RULES, "block", replace(RULES["block"], verify=off_by_one(RULES["block"].verify)))
    broken, _ = tests()
    assert not any(test.passed for test in broken.values()), f"negative control passed: {broken}"


# --- stop strings: a bounded window of tokens --------------------------------------------------------------------

BYTES = [b"a", b"b", b" ", b"\xc3", b"\xa9", b"\xf0\x9f", b"\x98\x80", b"ab", b"!"]  # id -> bytes; 0xC3A9 = e-acute


SPECIAL = len(BYTES)  # a special token, "<|end|>", which the user's text skips


class ByteTokenizer:
    """Token i is BYTES[i]; decoding joins the bytes (a character may be split across tokens). Counts tokens."""

    all_special_ids = [SPECIAL]

    def __init__(self):
        self.decoded = []

    def decode(self, ids, skip_special_tokens=False):
        self.decoded.append(len(ids))
        special = b"" if skip_special_tokens else b"<|end|>"
        return b"".join(special if i == SPECIAL else BYTES[i] for i in ids).decode("utf-8", errors="replace")


def stopper(stop_strings, limit=10**6):
    return Stopper((), ByteTokenizer(), stop_strings, limit)


def test_stop_strings_decode_a_bounded_window_not_the_whole_text():
    """A step decodes at most the window plus the new tokens, however long the row: re-decoding the whole
    generated text for every new token makes steps slower and slower."""
    stop = stopper(["never"])
    generated = [0, 1, 2] * 1000
    assert stop.cut(generated, [0, 1, 2, 0]) == ([0, 1, 2, 0], None)
    assert max(stop.tokenizer.decoded) <= len("never") + 3 + 4


def first_stop(stop_strings, generated, new):
    """The reference: the shortest prefix of ``new`` whose full text (generated + prefix) holds a stop string, less
    a last character still cut (U+FFFD until a later token completes or settles it)."""
    for n in range(1, len(new) + 1):
        text = b"".join(BYTES[i] for i in generated + new[:n]).decode("utf-8", errors="replace").rstrip("\ufffd")
        if any(s in text for s in stop_strings):
            return new[:n], "stop"
    return new, None


@pytest.mark.parametrize(
    ("stop_strings", "planted"),
    [
        (["é"], [3, 4]),
        (["é!"], [3, 4, 8]),
        (["😀"], [5, 6]),
        (["a😀b"], [0, 5, 6, 1]),
        (["b é", "ab!"], [7, 8]),
        (["abababab"], [7, 0, 1, 7, 7]),
        (["\ufffda"], [3, 0]),  # a real U+FFFD: 0xC3 followed by "a" is not UTF-8
    ],
)
def test_windowed_stop_strings_find_what_the_whole_text_finds(stop_strings, planted):
    """Random rows of tokens that split multi-byte characters (e-acute in 2 tokens, an emoji in 2), half of them
    with the tokens of a stop string planted at a random place (so matches straddle the window's edge and the
    generated/new boundary): the windowed cut equals the whole-text reference every time."""
    gen = torch.Generator().manual_seed(0)
    stop, found = stopper(stop_strings), 0
    for trial in range(400):
        row = torch.randint(len(BYTES), (40,), generator=gen).tolist()
        split = int(torch.randint(1, 35, (1,), generator=gen))
        if trial % 2:
            at = split - int(torch.randint(len(planted), (1,), generator=gen))
            row[at : at + len(planted)] = planted
        generated, new = row[:split], row[split : split + 5]
        if first_stop(stop_strings, [], generated)[1] == "stop":
            continue  # the row would have ended earlier
        expected = first_stop(stop_strings, generated, new)
        assert stop.cut(generated, new) == expected, (generated, new)
        found += expected[1] == "stop"
    assert found >= 50  # the stop strings were really found, not only missed


@pytest.mark.parametrize(
    ("stop_strings", "generated", "new", "expected"),
    [
        (["end"], [0], [SPECIAL, 1], ([SPECIAL, 1], None)),  # "<|end|>" is a special token: not in the text
        (["\ufffd"], [0], [3], ([3], None)),  # 0xC3 is the first half of e-acute, not yet a U+FFFD ...
        (["\ufffd"], [0, 3], [4], ([4], None)),  # ... and the next token completes it
        (["\ufffd"], [0, 3], [0, 1], ([0], "stop")),  # ... or settles it as a real U+FFFD
        (["\ufffd"], [5, 6, 0, 0, 0, 0, 0], [0], ([0], None)),  # the window cuts the emoji's first half
        (["abab"], [7] + [SPECIAL] * 9, [7], ([7], "stop")),  # special tokens carry no text: the window skips them
    ],
)
def test_stop_strings_are_matched_on_the_text_the_user_gets(stop_strings, generated, new, expected):
    """Stop strings are matched on the user's text: special tokens skipped (and not counted in the window, since
    they add nothing to the text), and a character cut at the end of the text (or at the start of the window) is
    not a U+FFFD of that text."""
    assert stopper(stop_strings).cut(generated, new) == expected
