"""Block verification on vLLM's flattened ragged layout (blockspec.vllm.ragged), without vLLM.

Each request of a ragged batch must come out exactly as ``verify_block`` gives it alone, with the same draws,
when the bonus token is the one the target's row after the last drafted token gives with those draws; and the
first emitted token must follow the target's law (chi-square against it, with a broken variant that fails).

Drafts a grammar refused (-1 from the first refused token on) are verified as the thinning sentinel: on a toy
with prefix-dependent grammar masks, the first two emitted tokens must follow the grammar-masked target's exact
joint law (chi-square, cells expected fewer than 5 times pooled), and vLLM's stock cut of the drafts must fail.

SV's online step in the plugin (``sv_hook.learn_from_verification``) learns from a ragged step what it learns from its
sampled requests' drafts one by one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kits import lawkit
from scipy.stats import chi2

from blockspec.policy import LatencyTable, SVPolicy
from blockspec.policy.features import DRAFT_FEATURES, draft_features, prefix_logprob
from blockspec.policy.latency import LatencyProfile
from blockspec.policy.predictor import Predictor, Profile
from blockspec.sampling import NonFiniteLogitsError
from blockspec.verify import SAMPLED_RULES, Randomness, expected_accepted, position_gains, verify_block
from blockspec.verify.base import race
from blockspec.vllm.ragged import (
    PLACEHOLDER,
    block_verify_ragged,
    check_rows,
    expected_accepted_ragged,
    has_spare_row,
    pad_ragged,
    padded_block,
    target_probs_with_spare_row,
)
from blockspec.vllm.state import STATE
from blockspec.vllm.sv_hook import learn_from_verification


def ragged_batch(
    counts: list[int], vocab: int, generator: torch.Generator, max_spec_len: int, spare_row: bool = False
) -> tuple[dict[str, Any], torch.Tensor]:
    """Random distributions and draws for requests drafting ``counts`` tokens, in vLLM's layout, plus each
    request's own row after its last drafted token (the bonus token's distribution). With ``spare_row`` the
    target's rows are stored with one more row after them, of NaN: the rule may look at it only where it
    replaces what it draws by the bonus token."""
    total = sum(counts)
    draft_probs = torch.rand(total, vocab, generator=generator, dtype=torch.float64).pow(3)
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    target_probs = torch.rand(total, vocab, generator=generator, dtype=torch.float64).pow(3)
    target_probs /= target_probs.sum(-1, keepdim=True)
    if spare_row:
        target_probs = torch.cat([target_probs, torch.full((1, vocab), float("nan"), dtype=torch.float64)])[:total]
    tokens = (
        torch.multinomial(draft_probs, 1, generator=generator).squeeze(-1)
        if total
        else torch.zeros(0, dtype=torch.long)
    )
    after = torch.rand(len(counts), vocab, generator=generator, dtype=torch.float64)
    after /= after.sum(-1, keepdim=True)
    uniforms = torch.rand(total, generator=generator, dtype=torch.float64)
    exponentials = torch.empty(len(counts), vocab, dtype=torch.float64).exponential_(generator=generator)
    bonus = race(after, exponentials)[:, None]  # what verify_block draws after all tokens, with the same draws
    return dict(
        draft_token_ids=tokens,
        num_draft_tokens=torch.tensor(counts),
        max_spec_len=max_spec_len,
        draft_probs=draft_probs,
        target_probs=target_probs,
        bonus_token_ids=bonus,
        uniforms=uniforms,
        exponentials=exponentials,
    ), after


def one_request(batch: dict, after: torch.Tensor, b: int) -> list[int]:
    """Request b verified alone by verify_block, as a list of emitted tokens."""
    counts = batch["num_draft_tokens"].tolist()
    start, n = sum(counts[:b]), counts[b]
    rows = slice(start, start + n)
    target = torch.cat([batch["target_probs"][rows], after[b : b + 1]])[None]
    randomness = Randomness(batch["uniforms"][rows][None], batch["exponentials"][b : b + 1])
    out = verify_block(
        batch["draft_token_ids"][rows][None], batch["draft_probs"][rows][None], target, randomness=randomness
    )
    return [t for t in out.tokens[0].tolist() if t != -1]


@pytest.mark.parametrize("spare_row", [False, True])
@pytest.mark.parametrize("counts", [[3], [2, 0, 1], [0, 0], [1, 3, 2, 3], [4, 1], [2, 2, 2]])
def test_each_request_is_verify_block_alone(counts, spare_row):
    """Equal counts with a spare target row take the path without copies, which must give the same tokens."""
    generator = torch.Generator().manual_seed(sum(counts) + len(counts))
    for _ in range(200):
        batch, after = ragged_batch(counts, 5, generator, max_spec_len=4, spare_row=spare_row)
        output = block_verify_ragged(**batch)
        assert output.shape == (len(counts), 5) and output.dtype == torch.int32
        for b in range(len(counts)):
            expected = one_request(batch, after, b)
            assert output[b, : len(expected)].tolist() == expected
            assert (output[b, len(expected) :] == PLACEHOLDER).all()


@pytest.mark.parametrize("counts", [[3], [2, 0, 1], [1, 3, 2, 3]])
def test_expected_accepted_is_each_request_s_own(counts):
    """The analytic score of the vLLM benchmark: per request, what blockspec.verify scores on that request alone,
    and the two rules differ (so a score of one rule under the other's name would fail)."""
    batch, _ = ragged_batch(counts, 5, torch.Generator().manual_seed(7), max_spec_len=4)
    scored = expected_accepted_ragged(
        batch["draft_token_ids"], batch["num_draft_tokens"], batch["draft_probs"], batch["target_probs"]
    )
    start = 0
    for b, n in enumerate(counts):
        rows = slice(start, start + n)
        start += n
        target = torch.cat([batch["target_probs"][rows], torch.full((1, 5), 0.2, dtype=torch.float64)])[None]
        for rule in SAMPLED_RULES:
            alone = (
                expected_accepted(batch["draft_token_ids"][rows][None], batch["draft_probs"][rows][None], target, rule)
                if n
                else torch.zeros(1, dtype=torch.float64)
            )
            assert torch.allclose(scored[rule][b], alone[0], rtol=1e-12, atol=1e-12), (rule, b)
    assert (scored["block"] - scored["token"]).abs().max() > 1e-3


def test_pad_ragged_places_each_request_s_rows_first():
    flat = torch.arange(6)
    padded = pad_ragged(flat, torch.tensor([2, 0, 3, 1]), 3, -1)
    assert padded.tolist() == [[0, 1, -1], [-1, -1, -1], [2, 3, 4], [5, -1, -1]]
    equal = pad_ragged(flat, torch.tensor([3, 3]), 3, -1)
    assert equal.tolist() == [[0, 1, 2], [3, 4, 5]] and equal.data_ptr() == flat.data_ptr()  # a view


def test_equal_drafts_are_laid_out_without_copies():
    """The padded block of equal-length drafts views vLLM's tensors, the target's through its spare row."""
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(0))
    target_probs = target_probs_with_spare_row(logits, torch.float32)
    assert torch.allclose(target_probs, logits.softmax(-1)) and has_spare_row(target_probs)
    assert not has_spare_row(target_probs.clone()) and not has_spare_row(target_probs.t())
    draft_probs = torch.rand(6, 5).softmax(-1)
    tokens, draft, target, _ = padded_block(
        torch.tensor([1, 2, 3, 4, 0, 1]), torch.tensor([2, 2, 2]), draft_probs, target_probs
    )
    assert tokens.tolist() == [[1, 2], [3, 4], [0, 1]] and draft.data_ptr() == draft_probs.data_ptr()
    assert target.data_ptr() == target_probs.data_ptr() and target.shape == (3, 3, 5)
    assert torch.equal(target[:, :2].reshape(6, 5), target_probs) and torch.allclose(target[2, 2], torch.tensor(0.2))


