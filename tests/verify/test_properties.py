"""Golden and property tests of the verifiers (docs/testing.md says how they fit with the other kinds).

golden      hand-made probabilities whose outcome is fixed, checked by hand against docs/algorithms.md
format      tokens [B, K+1] int64 left-aligned and -1 padded, the accepted prefix is the draft's, tau bounds
support     a token the target gives probability 0 is never emitted
purity      same seed -> same output; explicit Randomness -> a pure function (no generator, no global RNG)
device      on CUDA (where torch sees a GPU) the CPU's decisions and closed forms, from the same inputs
layout      a row's output does not depend on its batch neighbours, nor on the padding of a ragged batch
agreement   K = 1 and a one-hot target: token == block decision by decision; a one-hot draft: same law
greedy      the argmax chain, ties to the lowest token id
numerics    V = 151,936 float32, near-zero and subnormal draft probabilities, exact ties, uniform rows, K = 0

Laws are checked exactly elsewhere (tests/verify/test_exact_law.py) and by Monte-Carlo in
tests/verify/test_statistical.py.
"""

from __future__ import annotations

import pytest
import torch
from kits import lawkit

from blockspec.verify import (
    RULES,
    SAMPLED_RULES,
    Randomness,
    acceptance_survival,
    block_acceptance,
    final_distributions,
    token_acceptance,
    verify_block,
    verify_greedy,
    verify_token,
)

DTYPES = {"float64": torch.float64, "float32": torch.float32}


# --- helpers --------------------------------------------------------------------------------------------------


def random_inputs(batch, width, vocab, seed, *, dtype=torch.float64, target_zeros=0.0, scale=2.0):
    """(draft_tokens [B, K], draft_probs [B, K, V], target_probs [B, K+1, V]); x_i sampled from draft_probs.

    With ``target_zeros`` that fraction of the target's entries is set to exactly 0 (never the row's mode).
    """
    gen = torch.Generator().manual_seed(seed)
    target = (scale * torch.randn(batch, width + 1, vocab, generator=gen, dtype=torch.float64)).softmax(-1)
    if target_zeros:
        kill = torch.rand(target.shape, generator=gen, dtype=torch.float64) < target_zeros
        kill.scatter_(-1, target.argmax(-1, keepdim=True), False)
        target = target.masked_fill(kill, 0.0)
        target = target / target.sum(-1, keepdim=True)
    draft = (scale * torch.randn(batch, width, vocab, generator=gen, dtype=torch.float64)).softmax(-1)
    draft_tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, width)
    return draft_tokens, draft.to(dtype), target.to(dtype)


