"""Exact-law toolkit for the tests: tiny context-dependent models and the laws they induce.

A ``Tables`` object is a toy language model pair over a vocabulary of V tokens: for every context (a tuple of
tokens, of length 0..depth) the target's and the draft's next-token distributions, stored densely so whole
batches of contexts are looked up at once. With it:

- ``target_law``        the target's exact joint law over L tokens, [V] * L float64;
- ``speculative_law``   the exact joint law of one speculative step (enumerating every drafted block, and
                        integrating over the verifier's randomness through its closed forms), extended by
                        exact target sampling to K + 1 tokens; lossless means it equals ``target_law``;
- ``sample_emissions``  Monte-Carlo of a real batched verifier on the same tables, extended the same way;
- ``chi_square``        the joint-outcome test against an exact law, with a threshold from the sample size;
- ``sparse_cell_groups`` / ``pool_cells``  pooling of outcomes expected fewer than 5 times, before ``chi_square``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

# step(draft_tokens [N, K], draft_probs [N, K, V] or None (one-hot draft), target_probs [N, K+1, V])
#   -> (tau_law [N, K+1], final [N, K+1, V]): P(tau = i | block) and the law of the token emitted after tau = i.
StepLaw = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Tables:
    vocab: int
    target: list[torch.Tensor]  # target[L]: [V**L, V] float64, the target's law after each length-L context
    draft: list[torch.Tensor]  # draft[L]: likewise for the draft

    def target_at(self, context: torch.Tensor) -> torch.Tensor:  # context [N, L] int64 -> [N, V]
        return self.target[context.shape[1]][self._index(context)]

    def draft_at(self, context: torch.Tensor) -> torch.Tensor:
        return self.draft[context.shape[1]][self._index(context)]

    def _index(self, context: torch.Tensor) -> torch.Tensor:
        # Mixed radix: the context (x_1, .., x_L) is row sum_j x_j * V**(L-1-j) of the length-L table.
        weights = self.vocab ** torch.arange(context.shape[1] - 1, -1, -1)
        return (context * weights).sum(-1)

    def draw_blocks(self, samples: int, width: int, generator: torch.Generator) -> torch.Tensor:
        """[samples, width] int64: independent blocks drafted token by token from the draft table."""
        blocks = torch.zeros(samples, 0, dtype=torch.long)
        for _ in range(width):
            blocks = torch.cat([blocks, torch.multinomial(self.draft_at(blocks), 1, generator=generator)], dim=1)
        return blocks

    def block_inputs(self, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft_probs [N, K, V], target_probs [N, K+1, V]) along each drafted block [N, K]."""
        width = draft_tokens.shape[1]
        draft_probs = (
            torch.stack([self.draft_at(draft_tokens[:, :i]) for i in range(width)], dim=1)
            if width
            else torch.empty(len(draft_tokens), 0, self.vocab, dtype=self.draft[0].dtype)
        )
        target_probs = torch.stack([self.target_at(draft_tokens[:, :i]) for i in range(width + 1)], dim=1)
        return draft_probs, target_probs


def random_tables(vocab: int, depth: int, seed: int, *, peaked: float = 1.0, zeros: bool = True) -> Tables:
    """Random context-dependent target and draft over ``vocab`` tokens, for contexts of length 0..depth.

    Rows are softmax(peaked * N(0, 1) * 2); with ``zeros`` some entries are set exactly to 0 (at most V - 1
    per row), so tokens the target never emits and drafted tokens the target rejects outright are exercised.
    """
    gen = torch.Generator().manual_seed(seed)

    def table(rows: int) -> torch.Tensor:
        probs = (2.0 * peaked * torch.randn(rows, vocab, generator=gen, dtype=torch.float64)).softmax(-1)
        if zeros and vocab > 2:
            kill = torch.rand(rows, vocab, generator=gen) < 0.2
            kill[torch.arange(rows), probs.argmax(-1)] = False  # keep at least one entry alive
            probs = probs.masked_fill(kill, 0.0)
        return probs / probs.sum(-1, keepdim=True)

    return Tables(vocab, [table(vocab**L) for L in range(depth + 1)], [table(vocab**L) for L in range(depth + 1)])