def test_inconsistent_counts_are_refused():
    generator = torch.Generator().manual_seed(0)
    batch, _ = ragged_batch([2, 1], 4, generator, max_spec_len=2)
    with pytest.raises(ValueError, match="must sum"):
        block_verify_ragged(**{**batch, "num_draft_tokens": torch.tensor([1, 1])})


def first_token_counts(verify, samples: int, seed: int):
    """Counts of the first emitted token of request 1 in a batch of three, over fresh draws each time; the
    drafts and distributions stay fixed, the bonus token is drawn from its own row."""
    generator = torch.Generator().manual_seed(seed)
    batch, after = ragged_batch([1, 3, 2], 4, generator, max_spec_len=3)
    counts = torch.zeros(4)
    for _ in range(samples):
        draft = torch.multinomial(batch["draft_probs"], 1, generator=generator).squeeze(-1)
        uniforms = torch.rand(6, generator=generator, dtype=torch.float64)
        exponentials = torch.empty(3, 4, dtype=torch.float64).exponential_(generator=generator)
        bonus = torch.multinomial(after, 1, generator=generator)
        output = verify(
            **{
                **batch,
                "draft_token_ids": draft,
                "uniforms": uniforms,
                "exponentials": exponentials,
                "bonus_token_ids": bonus,
            }
        )
        counts[output[1, 0]] += 1
    return counts, batch["target_probs"][1]  # request 1's first target row


