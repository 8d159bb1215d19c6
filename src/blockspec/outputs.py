"""What ``SpeculativeDecoder.generate`` returns: the sequences, why each ended, and one ``StepStats`` per step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepStats:
    """One step of the loop. Lists hold one entry per row active in that step (``rows`` = prompt indices)."""

    rows: list[int]
    verified: list[int]  # drafted tokens verified per row (0 = a plain target step)
    accepted: list[int]  # tau per row
    emitted: list[int]  # tokens kept per row (tau + 1, less anything cut by EOS, stop strings or the length cap)
    drafted: int = 0  # positions the draft model drafted (a length policy may verify fewer; lookup runs no forward)
    lookup: list[bool] | None = None  # per row: its draft was a prompt lookup proposal (None without lookup)


@dataclass
class GenerationResult:
    sequences: list[list[int]]  # new token ids per prompt
    texts: list[str] | None  # decoded sequences, when a tokenizer is known
    finish_reasons: list[str]  # "eos", "stop" or "length"
    stats: list[StepStats] = field(repr=False)
    wall_time: float = 0.0  # the whole call, prefill included
    prefill_s: float = 0.0  # the prompts' forwards through every model, before the first step

    @property
    def new_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def row_steps(self) -> int:
        return sum(len(s.rows) for s in self.stats)

    @property
    def block_efficiency(self) -> float:
        """Tokens per target forward per row: 1 + mean accepted per step (before any EOS/length cut)."""
        return 1.0 + sum(sum(s.accepted) for s in self.stats) / max(self.row_steps, 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens / verified drafted tokens."""
        verified = sum(sum(s.verified) for s in self.stats)
        return sum(sum(s.accepted) for s in self.stats) / verified if verified else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time else float("nan")

    @property
    def lookup_rate(self) -> float:
        """Fraction of row steps whose draft was a prompt lookup proposal (nan without lookup)."""
        flags = [f for s in self.stats if s.lookup is not None for f in s.lookup]
        return sum(flags) / len(flags) if flags else float("nan")