def draw(batch, width, vocab, seed, dtype=torch.float64) -> Randomness:
    return Randomness.draw(batch, width, vocab, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def check_format(out, draft_tokens, vocab, num_verified=None):
    """The VerifyOutput contract: shapes, dtypes, tau bounds, accepted prefix, one emitted token, -1 after."""
    batch, width = draft_tokens.shape
    if num_verified is None:
        num_verified = torch.full((batch,), width, dtype=torch.long)
    tokens, tau = out.tokens, out.num_accepted
    assert tokens.shape == (batch, width + 1) and tokens.dtype == torch.int64
    assert tau.shape == (batch,) and tau.dtype == torch.int64
    assert bool(((tau >= 0) & (tau <= num_verified)).all()), (tau, num_verified)
    assert torch.equal(out.num_emitted, tau + 1)
    positions = torch.arange(width + 1)
    padded = torch.nn.functional.pad(draft_tokens, (0, 1), value=-1)
    before, at, after = positions < tau[:, None], positions == tau[:, None], positions > tau[:, None]
    assert torch.equal(tokens[before], padded[before]), "the accepted prefix must be the drafted tokens"
    last = tokens[at]
    assert bool(((last >= 0) & (last < vocab)).all()), last
    assert bool((tokens[after] == -1).all()), "positions after tau must be -1"


def assert_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float64 rounding (1e-12 absolute): what the closed forms promise."""
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)


def same(a, b) -> bool:
    return torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


# --- golden ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_golden_draft_equals_target_accepts_everything(sampled_rule, dtype):
    # ratio_i = 1 everywhere: token accepts with probability 1; block has w_i = 1, so h_K = w_K = 1 (tau = K
    # whatever u is), and Z_i = 0 with a zero denominator for i < K (the guard). The bonus row is one-hot.
    batch, width, vocab = 16, 3, 5
    draft_tokens, _, target = random_inputs(batch, width, vocab, seed=0, dtype=DTYPES[dtype])
    bonus = torch.arange(batch) % vocab
    target[:, width] = torch.nn.functional.one_hot(bonus, vocab).to(target.dtype)
    draft = target[:, :width].clone()
    draft_tokens = draft.argmax(-1)  # any token with draft probability > 0 would do
    for seed in range(5):
        out = RULES[sampled_rule].verify(draft_tokens, draft, target, generator=torch.Generator().manual_seed(seed))
        assert bool((out.num_accepted == width).all()), out.num_accepted
        assert torch.equal(out.tokens[:, :width], draft_tokens)
        assert torch.equal(out.tokens[:, width], bonus)


def test_golden_target_gives_zero_to_first_draft_token(sampled_rule):
    # target(x_1) = 0: token rejects x_1 surely; block has w_1 = 0, hence w_i = 0, Z_i = 0 and h_i = 0 for all
    # i >= 1: tau = 0. The correction comes from max(target_0 - draft_0, 0) = (0, 0, 1/2): always token 2.
    batch, width = 32, 3
    draft_tokens, draft, target = random_inputs(batch, width, 3, seed=1)
    target[:, 0] = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
    draft[:, 0] = torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64)
    draft_tokens[:, 0] = 0
    for seed in range(5):
        out = RULES[sampled_rule].verify(draft_tokens, draft, target, generator=torch.Generator().manual_seed(seed))
        assert bool((out.num_accepted == 0).all())
        assert bool((out.tokens[:, 0] == 2).all()) and bool((out.tokens[:, 1:] == -1).all())


def _hand_case():
    """V = 3, K = 2; rows differ only in x_2. Hand computation (docs/algorithms.md notation, 1-based positions):

    target_0 = (1/4, 1/2, 1/4), draft_0 = (1/2, 1/4, 1/4), x_1 = 0: ratio_1 = 1/2, a_1 = 1/2, w_1 = 1/2
    target_1 = (.6, .4, 0),     draft_1 = (.2, .2, .6)
        Z_1 = max(.3 - .2, 0) + max(.2 - .2, 0) + max(0 - .6, 0) = .1;  h_1 = .1 / (.1 + 1 - .5) = 1/6
        x_2 = 0: ratio 3 -> a_2 = 1, w_2 = min(1, 3/2) = 1 = h_2
        x_2 = 1: ratio 2 -> a_2 = 1, w_2 = min(1, 1) = 1 = h_2
        x_2 = 2: ratio 0 -> a_2 = 0, w_2 = 0 = h_2
    target_2 = (.2, .3, .5) (the bonus)
    residuals: token at tau=0: max(target_0 - draft_0, 0) = (0, 1/4, 0);  at tau=1: (.4, .2, 0)
               block at tau=0 (w_0 = 1): (0, 1/4, 0);                     at tau=1 (w_1 = 1/2): (.1, 0, 0)
    """
    f64 = torch.float64
    target = torch.tensor([[0.25, 0.5, 0.25], [0.6, 0.4, 0.0], [0.2, 0.3, 0.5]], dtype=f64).expand(3, 3, 3)
    draft = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.2, 0.6]], dtype=f64).expand(3, 2, 3)
    draft_tokens = torch.tensor([[0, 0], [0, 1], [0, 2]])
    return draft_tokens, draft, target


def test_golden_hand_computed_closed_forms():
    draft_tokens, draft, target = _hand_case()
    num_verified = torch.full((3,), 2)
    assert_exact(
        token_acceptance(draft_tokens, draft, target, num_verified),
        torch.tensor([[0.5, 1.0], [0.5, 1.0], [0.5, 0.0]], dtype=torch.float64),
    )
    h, log_w = block_acceptance(draft_tokens, draft, target, num_verified)
    assert_exact(h, torch.tensor([[1 / 6, 1.0], [1 / 6, 1.0], [1 / 6, 0.0]], dtype=torch.float64))
    assert_exact(log_w.exp(), torch.tensor([[1, 0.5, 1], [1, 0.5, 1], [1, 0.5, 0]], dtype=torch.float64))
    # P(tau >= i | block): token prod a_k; block 1 - prod_{j >= i} (1 - h_j).
    assert_exact(
        acceptance_survival(draft_tokens, draft, target, "token"),
        torch.tensor([[1, 0.5, 0.5], [1, 0.5, 0.5], [1, 0.5, 0]], dtype=torch.float64),
    )
    block_survival = acceptance_survival(draft_tokens, draft, target, "block")
    assert_exact(block_survival, torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1 / 6, 0]], dtype=torch.float64))
    # docs/algorithms.md: marginally P(tau >= 1 | x_1) = w_1: .2 * 1 + .2 * 1 + .6 * 1/6 = 1/2.
    assert abs(float((draft[0, 1] * block_survival[:, 1]).sum()) - 0.5) < 1e-12
    finals = final_distributions(draft_tokens, draft, target, "block")
    assert_exact(finals[2, :2], torch.tensor([[0, 1, 0], [1, 0, 0]], dtype=torch.float64))
    finals = final_distributions(draft_tokens, draft, target, "token")
    assert_exact(finals[2, :2], torch.tensor([[0, 1, 0], [2 / 3, 1 / 3, 0]], dtype=torch.float64))


def test_golden_hand_computed_outcomes():
    # Same tables, chosen uniforms and exponentials. The race emits argmax_v weight_v / E_v.
    draft_tokens, draft, target = _hand_case()
    rows = [  # (x_2, u, E) -> expected (token tokens, block tokens)
        # u_1 = .1 < a_1 and < h_1; u_2 = .5 >= a_2 = h_2 = 0. token: tau 1, residual (.4, .2, 0) / (1, .1, 1)
        # -> 1. block: tau 1 (last hit), residual (.1, 0, 0) -> 0. Only the w_1 scaling separates them.
        (2, (0.1, 0.5), (1.0, 0.1, 1.0), [0, 1, -1], [0, 0, -1]),
        # u_1 = .3: token accepts (< 1/2), block misses (>= 1/6). token as above; block tau 0, residual (0, 1/4, 0).
        (2, (0.3, 0.5), (1.0, 0.1, 1.0), [0, 1, -1], [1, -1, -1]),
        # u_1 = .9: token rejects x_1 -> (0, 1/4, 0) -> 1. block: u_2 < h_2 = 1, tau = 2 (no early stop): the
        # bonus (.2, .3, .5) / (.1, 1, 1) -> 0.
        (1, (0.9, 0.99), (0.1, 1.0, 1.0), [1, -1, -1], [0, 1, 0]),
        # everything accepted by both: the bonus -> 0.
        (1, (0.4, 0.2), (0.1, 1.0, 1.0), [0, 1, 0], [0, 1, 0]),
    ]
    index = torch.tensor([row[0] for row in rows])  # row r of _hand_case has x_2 = r
    uniforms = torch.tensor([row[1] for row in rows], dtype=torch.float64)
    exponentials = torch.tensor([row[2] for row in rows], dtype=torch.float64)
    randomness = Randomness(uniforms, exponentials)
    args = (draft_tokens[index], draft[index], target[index])
    token, block = verify_token(*args, randomness=randomness), verify_block(*args, randomness=randomness)
    assert token.tokens.tolist() == [row[3] for row in rows]
    assert block.tokens.tolist() == [row[4] for row in rows]
    assert token.num_accepted.tolist() == [1, 1, 0, 2] and block.num_accepted.tolist() == [1, 0, 2, 2]


# --- output format, support ------------------------------------------------------------------------------------


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["draft_probs", "draft_probs_None"])
@pytest.mark.parametrize("ragged", [False, True], ids=["full", "ragged"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_output_format(rule, dtype, ragged, one_hot_draft):
    batch, width, vocab = 64, 5, 11
    for seed in range(3):
        draft_tokens, draft, target = random_inputs(batch, width, vocab, seed, dtype=DTYPES[dtype])
        num_verified = torch.randint(0, width + 1, (batch,), generator=torch.Generator().manual_seed(seed))
        num_verified = num_verified if ragged else None
        out = RULES[rule].verify(
            draft_tokens,
            None if one_hot_draft else draft,
            target,
            num_verified=num_verified,
            generator=torch.Generator().manual_seed(seed),
        )
        check_format(out, draft_tokens, vocab, num_verified)
    assert int(out.num_accepted.max()) > 0 or not RULES[rule].sampled  # the prefix check was exercised


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["draft_probs", "draft_probs_None"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_probability_tokens_never_emitted(rule, dtype, one_hot_draft):
    # Half of the target's entries are 0 and the draft has none, so many drafted tokens have target
    # probability 0: they must never be accepted, nor drawn as corrections or bonuses.
    batch, width, vocab = 200, 4, 6
    emitted = 0
    for seed in range(30):
        draft_tokens, draft, target = random_inputs(batch, width, vocab, seed, dtype=DTYPES[dtype], target_zeros=0.5)
        out = RULES[rule].verify(
            draft_tokens, None if one_hot_draft else draft, target, generator=torch.Generator().manual_seed(seed)
        )
        shown = out.tokens >= 0  # [B, K+1]: positions 0..tau
        prob = target.gather(-1, out.tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # target prob at own context
        assert bool((prob[shown] > 0).all()), f"seed {seed}: emitted a token of target probability 0"
        emitted += int(shown.sum())
    zero_drafts = target[:, :-1].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1) == 0
    assert bool(zero_drafts.any()) and emitted > batch * 30  # the test met zero-probability drafts


# --- purity -----------------------------------------------------------------------------------------------------


def test_same_seed_same_output(rule):
    batch, width, vocab = 256, 4, 7
    draft_tokens, draft, target = random_inputs(batch, width, vocab, seed=3)
    global_state = torch.random.get_rng_state()
    first = RULES[rule].verify(draft_tokens, draft, target, generator=torch.Generator().manual_seed(7))
    second = RULES[rule].verify(draft_tokens, draft, target, generator=torch.Generator().manual_seed(7))
    other = RULES[rule].verify(draft_tokens, draft, target, generator=torch.Generator().manual_seed(8))
    assert same(first, second)
    assert torch.equal(torch.random.get_rng_state(), global_state), "the global RNG must not be touched"
    if RULES[rule].sampled:  # the generator is really used: another seed changes some of 256 rows
        assert not same(first, other)
    else:
        assert same(first, other)


def test_explicit_randomness_is_a_pure_function(rule):
    batch, width, vocab = 64, 4, 7
    draft_tokens, draft, target = random_inputs(batch, width, vocab, seed=4)
    randomness = draw(batch, width, vocab, seed=5)
    inputs = [t.clone() for t in (draft_tokens, draft, target, randomness.uniforms, randomness.exponentials)]
    generator = torch.Generator().manual_seed(123)
    generator_state, global_state = generator.get_state(), torch.random.get_rng_state()
    outputs = [
        RULES[rule].verify(draft_tokens, draft, target, randomness=randomness, generator=g)
        for g in (None, generator, torch.Generator().manual_seed(456))
    ]
    assert same(outputs[0], outputs[1]) and same(outputs[0], outputs[2])
    assert torch.equal(generator.get_state(), generator_state), "explicit randomness must not consume the generator"
    assert torch.equal(torch.random.get_rng_state(), global_state)
    after = (draft_tokens, draft, target, randomness.uniforms, randomness.exponentials)
    assert all(torch.equal(a, b) for a, b in zip(inputs, after)), "inputs must not be modified"


def test_a_cuda_device_makes_the_cpus_decisions(rule, device):
    if device == "cpu":
        pytest.skip("the CPU is the reference: this runs where torch sees a GPU")
    batch, width, vocab = 4096, 4, 7
    draft_tokens, draft, target = random_inputs(batch, width, vocab, seed=6)
    num_verified = torch.randint(0, width + 1, (batch,), generator=torch.Generator().manual_seed(7))
    randomness = draw(batch, width, vocab, seed=8)
    inputs = (draft_tokens, draft, target)
    on_cpu = RULES[rule].verify(*inputs, num_verified=num_verified, randomness=randomness)
    moved = Randomness(randomness.uniforms.to(device), randomness.exponentials.to(device))
    on_device = RULES[rule].verify(
        *(t.to(device) for t in inputs), num_verified=num_verified.to(device), randomness=moved
    )
    assert on_device.tokens.device.type == device
    assert torch.equal(on_device.tokens.cpu(), on_cpu.tokens)
    assert torch.equal(on_device.num_accepted.cpu(), on_cpu.num_accepted)
    if RULES[rule].sampled:  # the deterministic part, in float64, to rounding
        survival = acceptance_survival(draft_tokens, draft, target, rule, num_verified)
        inputs_there = [t.to(device) for t in (draft_tokens, draft, target, num_verified)]
        moved_survival = acceptance_survival(inputs_there[0], inputs_there[1], inputs_there[2], rule, inputs_there[3])
        torch.testing.assert_close(moved_survival.cpu(), survival, rtol=0, atol=1e-12)


# --- layout: batch neighbours, ragged padding -------------------------------------------------------------------


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["draft_probs", "draft_probs_None"])
def test_batch_rows_independent_of_neighbours(rule, one_hot_draft):
    batch, width, vocab = 24, 4, 6
    verifier = RULES[rule].verify
    for seed in range(3):
        draft_tokens, draft, target = random_inputs(batch, width, vocab, seed=10 + seed)
        draft = None if one_hot_draft else draft
        num_verified = torch.randint(0, width + 1, (batch,), generator=torch.Generator().manual_seed(seed))
        randomness = draw(batch, width, vocab, seed=20 + seed)
        together = verifier(draft_tokens, draft, target, num_verified=num_verified, randomness=randomness)
        for b in range(batch):
            alone = verifier(
                draft_tokens[b : b + 1],
                None if draft is None else draft[b : b + 1],
                target[b : b + 1],
                num_verified=num_verified[b : b + 1],
                randomness=Randomness(randomness.uniforms[b : b + 1], randomness.exponentials[b : b + 1]),
            )
            assert torch.equal(alone.tokens[0], together.tokens[b]), (seed, b)
            assert int(alone.num_accepted[0]) == int(together.num_accepted[b]), (seed, b)


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["draft_probs", "draft_probs_None"])
def test_ragged_row_equals_the_row_alone_with_its_own_k(rule, one_hot_draft):
    # Row b drafted n_b tokens inside a K-wide batch whose padding is garbage: token id -1, unnormalised
    # draft and target rows (with zeros) and uniforms of 0 (which would accept anything they touched). It must
    # give exactly the output of the row verified alone with K = n_b and the first n_b uniforms.
    batch, width, vocab = 10, 4, 5
    verifier = RULES[rule].verify
    gen = torch.Generator().manual_seed(0)
    for seed in range(4):
        draft_tokens, draft, target = random_inputs(batch, width, vocab, seed=30 + seed)
        num_verified = torch.arange(batch) % (width + 1)  # every n in 0..K, twice
        randomness = draw(batch, width, vocab, seed=40 + seed)
        junk = 3.0 * torch.rand(batch, width + 1, vocab, generator=gen, dtype=torch.float64)
        junk = junk.masked_fill(torch.rand(junk.shape, generator=gen) < 0.3, 0.0)
        drafted = torch.arange(width) < num_verified[:, None]  # [B, K]
        used_target = torch.arange(width + 1) <= num_verified[:, None]  # [B, K+1]: n_b is the bonus row
        padded_tokens = torch.where(drafted, draft_tokens, -1)
        padded_draft = torch.where(drafted[..., None], draft, junk[:, :width])
        padded_target = torch.where(used_target[..., None], target, junk)
        padded_uniforms = torch.where(drafted, randomness.uniforms, 0.0)
        out = verifier(
            padded_tokens,
            None if one_hot_draft else padded_draft,
            padded_target,
            num_verified=num_verified,
            randomness=Randomness(padded_uniforms, randomness.exponentials),
        )
        check_format(out, padded_tokens.clamp(min=0), vocab, num_verified)
        for b in range(batch):
            n = int(num_verified[b])
            alone = verifier(
                draft_tokens[b : b + 1, :n],
                None if one_hot_draft else draft[b : b + 1, :n],
                target[b : b + 1, : n + 1],
                randomness=Randomness(randomness.uniforms[b : b + 1, :n], randomness.exponentials[b : b + 1]),
            )
            assert torch.equal(out.tokens[b, : n + 1], alone.tokens[0]), (seed, b, n)
            assert bool((out.tokens[b, n + 1 :] == -1).all())
            assert int(out.num_accepted[b]) == int(alone.num_accepted[0]), (seed, b, n)


# --- agreements between the rules --------------------------------------------------------------------------------


def _reachable(survival: torch.Tensor) -> torch.Tensor:
    """[B, K+1] bool: P(tau = i | block) > 0, where the final distribution after tau = i is ever used."""
    return (survival - torch.nn.functional.pad(survival[:, 1:], (0, 1))) > 0


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["draft_probs", "draft_probs_None"])
def test_k1_token_and_block_identical(one_hot_draft):
    # K = 1: h_1 = w_1 = min(1, ratio_1) = a_1 and both residuals use w_0 = 1: the same rule.
    batch, vocab = 512, 5
    for seed in range(3):
        draft_tokens, draft, target = random_inputs(batch, 1, vocab, seed=50 + seed, target_zeros=0.3)
        draft = None if one_hot_draft else draft
        assert_exact(
            acceptance_survival(draft_tokens, draft, target, "token"),
            acceptance_survival(draft_tokens, draft, target, "block"),
        )
        assert_exact(
            final_distributions(draft_tokens, draft, target, "token"),
            final_distributions(draft_tokens, draft, target, "block"),
        )
        randomness = draw(batch, 1, vocab, seed=60 + seed)
        token = verify_token(draft_tokens, draft, target, randomness=randomness)
        block = verify_block(draft_tokens, draft, target, randomness=randomness)
        assert same(token, block)
        assert 0 < int(token.num_accepted.sum()) < batch  # both outcomes occurred


def test_one_hot_target_token_and_block_identical():
    # A one-hot target (greedy-like): every ratio is 0 or >= 1, so a_i, w_i and h_i are all 0 or 1 and both rules
    # accept exactly the drafted tokens that are the target's mode, up to the first that is not.
    batch, width, vocab = 512, 4, 5
    for seed in range(3):
        draft_tokens, draft, target = random_inputs(batch, width, vocab, seed=70 + seed, scale=1.0)
        gen = torch.Generator().manual_seed(seed)
        modes = torch.randint(0, vocab, target.shape[:2], generator=gen)  # the target's one-hot tokens
        follow = torch.rand(batch, width, generator=gen) < 0.6  # the draft proposed the mode: accepted
        modes[:, :width] = torch.where(follow, draft_tokens, modes[:, :width])
        target = torch.nn.functional.one_hot(modes, vocab).to(torch.float64)
        token_survival = acceptance_survival(draft_tokens, draft, target, "token")
        block_survival = acceptance_survival(draft_tokens, draft, target, "block")
        assert torch.equal(token_survival, block_survival), "exact: every quantity is 0 or 1"
        reachable = _reachable(token_survival)
        torch.testing.assert_close(
            final_distributions(draft_tokens, draft, target, "token")[reachable],
            final_distributions(draft_tokens, draft, target, "block")[reachable],
            atol=0,
            rtol=0,
        )
        randomness = draw(batch, width, vocab, seed=80 + seed)
        token = verify_token(draft_tokens, draft, target, randomness=randomness)
        block = verify_block(draft_tokens, draft, target, randomness=randomness)
        assert same(token, block)
        assert len(set(token.num_accepted.tolist())) == width + 1  # every tau occurred


def test_one_hot_draft_token_and_block_same_law():
    # draft_probs=None (a one-hot draft): block gives no gain, P(tau >= i | block) = w_i = prod a_k for both, and
    # the emitted token's law after each tau is the same. NOT decision by decision under the same uniforms: the
    # two rules couple the uniforms to tau differently (e.g. V = 2, target (1/2, 1/2) at every position,
    # u = (.9, .1): token rejects x_1, block takes tau = 2 since h_2 = w_2 = 1/4 > .1), so outputs are not compared.
    batch, width, vocab = 512, 4, 5
    for seed in range(3):
        draft_tokens, draft, target = random_inputs(batch, width, vocab, seed=90 + seed, target_zeros=0.3)
        token_survival = acceptance_survival(draft_tokens, None, target, "token")
        assert_exact(acceptance_survival(draft_tokens, None, target, "block"), token_survival)
        reachable = _reachable(token_survival)
        assert_exact(
            final_distributions(draft_tokens, None, target, "token")[reachable],
            final_distributions(draft_tokens, None, target, "block")[reachable],
        )
        # draft_probs=None is the same as passing the one-hot rows explicitly.
        one_hot = torch.nn.functional.one_hot(draft_tokens, vocab).to(torch.float64)
        randomness = draw(batch, width, vocab, seed=100 + seed)
        for rule in RULES.values():
            assert same(
                rule.verify(draft_tokens, None, target, randomness=randomness),
                rule.verify(draft_tokens, one_hot, target, randomness=randomness),
            )


# --- greedy ---------------------------------------------------------------------------------------------------------


def _argmax_lowest(row: list[float]) -> int:
    best = max(row)
    return row.index(best)  # the first, i.e. lowest, id among exact ties


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["draft_probs", "draft_probs_None"])
def test_greedy_equals_argmax_chain(one_hot_draft):
    batch, width, vocab = 128, 5, 6
    gen = torch.Generator().manual_seed(0)
    # Probabilities from small integer counts: exact ties of the maximum are frequent.
    counts = torch.randint(1, 4, (batch, width + 1, vocab), generator=gen).double()
    target = counts / counts.sum(-1, keepdim=True)
    chain = target.argmax(-1)  # torch: first maximal index
    # Drafts follow the chain with probability .7, else a random token, often the other member of a tie.
    noise = torch.randint(0, vocab, (batch, width), generator=gen)
    draft_tokens = torch.where(torch.rand(batch, width, generator=gen) < 0.7, chain[:, :-1], noise)
    num_verified = torch.randint(0, width + 1, (batch,), generator=gen)
    draft = None
    if not one_hot_draft:  # any valid draft distributions: greedy ignores them
        draft = torch.rand(batch, width, vocab, generator=gen, dtype=torch.float64) + 0.1
        draft = draft / draft.sum(-1, keepdim=True)
    out = verify_greedy(draft_tokens, draft, target, num_verified=num_verified)

    ties_met = 0
    rows = target.tolist()
    for b in range(batch):
        tau = 0
        while tau < int(num_verified[b]) and int(draft_tokens[b, tau]) == _argmax_lowest(rows[b][tau]):
            tau += 1
        expected = draft_tokens[b, :tau].tolist() + [_argmax_lowest(rows[b][tau])]
        expected += [-1] * (width + 1 - len(expected))
        assert out.tokens[b].tolist() == expected, (b, rows[b], draft_tokens[b].tolist(), int(num_verified[b]))
        assert int(out.num_accepted[b]) == tau
        for i in range(min(tau + 1, int(num_verified[b]))):  # positions the rule looked at
            row, drafted = rows[b][i], int(draft_tokens[b, i])
            if row[drafted] == max(row) and drafted != _argmax_lowest(row):  # a maximum, but not the lowest id
                ties_met += 1
    assert ties_met > 0, "the data must exercise a drafted token tied with a lower id"


# --- numerics -------------------------------------------------------------------------------------------------------


def _realistic(batch, width, vocab, seed):
    """Peaked LM-like distributions in float32: N(0, 2) logits plus 8 spikes of +12 per row, temperature 0.8;
    the draft is the same logits plus N(0, 0.7) noise (a smaller model of the same family)."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(batch, width + 1, vocab, generator=gen)
    spikes = torch.randint(0, vocab, (batch, width + 1, 8), generator=gen)
    logits.scatter_add_(-1, spikes, torch.full(spikes.shape, 12.0))
    target = (logits / 0.8).softmax(-1)
    draft = (logits[:, :width] + 0.7 * torch.randn(batch, width, vocab, generator=gen)).softmax(-1)
    draft_tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, width)
    return draft_tokens, draft, target