def shifted_draft_rows(**batch):
    """Broken: each request's draft rows read one row late (an off-by-one in the ragged offsets)."""
    return block_verify_ragged(**{**batch, "draft_probs": batch["draft_probs"].roll(-1, 0)})


@pytest.mark.parametrize("verify, passes", [(block_verify_ragged, True), (shifted_draft_rows, False)])
def test_first_token_follows_the_target(verify, passes):
    samples = 4000
    counts, target = first_token_counts(verify, samples, seed=3)
    expected = samples * target
    statistic = float(((counts - expected) ** 2 / expected).sum())
    threshold = chi2.ppf(1 - 1e-4, df=len(target) - 1)  # a false alarm once in 10,000 seeds
    assert (statistic < threshold) == passes, (statistic, threshold, counts.tolist(), expected.tolist())


# Drafts a grammar refused (ragged.py's sentinel). The toy: V = 4 tokens, a context-dependent target and draft over
# contexts of up to K = 3 tokens, a grammar whose allowed set depends on the context, requests drafting 2 or 3 tokens.
GRAMMAR_VOCAB, GRAMMAR_SPEC_LEN, GRAMMAR_SAMPLES, GRAMMAR_SEED = 4, 3, 40_000, 17


def grammar_tables(seed: int) -> tuple[lawkit.Tables, lawkit.Tables, list[torch.Tensor]]:
    """(raw, masked, allowed): the target and the draft (``raw``); the grammar's allowed sets allowed[L]
    [V**L, V] bool after every length-L context; ``masked``, the same draft with the target masked by the grammar
    and renormalised: the law the output must follow. The grammar forbids one token at the root and at 40% of
    the other contexts; at a quarter of those the draft moves half of its mass onto the forbidden token."""
    raw = lawkit.random_tables(GRAMMAR_VOCAB, GRAMMAR_SPEC_LEN, seed, peaked=0.5, zeros=False)
    generator = torch.Generator().manual_seed(seed)
    allowed, target, draft = [], [], []
    for length in range(GRAMMAR_SPEC_LEN + 1):
        rows = GRAMMAR_VOCAB**length
        forbidden = torch.nn.functional.one_hot(
            torch.randint(GRAMMAR_VOCAB, (rows,), generator=generator), GRAMMAR_VOCAB
        )  # [rows, V]
        forbids = (torch.rand(rows, generator=generator) < 0.4) | (length == 0)  # [rows]
        heavy = forbids & (torch.rand(rows, generator=generator) < 0.25)  # [rows]
        allowed.append(~(forbidden.bool() & forbids[:, None]))
        row_target = raw.target[length] * allowed[-1]
        target.append(row_target / row_target.sum(-1, keepdim=True))
        draft.append(torch.where(heavy[:, None], 0.5 * raw.draft[length] + 0.5 * forbidden, raw.draft[length]))
    return lawkit.Tables(GRAMMAR_VOCAB, raw.target, draft), lawkit.Tables(GRAMMAR_VOCAB, target, draft), allowed


