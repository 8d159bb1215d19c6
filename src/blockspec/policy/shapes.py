"""Tree or chain: the speed a draft shape is predicted to reach, from acceptance and measured forward costs, and
``AdaptiveShape``, which drafts each step the shape predicted fastest.

Glossary: a shape (k_1, .., k_d) gives every node at depth i - 1 up to k_i children (a chain is (1, .., 1), the empty
shape a plain target step); N = its nodes. alpha_k (k = 1..WIDTHS) is the probability that token-level tree
verification (recursive rejection sampling) accepts one of k candidates drawn from the draft's law Q without
replacement, where the target's law is P: alpha_1 = sum_v min(P, Q).

Prediction. A step drafting (k_1, .., k_d) accepts E = sum_j prod_{i <= j} alpha_{k_i} tokens in expectation, each
level's acceptance taken as its own position's alpha (``expected_accepted``); it costs the target's forward over the
N + 1 tokens it scores and one draft forward per level over that level's parents (``step_cost``), so it emits
(1 + E) / cost tokens per second. These are the token rule's figures; block and Traversal Verification accept at
least as many in expectation, chains and trees alike. benchmarks/tree_plan.py makes the same prediction offline from
alpha measured per position, and its predictions matched the engine's measured speed within about 9 %
(docs/results.md, "Trees drafted by the engine").
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence

import torch

from ..defaults import ADAPTIVE_MAX_DRAFT, CATCH_UP_HORIZON
from ..sampling import is_int

WIDTHS = 4  # alpha_k is estimated for k = 1..WIDTHS candidates per node, the widest a candidate shape branches
# Positions x draws x support per batch of exact evaluations in ``candidate_acceptance`` (memory: under 100 x this
# in bytes)
ELEMENTS = 1 << 22
# AdaptiveShape's starting alpha_1..alpha_4: the bundled pair measures about 0.91, 0.97, 0.98, 0.99 at temperature 1
# (benchmarks/results/measurements/tree-plan-epyc.json); alpha_1 starts at AdaptiveLength's prior, 0.85, the others
# about 0.11 below the measurement, so that the first steps do not overrate what a wider node adds
PRIOR = (0.85, 0.86, 0.87, 0.88)
# The most tokens AdaptiveShape's estimate evaluates candidates on at a position (the rest lumped into one): a top-k
# rather than a sort of the whole vocabulary, each step
SUPPORT = 4096
Cost = Callable[[int], float]  # tokens per row in one forward -> its cost (seconds, or any one unit for both models)


def level_sizes(shape: Sequence[int]) -> list[int]:
    """The nodes at depth 1..d of a full tree of ``shape``: (2, 1, 1) -> [2, 2, 2]. Counted, not built."""
    return list(itertools.accumulate(shape, operator.mul))


def tree_nodes(shape: Sequence[int]) -> int:
    """The drafted nodes of a full tree of ``shape`` (the root not counted): (2, 1, 1) -> 2 + 2 + 2 = 6. Counted,
    not built, so that a huge shape costs nothing to refuse."""
    return sum(level_sizes(shape))


def tree_shapes(max_depth: int, max_nodes: int) -> list[tuple[int, ...]]:
    """Every shape of depth 1..max_depth with at most WIDTHS children per node, widths not growing with depth
    (the wide levels are the likely ones), and at most max_nodes nodes; chains included. Shallow first, then by
    nodes, then by widths: (1,), (2,), (3,), (4,), (1, 1), (2, 1), ..."""
    found = []

    def grow(shape: tuple[int, ...]) -> None:
        for k in range(1, (shape[-1] if shape else WIDTHS) + 1):
            longer = shape + (k,)
            if tree_nodes(longer) <= max_nodes:
                found.append(longer)
                if len(longer) < max_depth:
                    grow(longer)

    grow(())
    return sorted(found, key=lambda s: (len(s), tree_nodes(s), s))


def expected_accepted(alpha: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """E [...]: the expected accepted tokens of a step drafting ``shape``, sum_j prod_{i <= j} alpha[..., i, k_i - 1],
    from alpha [..., d, WIDTHS]: row i holds alpha_1..alpha_WIDTHS at the step's position i + 1 (the same row d times
    where alpha does not depend on the position). The empty shape accepts nothing."""
    if not shape:
        return alpha.new_zeros(alpha.shape[:-2])
    depth = torch.arange(len(shape), device=alpha.device)
    width = torch.tensor(shape, device=alpha.device) - 1
    return alpha[..., depth, width].cumprod(-1).sum(-1)


def accepted_whole(alpha: torch.Tensor, shape: Sequence[int]) -> float:
    """The chance that a step drafting ``shape`` accepts a path down to its deepest level, prod_i alpha[i, k_i - 1]
    (alpha [d, WIDTHS] as in ``expected_accepted``): then the next step's draft first reads 2 tokens, the last
    accepted node and the bonus token, else 1. The empty shape: 0."""
    if not shape:
        return 0.0
    return float(alpha[torch.arange(len(shape)), torch.tensor(shape) - 1].prod())


def step_cost(shape: Sequence[int], target: Cost, draft: Cost, catch_up: int = 1) -> float:
    """A step's forward costs: the target's over the pending token and the N nodes, and one draft forward per level
    drafted, the first reading the ``catch_up`` tokens the draft has not read, each later one the parents of the level
    below (the deepest level is never read). The empty shape: the target's forward over one token."""
    sizes = level_sizes(shape)
    if not sizes:
        return target(1)
    return target(sum(sizes) + 1) + draft(catch_up) + sum(draft(n) for n in sizes[:-1])