def test_large_vocab_float32():
    batch, width, vocab = 2, 4, 151_936
    draft_tokens, draft, target = _realistic(batch, width, vocab, seed=0)
    assert float(target.amax(-1).min()) > 0.3  # peaked, as a real model's rows are
    for seed in range(3):
        for rule in RULES.values():
            out = rule.verify(draft_tokens, draft, target, generator=torch.Generator().manual_seed(seed))
            check_format(out, draft_tokens, vocab)
    # The exact closed forms in float32 against float64 arithmetic on the SAME (upcast) probabilities
    # (validate=False: float32 rows sum to 1 only within ~4e-5, beyond float64's tolerance). Tolerance 1e-5 on
    # probabilities: each Z_i reduces V = 151,936 float32 terms; pairwise summation over ~17 levels with eps 6e-8
    # bounds the relative error near 1e-6, and ratio/log/exp add a few eps (measured: ~1e-8).
    for rule in SAMPLED_RULES:
        survival = acceptance_survival(draft_tokens, draft, target, rule)
        reference = acceptance_survival(draft_tokens, draft.double(), target.double(), rule, validate=False)
        assert survival.dtype == torch.float32 and bool(survival.isfinite().all())
        error = float((survival.double() - reference).abs().max())
        assert error < 1e-5, f"{rule}: float32 survival off by {error:.2g}"
        finals = final_distributions(draft_tokens, draft, target, rule)
        reference = final_distributions(draft_tokens, draft.double(), target.double(), rule, validate=False)
        error = float((finals.double() - reference).abs().sum(-1).max())  # total variation x 2
        assert error < 1e-5, f"{rule}: float32 final distributions off by {error:.2g} (L1)"