def all_blocks(vocab: int, width: int) -> torch.Tensor:
    """Every drafted block, [V**K, K] int64, in lexicographic order."""
    return torch.tensor(list(itertools.product(range(vocab), repeat=width)), dtype=torch.long).reshape(
        vocab**width, width
    )


def target_law(tables: Tables, length: int) -> torch.Tensor:
    """The target's exact joint law over ``length`` tokens, shape [V] * length."""
    law = torch.ones((), dtype=torch.float64)
    for i in range(length):
        prefixes = all_blocks(tables.vocab, i)  # [V**i, i], same order as law.flatten()
        law = law.reshape(-1, 1) * tables.target_at(prefixes)  # [V**i, V]
    return law.reshape([tables.vocab] * length)


def speculative_law(tables: Tables, width: int, step: StepLaw) -> torch.Tensor:
    """Exact joint law over K + 1 tokens of one speculative step followed by exact target sampling.

    Every drafted block x is enumerated with probability prod_i draft(x_i | x_<i); ``step`` gives the law of
    tau and of the emitted token y; the emitted prefix (x_1..x_tau, y) is then completed from the target.
    """
    vocab, length = tables.vocab, width + 1
    blocks = all_blocks(vocab, width)  # [N, K]
    draft_probs, _ = tables.block_inputs(blocks)
    block_prob = draft_probs.gather(-1, blocks.unsqueeze(-1)).squeeze(-1).prod(-1)  # [N]
    # Blocks the draft never proposes carry no mass (and a verifier rightly refuses them).
    blocks, block_prob = blocks[block_prob > 0], block_prob[block_prob > 0]
    draft_probs, target_probs = tables.block_inputs(blocks)
    tau_law, final = step(blocks, draft_probs, target_probs)
    assert torch.allclose(tau_law.sum(-1), torch.ones(len(blocks), dtype=torch.float64), atol=1e-12, rtol=0)

    emitted: dict[tuple[int, ...], float] = {}  # prefix (x_1..x_tau, y) -> probability
    for b, block in enumerate(blocks.tolist()):
        for tau in range(width + 1):
            mass = float(block_prob[b] * tau_law[b, tau])
            if mass == 0.0:
                continue
            for y in range(vocab):
                prefix = tuple(block[:tau]) + (y,)
                emitted[prefix] = emitted.get(prefix, 0.0) + mass * float(final[b, tau, y])

    law = torch.zeros([vocab] * length, dtype=torch.float64)
    for prefix, mass in emitted.items():
        # Complete the prefix with the target's own conditionals: law[prefix + rest] += mass * P_target(rest | prefix).
        completion = torch.ones((), dtype=torch.float64)
        for j in range(len(prefix), length):
            rests = all_blocks(vocab, j - len(prefix))
            contexts = torch.cat([torch.tensor(prefix).expand(len(rests), -1), rests], dim=1)
            completion = completion.reshape(-1, 1) * tables.target_at(contexts)
        law[prefix] += mass * completion.reshape([vocab] * (length - len(prefix)))
    return law


