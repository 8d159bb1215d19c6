"""The plugin's environment switches, read where vLLM starts: a value the plugin cannot use, or a switch the rule
asked for would ignore, is refused with the switch's name, never guessed, and vLLM does not start.
What each switch does: docs/guide/vllm.md."""

from __future__ import annotations

import os

from ..verify import SAMPLED_RULES

SWITCH = "BLOCKSPEC_VLLM_RULE"  # block or token: the rule verifying sampled drafts; unset or off: patch nothing
CUT_SWITCH = "BLOCKSPEC_VLLM_MIN_DRAFT_PROB"  # verify drafts only while the draft's top probability is at least this
SV_SWITCH = "BLOCKSPEC_VLLM_SV"  # SV's calibration and latency profiles: SV decides what is drafted and verified
ANALYTIC_SWITCH = "BLOCKSPEC_VLLM_ANALYTIC"  # 1: also score every block step's drafts under both rules (slower)


def requested_rule() -> str | None:
    """The rule ``BLOCKSPEC_VLLM_RULE`` asks for, None when it asks for nothing."""
    rule = os.environ.get(SWITCH, "off").strip().lower()
    if rule in ("", "off"):
        return None
    if rule not in SAMPLED_RULES:
        raise ValueError(f"{SWITCH}={rule!r}: expected one of {', '.join(SAMPLED_RULES)} or off")
    return rule


def min_draft_prob() -> float | None:
    """The threshold ``BLOCKSPEC_VLLM_MIN_DRAFT_PROB`` asks for (in (0, 1]), None when unset."""
    value = os.environ.get(CUT_SWITCH, "").strip()
    if not value:
        return None
    try:
        threshold = float(value)
    except ValueError:
        threshold = float("nan")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"{CUT_SWITCH}={value!r}: expected a probability in (0, 1]")
    return threshold


def sv_profiles() -> tuple[str, str] | None:
    """The (calibration, latency) profile paths ``BLOCKSPEC_VLLM_SV`` names, None when unset."""
    value = os.environ.get(SV_SWITCH, "").strip()
    if not value:
        return None
    paths = value.split(os.pathsep)
    if len(paths) != 2 or not all(paths):
        raise ValueError(
            f"{SV_SWITCH}={value!r}: expected the calibration profile (blockspec sv calibrate) and the "
            f"latency profile (python -m blockspec.vllm.profile) joined by {os.pathsep!r}"
        )
    return paths[0], paths[1]


def analytic() -> bool:
    """Whether ``BLOCKSPEC_VLLM_ANALYTIC`` asks to score every block step's drafts under both rules: 1 (or true,
    yes, on) or, unset, 0 (false, no, off); any other value is refused."""
    value = os.environ.get(ANALYTIC_SWITCH, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{ANALYTIC_SWITCH}={value!r}: expected 1 (on) or 0 (off)")


def refuse_switches_unused(rule: str | None) -> None:
    """Refuse a switch that the requested ``rule`` would silently ignore: the threshold, SV and the analytic sums
    without any rule (the plugin then patches nothing), and the analytic sums with the token rule (they are
    taken on the block rule's steps)."""
    for name, reader in ((CUT_SWITCH, min_draft_prob), (SV_SWITCH, sv_profiles), (ANALYTIC_SWITCH, analytic)):
        if reader() and rule is None:
            raise ValueError(
                f"{name} is set but {SWITCH} is not, so the plugin does nothing: set {SWITCH}=block "
                f"(or token), or unset {name}"
            )
    if analytic() and rule != "block":
        raise ValueError(f"{ANALYTIC_SWITCH} scores the block rule's steps: set {SWITCH}=block, or unset it")