@pytest.mark.parametrize(
    "dtype,tiny",
    [
        (torch.float64, 1e-30),
        (torch.float64, 1e-300),
        (torch.float32, 1e-30),
        (torch.float32, 1e-38),
        (torch.float32, 1e-45),
    ],
)
def test_near_zero_probabilities(dtype, tiny):
    # Rows (V = 4, K = 3) where the drafted token has probability ``tiny`` under the draft (ratio ~1/tiny, which
    # overflows float32 for subnormals), under the target (w collapses to ~tiny), or under both (ratio 1).
    vocab, width = 4, 3
    rest = (1.0 - tiny) / (vocab - 1)
    tiny_row = [tiny, rest, rest, rest]
    fair = [0.25] * vocab
    patterns = {  # position -> (draft row, target row) for x_i = 0
        "draft_tiny": (tiny_row, fair),
        "target_tiny": (fair, tiny_row),
        "both_tiny": (tiny_row, tiny_row),
    }
    names = list(patterns)
    rows_d, rows_t = [], []
    for first in names:  # every combination over the first two positions; the third is fair
        for second in names:
            rows_d.append([patterns[first][0], patterns[second][0], fair])
            rows_t.append([patterns[first][1], patterns[second][1], fair, fair])
    draft = torch.tensor(rows_d, dtype=dtype)
    target = torch.tensor(rows_t, dtype=dtype)
    assert bool((draft[:, :2, 0] > 0).all()), "tiny must be representable (subnormal at worst)"
    batch = len(rows_d)
    draft_tokens = torch.zeros(batch, width, dtype=torch.long)
    for rule in ("token", "block"):  # the checks below are these two rules' own
        survival = acceptance_survival(draft_tokens, draft, target, rule)
        assert bool(survival.isfinite().all()) and bool(((survival >= 0) & (survival <= 1)).all()), survival
        assert bool((survival[:, 1:] <= survival[:, :-1]).all()), "P(tau >= i) must not increase with i"
        finals = final_distributions(draft_tokens, draft, target, rule)
        assert bool(finals.isfinite().all()) and bool(((finals.sum(-1) - 1).abs() < 1e-5).all())
        # Rows 0-2 have a draft-tiny first token: ratio_1 >= 1, accepted surely by both rules (a_1 = w_1 = 1).
        assert survival[:3, 1].tolist() == [1.0] * 3, survival
        # Rows 3-5, target-tiny: token accepts x_1 with a_1 = 4 tiny. Block's P(tau >= 1 | block) may be 1 (row 3:
        # x_2 is draft-tiny, the JOINT ratio of (x_1, x_2) is 1), but marginally it is w_1 = 4 tiny.
        if rule == "token":
            assert bool((survival[3:6, 1] < 1e-20).all()), survival
        else:
            _, log_w = block_acceptance(draft_tokens, draft, target, torch.full((batch,), width))
            assert bool((log_w[3:6, 1].exp() < 1e-20).all()) and bool(log_w.isnan().logical_not().all())
        for seed in range(3):
            out = RULES[rule].verify(draft_tokens, draft, target, generator=torch.Generator().manual_seed(seed))
            check_format(out, draft_tokens, vocab)