def sample_emissions(
    tables: Tables,
    width: int,
    samples: int,
    verifier: Callable,
    generator: torch.Generator,
    *,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Counts [V] * (K+1) of K + 1 tokens from a real batched verifier (one step), completed by the target.

    Each of the ``samples`` rows drafts its own block from the draft table, is verified in one batched call
    ``verifier(draft_tokens, draft_probs, target_probs, generator=generator)``, and is then completed with
    exact target samples.
    """
    vocab, length = tables.vocab, width + 1
    draft_tokens = tables.draw_blocks(samples, width, generator)
    draft_probs, target_probs = tables.block_inputs(draft_tokens)
    out = verifier(draft_tokens, draft_probs.to(dtype), target_probs.to(dtype), generator=generator)
    sequences = out.tokens.clone()  # [N, K+1]: filled up to index tau, -1 after
    for j in range(length):
        missing = j > out.num_accepted
        if bool(missing.any()):
            context = sequences[missing, :j]
            sequences[missing, j] = torch.multinomial(tables.target_at(context), 1, generator=generator).squeeze(1)
    return joint_counts(sequences, vocab)


def joint_counts(sequences, vocab: int) -> torch.Tensor:
    """How often each sequence occurs among ``sequences`` (a [N, L] tensor or N lists of L token ids), as a
    [V] * L table of counts (float64) to compare with an exact joint law."""
    sequences = torch.as_tensor(sequences, dtype=torch.long)  # [N, L]
    length = sequences.shape[1]
    index = (sequences * vocab ** torch.arange(length - 1, -1, -1)).sum(-1)  # [N]: the sequence in base V
    return torch.bincount(index, minlength=vocab**length).reshape([vocab] * length).to(torch.float64)


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    threshold: float
    dof: int
    impossible: int  # samples that fell on outcomes of exact probability 0

    @property
    def passed(self) -> bool:
        return self.impossible == 0 and self.statistic <= self.threshold


def chi_square(counts: torch.Tensor, law: torch.Tensor, alpha: float = 1e-4) -> ChiSquare:
    """Pearson's test of the joint counts against the exact law (a false alarm has probability ``alpha``)."""
    from scipy.stats import chi2

    counts, law = counts.flatten(), law.flatten()
    total = float(counts.sum())
    possible = law > 0
    expected = total * law[possible]
    statistic = float(((counts[possible] - expected) ** 2 / expected).sum())
    dof = int(possible.sum()) - 1
    return ChiSquare(statistic, float(chi2.ppf(1 - alpha, dof)), dof, int(counts[~possible].sum()))


def sparse_cell_groups(law: torch.Tensor, samples: int, min_expected: float = 5.0) -> torch.Tensor:
    """Pooling for a chi-square on a peaked law: the pooled cell of each outcome of ``law``, [law.numel()] int64.

    Every possible outcome whose expected count ``samples * law`` reaches ``min_expected`` keeps a cell of its own;
    the others share ONE pooled cell (if its expected count is still below ``min_expected``, the least likely kept
    outcomes join it until it is not); outcomes of exact probability 0 share the last cell, whose pooled law stays
    exactly 0, so ``chi_square`` still counts every sample there as impossible. Apply with ``pool_cells`` to the
    counts, the exact law and any wrong law alike; the degrees of freedom are then those after pooling.
    """
    flat = law.flatten().to(torch.float64)
    expected = samples * flat
    possible = flat > 0
    own = possible & (expected >= min_expected)
    pooled_expected = float(expected[possible & ~own].sum())
    if 0 < pooled_expected < min_expected:
        for index in sorted(own.nonzero().flatten().tolist(), key=lambda i: float(flat[i])):
            if pooled_expected >= min_expected or int(own.sum()) <= 1:
                break
            own[index] = False
            pooled_expected += float(expected[index])
    groups = torch.empty(len(flat), dtype=torch.long)
    groups[own] = torch.arange(int(own.sum()))
    next_group = int(own.sum())
    if bool((possible & ~own).any()):
        groups[possible & ~own] = next_group
        next_group += 1
    groups[~possible] = next_group
    return groups


def pool_cells(values: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Sums of ``values`` (counts or a law, any shape with groups.numel() entries) per pooled cell, float64."""
    total = torch.zeros(int(groups.max()) + 1, dtype=torch.float64)
    return total.index_add_(0, groups, values.flatten().to(torch.float64))


def detection_power(law: torch.Tensor, wrong_law: torch.Tensor, samples: int, alpha: float = 1e-4) -> float:
    """Probability that ``chi_square`` at this sample size rejects samples drawn from ``wrong_law``.

    Pearson's statistic under the wrong law is approximately noncentral chi-square with
    lambda = N * sum (wrong - law)^2 / law (cells the exact law gives 0 make detection certain).
    """
    from scipy.stats import chi2, ncx2

    law, wrong_law = law.flatten(), wrong_law.flatten()
    possible = law > 0
    if bool((wrong_law[~possible] > 0).any()) and samples * float(wrong_law[~possible].sum()) > 20:
        return 1.0
    dof = int(possible.sum()) - 1
    noncentrality = samples * float(((wrong_law[possible] - law[possible]) ** 2 / law[possible]).sum())
    return float(ncx2.sf(chi2.ppf(1 - alpha, dof), dof, noncentrality))


@dataclass(frozen=True)
class PooledChiSquare:
    """The engine law tests' chi-square: ``samples`` draws, cells of ``law`` expected fewer than ``min_expected``
    times pooled (``sparse_cell_groups``), false-alarm probability ``alpha``."""

    samples: int
    alpha: float
    min_expected: float = 5.0

    def test(self, counts: torch.Tensor, law: torch.Tensor) -> ChiSquare:
        groups = sparse_cell_groups(law, self.samples, self.min_expected)
        return chi_square(pool_cells(counts, groups), pool_cells(law, groups), self.alpha)

    def power(self, law: torch.Tensor, wrong_law: torch.Tensor) -> float:
        """Power of the pooled statistic alone against samples from ``wrong_law`` (samples on impossible outcomes,
        which also fail the test, are not counted): noncentral chi-square over the possible pooled cells."""
        groups = sparse_cell_groups(law, self.samples, self.min_expected)
        pooled, pooled_wrong = pool_cells(law, groups), pool_cells(wrong_law, groups)
        possible = pooled > 0
        return detection_power(pooled[possible], pooled_wrong[possible], self.samples, self.alpha)

    def check_control(self, label: str, counts: torch.Tensor, law: torch.Tensor, wrong_law: torch.Tensor) -> None:
        """Asserts that a negative control's ``counts`` fail the test against the exact ``law`` and pass it against
        the control's own exact ``wrong_law``: the failure is the predicted one, so ``power(law, wrong_law)`` is the
        power against what the control actually does. Prints the figures (pytest -s)."""
        failed = self.test(counts, law)
        message = self.describe(f"NEGATIVE CONTROL {label}", failed)
        print(
            f"    power {self.power(law, wrong_law):.6f}, max joint-law error {max_abs_error(law, wrong_law):.3g}, "
            f"statistic / threshold {failed.statistic / failed.threshold:.2f}"
        )
        assert failed.statistic > failed.threshold, "the wrong engine PASSED the test that should catch it: " + message
        own = self.test(counts, wrong_law)
        assert own.passed, self.describe(f"{label}: the control against its own exact law", own)

    def describe(self, label: str, test: ChiSquare) -> str:
        """One line on ``test``, printed (pytest -s) and returned for an assertion's message."""
        line = (
            f"{label}: chi2 = {test.statistic:.1f}, threshold {test.threshold:.1f} (dof {test.dof} after pooling, "
            f"alpha {self.alpha:g}, N {self.samples}), {test.impossible} samples on zero-probability outcomes"
        )
        print(line)
        return line


def logit_tables(model, prompt: list[int], vocab: int, length: int) -> list[torch.Tensor]:
    """tables[L]: a transformers model's last logits [V**L, V] float32 (on the CPU) after ``prompt`` + each of the V**L
    continuations of length L (mixed radix order, as ``all_blocks``), for L = 0..length-1: every context the first
    ``length`` tokens see. The model runs on its own device: on CUDA the tables are CUDA's arithmetic, as the
    engine's are."""
    tables = []
    with torch.no_grad():
        for width in range(length):
            continuations = all_blocks(vocab, width)
            contexts = torch.cat([torch.tensor(prompt).expand(len(continuations), -1), continuations], dim=1)
            tables.append(model(contexts.to(model.device)).logits[:, -1].float().cpu())
    return tables


def processed(logits: list[torch.Tensor], params) -> list[torch.Tensor]:
    """The processed distributions the engine samples from (float32 by ``sampling.process``, under ``params``), as
    float64 rows summing to 1."""
    from blockspec.sampling import process

    out = []
    for table in logits:
        probs = process(table, params).double()
        out.append(probs / probs.sum(-1, keepdim=True))
    return out


def max_abs_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def first_tokens_counts(decoder, prompt: list[int], vocab: int, length: int, samples: int, **generate) -> torch.Tensor:
    """How often ``decoder`` generated each sequence of ``length`` first tokens after ``prompt`` over ``samples``
    rows (row b seeded b), as a [V] * length table of counts (float64) to compare with the exact law."""
    result = decoder.generate([prompt] * samples, max_new_tokens=length, seed=0, stop_on_eos=False, **generate)
    return joint_counts(result.sequences, vocab)