def grammar_batch(seed: int, samples: int) -> tuple[dict, lawkit.Tables, torch.Tensor]:
    """(batch, masked, refused): ``samples`` independent requests in vLLM's layout, each drafting 2 or 3 tokens
    from the draft table; the grammar replaces its first refused token and every later one by -1. Draft rows are
    the drafter's own rows (unthinned); target rows are the masked target up to the first -1 included, then the
    raw target (the grammar has stopped: the verifier must not read them); the bonus token is drawn from the
    masked target after the last drafted token. ``refused`` [N] bool: the request holds a -1."""
    raw, masked, allowed = grammar_tables(GRAMMAR_SEED)
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(2, GRAMMAR_SPEC_LEN + 1, (samples,), generator=generator)  # [N] n_b
    drafted = raw.draw_blocks(samples, GRAMMAR_SPEC_LEN, generator)  # K tokens; request b keeps its first n_b
    grammar = lawkit.Tables(GRAMMAR_VOCAB, allowed, allowed)  # a table lookup: allowed sets after each context
    real = torch.arange(GRAMMAR_SPEC_LEN) < counts[:, None]  # [N, K]
    ok = torch.stack(
        [
            grammar.target_at(drafted[:, :i]).gather(1, drafted[:, i : i + 1]).squeeze(1)
            for i in range(GRAMMAR_SPEC_LEN)
        ],
        dim=1,
    )  # [N, K]: x_i is allowed after x_<i
    alive = ok.cumprod(1).bool()  # [N, K]: x_1..x_i all allowed
    draft_probs, target_masked = masked.block_inputs(drafted)  # [N, K, V], [N, K+1, V]
    _, target_raw = raw.block_inputs(drafted)
    # Off by one: target row i (0-based) follows x_1..x_i, so it is the grammar's row when alive[:, i - 1]; row 0
    # follows the prompt alone and always is.
    valid_context = torch.nn.functional.pad(alive, (1, 0), value=True)  # [N, K+1]
    target_probs = torch.where(valid_context[..., None], target_masked, target_raw)
    bonus = torch.multinomial(target_probs[torch.arange(samples), counts], 1, generator=generator)  # [N, 1]
    total = int(counts.sum())
    batch = dict(
        draft_token_ids=drafted.masked_fill(~alive, PLACEHOLDER)[real],
        num_draft_tokens=counts,
        max_spec_len=GRAMMAR_SPEC_LEN,
        draft_probs=draft_probs[real],
        target_probs=target_probs[:, :-1][real],
        bonus_token_ids=bonus,
        uniforms=torch.rand(total, generator=generator, dtype=torch.float64),
        exponentials=torch.empty(samples, GRAMMAR_VOCAB, dtype=torch.float64).exponential_(generator=generator),
    )
    return batch, masked, (real & ~alive).any(1)