@pytest.mark.parametrize("vocab", [7, 151_936])
@pytest.mark.parametrize("dtype", DTYPES)
def test_uniform_rows_draft_equals_target_accepts_everything(sampled_rule, dtype, vocab):
    # All entries equal and draft = target: ratio exactly 1, w_i = 1, Z_i = 0 and a zero denominator (the guard).
    batch, width = 3, 4
    dtype = DTYPES[dtype]
    target = torch.full((batch, width + 1, vocab), 1.0 / vocab, dtype=dtype)
    draft = target[:, :width].clone()
    draft_tokens = torch.randint(0, vocab, (batch, width), generator=torch.Generator().manual_seed(0))
    survival = acceptance_survival(draft_tokens, draft, target, sampled_rule)
    assert bool((survival == 1).all()), survival
    for seed in range(3):
        out = RULES[sampled_rule].verify(draft_tokens, draft, target, generator=torch.Generator().manual_seed(seed))
        check_format(out, draft_tokens, vocab)
        assert bool((out.num_accepted == width).all())


def test_exact_ties_in_ratios():
    # Exact ties: the drafted token's ratio is exactly 1 at some positions (draft row == target row, so the
    # block denominator Z_i + 1 - w_i is exactly 0 there) and w_i returns exactly to the cap 1 after a ratio of
    # 1/2 followed by 2. Checked against the hand values, with no NaN.
    f64 = torch.float64
    half = [0.5, 0.25, 0.25]
    double = [0.25, 0.5, 0.25]
    draft = torch.tensor([[half, half, half]], dtype=f64)  # x = (1, 1, 1)
    # ratio_1 = 1 (equal rows), ratio_2 = .125 / .25 = 1/2 -> w_2 = 1/2, ratio_3 = .5 / .25 = 2 -> w_3 = 1.
    target = torch.tensor([[half, [0.75, 0.125, 0.125], double, half]], dtype=f64)
    draft_tokens = torch.tensor([[1, 1, 1]])
    h, log_w = block_acceptance(draft_tokens, draft, target, torch.tensor([3]))
    assert bool(h.isfinite().all())
    torch.testing.assert_close(log_w.exp(), torch.tensor([[1, 1, 0.5, 1]], dtype=f64), atol=1e-15, rtol=0)
    # h_1: w_1 = 1 but the rows at position 1 differ: Z_1 = .25 + 0 + 0 (hand) -> h_1 = 1. h_2: Z_2 =
    # max(.5 * .25 - .5, 0) + max(.5 * .5 - .25, 0) + max(.125 - .25, 0) = 0 -> h_2 = 0. h_3 = w_3 = 1.
    torch.testing.assert_close(h, torch.tensor([[1, 0, 1]], dtype=f64), atol=1e-15, rtol=0)
    equal = torch.tensor([[half, half, half]], dtype=f64)
    target_equal = torch.tensor([[half, half, half, double]], dtype=f64)
    h, _ = block_acceptance(draft_tokens, equal, target_equal, torch.tensor([3]))
    assert h.tolist() == [[1.0, 1.0, 1.0]], "Z_i + 1 - w_i = 0: the guard must give h_i = 1, not NaN"
    for rule in SAMPLED_RULES:
        assert acceptance_survival(draft_tokens, equal, target_equal, rule).tolist() == [[1.0] * 4]