def best_shape(
    alpha: torch.Tensor,  # [WIDTHS] float: alpha_1..alpha_WIDTHS, the same at every position
    shapes: Sequence[tuple[int, ...]],
    target: Cost,
    draft: Cost,
    behind: float = 0.0,
) -> tuple[int, ...]:
    """The shape of ``shapes`` predicted to emit the most tokens per unit of cost when drafted step after step:
    (1 + E) over ``step_cost`` at the catch-up that drafting meets (2 tokens after a step that accepted a whole path,
    chance ``accepted_whole``, else 1) plus ``behind`` for a shape that drafts (its share of a longer catch-up), as
    ``AdaptiveLength.goodputs`` prices a chain. A tree is chosen only where it beats every chain (and the empty
    shape, if offered) outright: on a tie the chain stays."""
    alpha = alpha.double().expand(max(map(len, shapes), default=0), -1)

    def goodput(shape: tuple[int, ...]) -> float:
        whole = accepted_whole(alpha[: len(shape)], shape)
        cost = whole * step_cost(shape, target, draft, 2) + (1 - whole) * step_cost(shape, target, draft, 1)
        return (1 + float(expected_accepted(alpha[: len(shape)], shape))) / (cost + (behind if shape else 0.0))

    rate = {shape: goodput(shape) for shape in shapes}
    chains = [s for s in shapes if all(k == 1 for k in s)]
    trees = [s for s in shapes if any(k > 1 for k in s)]
    best = max(chains or trees, key=rate.__getitem__)
    tree = max(trees, key=rate.__getitem__, default=best)
    return tree if rate[tree] > rate[best] else best


# --- alpha_k from the laws at a position ------------------------------------------------------------------------