def first_two_emitted(verify, seed: int, samples: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(counts [V+1, V+1] of the first two emitted tokens, their exact law under the masked target, the share of
    requests holding a -1). Symbol V stands for any token outside the vocabulary (a sentinel let through): its
    law is 0. A request that emitted one token only gets its second from the masked target after the first."""
    vocab = GRAMMAR_VOCAB
    batch, masked, refused = grammar_batch(seed, samples)
    output = verify(**batch)[:, :2].to(torch.long).clamp(max=vocab)  # [N, 2]; -1 = the second was not emitted
    generator = torch.Generator().manual_seed(seed + 1)
    after_first = masked.target_at(output[:, :1].clamp(max=vocab - 1))  # [N, V]
    second = torch.multinomial(after_first, 1, generator=generator).squeeze(1)
    first_two = torch.stack([output[:, 0], torch.where(output[:, 1] == PLACEHOLDER, second, output[:, 1])], dim=1)
    law = torch.nn.functional.pad(lawkit.target_law(masked, 2), (0, 1, 0, 1))  # [V+1, V+1]
    return lawkit.joint_counts(first_two, vocab + 1), law, float(refused.double().mean())


def cut_refused_drafts(**batch):
    """Broken: vLLM's stock cut, not lossless. A request's drafts end before its first -1 (num_draft_tokens
    shortened, no sentinel); its bonus token is drawn from the target after the kept ones (the first -1's row)."""
    num_draft_tokens = batch["num_draft_tokens"]
    kept = batch["draft_token_ids"] != PLACEHOLDER  # [T]
    request = torch.repeat_interleave(torch.arange(len(num_draft_tokens)), num_draft_tokens)  # [T]
    position = torch.arange(len(kept)) - (num_draft_tokens.cumsum(0) - num_draft_tokens)[request]  # [T], 0-based
    counts = torch.zeros_like(num_draft_tokens).index_add_(0, request, kept.to(num_draft_tokens.dtype))  # [B]
    first_cut = ~kept & (position == counts[request])  # [T]: each cut request's first -1
    bonus = batch["bonus_token_ids"].clone()
    bonus[request[first_cut], 0] = race(batch["target_probs"][first_cut], batch["exponentials"][request[first_cut]])
    rows = {name: batch[name][kept] for name in ("draft_token_ids", "draft_probs", "target_probs", "uniforms")}
    return block_verify_ragged(**{**batch, **rows, "num_draft_tokens": counts, "bonus_token_ids": bonus})


@pytest.mark.parametrize("verify, passes", [(block_verify_ragged, True), (cut_refused_drafts, False)])
def test_refused_drafts_keep_the_masked_target_law(verify, passes):
    counts, law, refused = first_two_emitted(verify, seed=0, samples=GRAMMAR_SAMPLES)
    assert 0.2 < refused < 0.5  # the sentinel is exercised often, and the grammar still lets most drafts through
    groups = lawkit.sparse_cell_groups(law, GRAMMAR_SAMPLES)
    result = lawkit.chi_square(lawkit.pool_cells(counts, groups), lawkit.pool_cells(law, groups))
    assert result.passed == passes, (result, refused)


def sv_for_vllm(max_draft: int) -> SVPolicy:
    """The plugin's kind of SVPolicy (ragged, whole drafts, draft-only predictor), with hand-set weights."""
    predictor = Predictor(DRAFT_FEATURES, (1.0, -0.5, -0.5, 1.0, 0.4))
    profile = Profile(
        "target",
        "draft",
        None,
        {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
        {"block": {"draft": predictor}},
        {"block": [0.9] * max_draft},
    )
    latency = LatencyProfile(LatencyTable((1,), (1, 2), ((1.0, 1.5),)), LatencyTable((1,), (1,), ((0.1,),)), None, {})
    return SVPolicy(profile, latency, rule="block", max_draft=max_draft, kind="draft", ragged=True, whole_drafts=True)


@pytest.mark.parametrize("counts", [[3, 0, 1, 2], [2, 2, 2], [4, 1], [0, 3], [1, 0]])
def test_sv_learns_from_a_ragged_step_what_it_learns_from_each_request_alone(counts, monkeypatch):
    """One step of SV's predictor offset on the exact block-rule gains of the drafts the step verified, against the
    gains predicted for them: the offset moves by SV's rate times the mean difference over every drafted position
    of the sampled requests, here computed request by request from each one's own rows. The second-to-last
    request is greedy (vLLM's greedy path) and is not learnt from; with nothing sampled drafted, nothing moves."""
    monkeypatch.setattr(STATE, "offset", 0.0)
    batch, _ = ragged_batch(counts, 6, torch.Generator().manual_seed(len(counts)), max(counts))
    sampled = torch.ones(len(counts), dtype=torch.bool)
    sampled[-2] = False
    policy = sv_for_vllm(max(counts))
    differences, start = [], 0
    for request, n in enumerate(counts):
        rows = slice(start, start + n)
        start += n
        if n and sampled[request]:
            tokens, draft = batch["draft_token_ids"][rows][None], batch["draft_probs"][rows][None]
            gains = position_gains(tokens, draft, batch["target_probs"][rows][None], "block")
            predicted = policy.predict("draft", draft_features(draft, prefix_logprob(tokens, draft)))
            differences.append((gains - predicted)[0])
    learn_from_verification(
        policy,
        batch["draft_token_ids"],
        batch["num_draft_tokens"],
        sampled,
        batch["draft_probs"],
        batch["target_probs"],
    )
    expected = policy.rate * float(torch.cat(differences).mean()) if differences else 0.0
    assert policy.offsets["draft"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert STATE.offset == policy.offsets["draft"]
    assert (policy.offsets["draft"] != 0.0) == bool(differences)


NAMES = {"target": "t-model", "draft": "d-model"}


def test_masked_tokens_and_rows_not_verified_by_the_rule_pass_the_row_check():
    """-inf entries (tokens top-k, top-p or a grammar masked) are harmless where the row keeps a finite maximum,
    and a greedy request's rows (not verified by the block rule) are not the rule's to check."""
    logits = torch.tensor([[0.0, float("-inf"), 1.0], [float("nan"), 0.0, 0.0], [float("-inf")] * 3])
    draft = torch.tensor([[0.5, 0.0, 0.5], [float("nan")] * 3, [0.0] * 3])
    check_rows(draft, logits, torch.tensor([True, False, False]), NAMES)


@pytest.mark.parametrize(
    ("row", "model"),
    [
        (("target", 1, [float("nan"), 0.0, 0.0]), "target model \\(t-model\\) gave non-finite .* logits"),
        (("target", 1, [0.0, float("inf"), 0.0]), "target model"),
        (("target", 1, [float("-inf")] * 3), "target model .*at 1 of 3 drafted positions \\(first at row 1"),
        (("draft", 2, [0.0] * 3), "draft model \\(d-model\\) gave non-finite or fully masked probabilities"),
        (("draft", 2, [float("nan"), 0.5, 0.5]), "draft model"),
    ],
)
def test_a_verified_row_without_a_finite_maximum_is_refused_naming_the_model(row, model):
    """One maximum per row: NaN if any entry is, +inf if any is, -inf (or a draft's 0) only if every token is
    masked; the block rule would read such a row as a distribution and emit token 0."""
    logits, draft = torch.zeros(3, 3), torch.full((3, 3), 1 / 3)
    role, index, values = row
    (logits if role == "target" else draft)[index] = torch.tensor(values)
    with pytest.raises(NonFiniteLogitsError, match=model):
        check_rows(draft, logits, torch.ones(3, dtype=torch.bool), NAMES)