def test_block_h_stays_in_unit_interval_regression_rounding_of_z_plus_one():
    """Regression: h_i = Z_i / (Z_i + 1 - w_i) was evaluated as (Z_i + 1) - w_i, which rounds Z_i's low bits away;
    with w_i = 1 it gave h_i above 1 on ~5 % of random rows (by up to 2.4e-7 in float32, 6.7e-16 in float64), and
    acceptance_survival above 1. Computing Z_i + (1 - w_i) keeps h_i in [0, 1] and makes it exactly 1 at w_i = 1."""
    batch, width, vocab = 4096, 4, 8
    for dtype in DTYPES.values():
        draft_tokens, draft, target = random_inputs(batch, width, vocab, seed=0, dtype=dtype)
        h, log_w = block_acceptance(draft_tokens, draft, target, torch.full((batch,), width))
        assert bool(((h >= 0) & (h <= 1)).all()), f"{dtype}: h - 1 up to {float(h.max() - 1):.2g}"
        capped = log_w[:, 1:width] == 0  # w_i = 1 exactly at i < K (Z_i > 0 for these random rows)
        assert bool(capped.any()) and bool((h[:, : width - 1][capped] == 1).all())
        for rule in SAMPLED_RULES:
            survival = acceptance_survival(draft_tokens, draft, target, rule)
            assert bool(((survival >= 0) & (survival <= 1)).all()), (rule, dtype, float(survival.max()))