def candidate_acceptance(
    target_probs: torch.Tensor,  # [L, V]: the target's law P at each of L positions
    draft_probs: torch.Tensor,  # [L, V]: the draft's law Q there
    *,
    draws: int,
    rest: float,
    generator: torch.Generator,
    support: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(alpha [L, WIDTHS], left [L, 2]) float64: alpha[t, k - 1] = alpha_k at position t; left = the mass of P and Q
    left out of the support the candidates were evaluated on.

    alpha_1 = sum_v min(P, Q), exactly. For k >= 2, ``draws`` candidate sets of WIDTHS tokens are drawn from Q without
    replacement (the first k of a set are k candidates without replacement), with ``generator`` alone, and alpha_k is
    the mean over the sets of the exact probability that token-level verification accepts one of the k, given them
    (``star_acceptance``): unbiased. Each position is cut to the fewest tokens most likely under P + Q that leave out
    less than ``rest`` of each, plus one token holding the rest, which bounds the error the cut makes; positions go in
    batches of at most ELEMENTS draws x support. ``support``: at most so many tokens (the
    most likely under P + Q, found without sorting the whole vocabulary: what an online estimate can afford each
    step), the rest lumped as above; None: as many as ``rest`` needs."""
    # alpha_1 on the whole vocabulary, summed in float64 (the laws' own dtype is kept: converting the whole of them
    # would cost more than the rest of the estimate)
    closed_form = torch.minimum(target_probs, draft_probs).sum(-1, dtype=torch.float64).cpu()
    both = target_probs + draft_probs
    if support is not None and support < both.shape[-1]:
        order = both.topk(support, dim=-1).indices  # most likely first, as the sort below
    else:
        order = both.argsort(dim=-1, descending=True)
    p, q = target_probs.gather(-1, order).double(), draft_probs.gather(-1, order).double()
    # the support of position t: the fewest most likely tokens leaving out less than `rest` of P_t and of Q_t
    needed = (((p.cumsum(-1) < 1 - rest) | (q.cumsum(-1) < 1 - rest)).sum(-1) + 1).clamp(max=p.shape[-1])  # [L]
    alpha, left = torch.empty(len(p), WIDTHS, dtype=torch.float64), torch.empty(len(p), 2, dtype=torch.float64)
    start = 0
    while start < len(p):  # positions in chunks of at most ELEMENTS draws x support
        size = int(needed[start])
        end = start + 1
        while end < len(p) and (end + 1 - start) * draws * max(size, int(needed[end])) <= ELEMENTS:
            size, end = max(size, int(needed[end])), end + 1
        alpha[start:end], left[start:end] = _star(p[start:end, :size], q[start:end, :size], draws, generator)
        start = end
    alpha[:, 0] = closed_form  # k = 1 in closed form
    return alpha, left


def ranked_acceptance(target_scores: torch.Tensor, draft_scores: torch.Tensor) -> torch.Tensor:
    """alpha [L, WIDTHS] float64 at temperature 0, from any scores [L, V] that rank the tokens as the models' laws do
    (logits, or their softmax): the candidates are the draft's WIDTHS best tokens in order, and alpha_k is 1 where
    the target's best token is among the first k, else 0."""
    best = target_scores.argmax(-1, keepdim=True)  # [L, 1]
    hits = draft_scores.topk(WIDTHS, dim=-1).indices == best  # [L, WIDTHS]
    return hits.cumsum(-1).clamp(max=1).double().cpu()


def _star(p: torch.Tensor, q: torch.Tensor, draws: int, generator: torch.Generator):
    """alpha [L, WIDTHS] and the mass left out [L, 2] of distributions [L, M] cut to their support, the rest lumped
    into one more token."""
    left = torch.stack([1 - p.sum(-1), 1 - q.sum(-1)], -1).clamp(min=0)
    p, q = torch.cat([p, left[:, :1]], -1), torch.cat([q, left[:, 1:]], -1)
    p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    positions, size = p.shape
    # k candidates without replacement = the k largest of log Q + Gumbel noise (sequential sampling's law)
    uniforms = torch.rand(positions, draws, size, generator=generator, dtype=torch.float64).clamp(min=1e-300)
    uniforms = uniforms.to(p.device)
    width = min(WIDTHS, size)  # a support of fewer tokens is drawn whole
    candidates = (q.log()[:, None] - (-uniforms.log()).log()).topk(width, dim=-1).indices  # [L, R, width]
    return star_acceptance(p, q, candidates).mean(1).cpu(), left.cpu()


def star_acceptance(
    target_probs: torch.Tensor,  # [L, M]: P at each of L positions
    draft_probs: torch.Tensor,  # [L, M]: Q there
    candidates: torch.Tensor,  # [L, R, J] int64: R sets of J <= WIDTHS distinct tokens, in the order drawn
) -> torch.Tensor:
    """[L, R, WIDTHS] float64: the exact probability that token-level verification of one node with children
    candidates[..., :k] (drawn from Q without replacement) accepts one of them, for k = 1..WIDTHS (k > J: as k = J).

    Recursive rejection sampling, the ``"distinct"`` scheme of ``blockspec.verify.tree``: child c_i is accepted with
    min(1, P_i(c_i) / Q_i(c_i)); on rejection P_{i+1} = normalize(max(P_i - Q_i, 0)) (P_i where that is 0) and
    Q_{i+1} = Q_i without c_i, renormalised. A candidate Q_i gives no mass (the support used up) is never accepted."""
    sets = candidates.shape[1]
    p = target_probs.double()[:, None].expand(-1, sets, -1).clone()  # [L, R, M]
    q = draft_probs.double()[:, None].expand(-1, sets, -1).clone()
    rejected = torch.ones(p.shape[:-1], dtype=torch.float64, device=p.device)  # [L, R]
    accepted = torch.zeros_like(rejected)
    alpha = torch.empty(*p.shape[:-1], WIDTHS, dtype=torch.float64, device=p.device)
    for k in range(WIDTHS):
        if k < candidates.shape[-1]:
            token = candidates[..., k : k + 1]
            mass = q.sum(-1, keepdim=True)  # Q_i, unnormalised: Q less the candidates before
            q_now = torch.where(mass > 0, q / mass, 0.0)
            drafted = q_now.gather(-1, token).squeeze(-1)
            chance = torch.where(drafted > 0, p.gather(-1, token).squeeze(-1) / drafted, 0.0).clamp(max=1.0)
            accepted += rejected * chance
            rejected *= 1 - chance
            residual = (p - q_now).clamp(min=0.0)
            total = residual.sum(-1, keepdim=True)
            p = torch.where(total > 0, residual / total, p)
            q.scatter_(-1, token, 0.0)
        alpha[..., k] = accepted
    return alpha


# --- the online choice ----------------------------------------------------------------------------------------


class AdaptiveShape:
    """Each step drafts the shape predicted to emit the most tokens per second (``best_shape``), among the shapes of at
    most ``max_draft`` nodes (``tree_shapes``: chains of 1..``max_draft`` tokens and trees) and the empty shape (a plain
    target step), from the forward costs measured on this machine (``latency``: a ``LatencyProfile``) and alpha_k
    learnt from the steps verified so far. Where no tree is predicted to beat the best chain, the step drafts that
    chain. ``SpeculativeDecoder(target, draft, tree=AdaptiveShape(latency))`` runs it (``blockspec generate --tree
    auto``, with the latency ``blockspec.auto.latency_probe`` measures).

    Lossless: a step's shape is chosen before it drafts, from earlier steps only (their verified positions and this
    policy's own ``torch.Generator``, which draws candidate sets for the estimate and never touches the decoder's
    randomness), and verifying any tree drawn as its shape says emits the target's law (docs/algorithms.md, tree
    verification). So the output law is exactly the target's whatever the shapes. The shape is chosen for the whole
    batch, so a row's tokens (never their law) depend on its neighbours, as under ``AdaptiveLength``.

    Learning: at each step the root of every row that drafted is a position of the committed text where both laws are
    known (the target's P, the draft's Q its first level was drawn from); ``candidate_acceptance`` (or
    ``ranked_acceptance`` at temperature 0) gives each its alpha_1..alpha_WIDTHS, and ``alpha`` follows their mean
    with weight 1 - ``memory`` per step, from ``prior``. A step that drafts nothing learns nothing, and there alpha
    drifts back towards the prior by 1 - ``memory``, as ``AdaptiveLength``'s acceptance does.
    """

    def __init__(
        self,
        latency,
        *,
        max_draft: int = ADAPTIVE_MAX_DRAFT,
        prior: Sequence[float] = PRIOR,
        memory: float = 0.9,
        horizon: float = CATCH_UP_HORIZON,
        draws: int = 4,
        rest: float = 1e-4,
        seed: int = 0,
    ):
        """``max_draft``: the most nodes a step drafts, the longest chain (the latency probe measures the target over
        up to ``ADAPTIVE_MAX_DRAFT`` + 1 tokens; costs beyond are extrapolated); ``prior``: alpha_1..alpha_WIDTHS at
        the start of each call; ``memory``: the weight alpha keeps at each step; ``horizon``: the steps over which
        drafting again pays back what the draft reads first beyond 2 tokens (``AdaptiveLength``'s); ``draws``:
        candidate sets per position for alpha_k, k >= 2, on a support leaving out less than ``rest``
        (``candidate_acceptance``); ``seed``: the estimator's generator's, at each ``reset``."""
        prior_alpha = torch.tensor(prior, dtype=torch.float64)
        if not (is_int(max_draft) and max_draft >= 1) or not 0 <= memory < 1 or not horizon >= 1 or draws < 1:
            raise ValueError(
                "need max_draft >= 1, 0 <= memory < 1, horizon >= 1 and draws >= 1; "
                f"got {max_draft}, {memory}, {horizon}, {draws}"
            )
        if prior_alpha.shape != (WIDTHS,) or not bool(((prior_alpha > 0) & (prior_alpha <= 1)).all()):
            raise ValueError(f"prior must hold alpha_1..alpha_{WIDTHS}, each in (0, 1]; got {prior}")
        self.latency, self.memory, self.draws, self.rest, self.seed = latency, memory, draws, rest, seed
        self.horizon = horizon
        self.prior = prior_alpha
        self.shapes = [()] + tree_shapes(int(max_draft), int(max_draft))
        self.generator = torch.Generator()
        self.reset()

    @property
    def max_nodes(self) -> int:
        """The most nodes any step drafts (the decoder draws randomness for as many each step)."""
        return max(map(tree_nodes, self.shapes))

    @property
    def max_depth(self) -> int:
        return max(map(len, self.shapes))

    def reset(self) -> None:
        """At the start of each ``generate`` call: alpha back to the prior, the estimator's generator to its seed."""
        self.alpha = self.prior.clone()
        self.generator.manual_seed(self.seed)

    def choose(self, batch: int, catch_up: int = 1) -> tuple[int, ...]:
        """The shape this step drafts, before it drafts: ``best_shape`` at this batch size, priced as drafting it step
        after step, with what the draft must read first beyond 2 tokens (``catch_up``) spread over ``horizon`` steps
        (``AdaptiveLength.draft_budget`` says why); a plain step drifts alpha towards the prior."""
        latency, behind = self.latency, self.latency.behind(batch, catch_up) / self.horizon
        shape = best_shape(
            self.alpha, self.shapes, lambda n: latency.target(batch, n), lambda n: latency.draft(batch, n), behind
        )
        if not shape:
            self.alpha = self.memory * self.alpha + (1 - self.memory) * self.prior
        return shape

    def observe(
        self,
        target_probs: torch.Tensor,  # [M, V]: the target's law at M verified positions
        draft_probs: torch.Tensor,  # [M, V]: the draft's there (at temperature 0 its softmax, which ranks the tokens)
        greedy: bool,
    ) -> None:
        """Learns alpha from the positions one step verified (none: nothing to learn)."""
        if len(target_probs) == 0:
            return
        if greedy:
            step = ranked_acceptance(target_probs, draft_probs)
        else:
            step, _ = candidate_acceptance(
                target_probs, draft_probs, draws=self.draws, rest=self.rest, generator=self.generator, support=SUPPORT
            )
        self.alpha = self.memory * self.alpha + (1 - self.memory) * step.mean(0)