# --- K = 0 -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("one_hot_draft", [False, True], ids=["draft_probs", "draft_probs_None"])
def test_k0_is_a_plain_target_step(rule, one_hot_draft):
    batch, vocab = 20_000, 4
    gen = torch.Generator().manual_seed(0)
    row = torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64)
    target = row.expand(batch, 1, vocab)
    draft = None if one_hot_draft else torch.empty(batch, 0, vocab, dtype=torch.float64)
    draft_tokens = torch.empty(batch, 0, dtype=torch.long)
    randomness = draw(batch, 0, vocab, seed=1)
    out = RULES[rule].verify(draft_tokens, draft, target, randomness=randomness)
    check_format(out, draft_tokens, vocab)
    assert bool((out.num_accepted == 0).all())
    if not RULES[rule].sampled:
        assert bool((out.tokens[:, 0] == 2).all())
        return
    # The explicit exponential race on target_probs[0], and with a generator the target's law (chi-square).
    assert torch.equal(out.tokens[:, 0], (target[:, 0] / randomness.exponentials).argmax(-1))
    out = RULES[rule].verify(draft_tokens, draft, target, generator=gen)
    counts = torch.bincount(out.tokens[:, 0], minlength=vocab).double()
    result = lawkit.chi_square(counts, row)
    assert result.passed, result
