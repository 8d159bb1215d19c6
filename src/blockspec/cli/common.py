"""What several commands share: argparse value types, checked at parse time (before any model loads), and the
help strings that would otherwise be repeated. Stdlib only: torch loads inside the commands."""

from __future__ import annotations

import argparse

ALLOW_DOWNLOAD_HELP = "download hub ids missing from the local Hugging Face cache (default: never)"
BACKEND_HELP = (
    "who runs the models: llamacpp (llama.cpp's kernels on the GGUF as it is), hf (transformers on dequantized "
    "weights), or auto: llamacpp for presets and GGUF files on the CPU, else hf (default: %(default)s)"
)
DEVICE_HELP = "cpu, cuda, cuda:N or auto"
NO_CHAT_HELP = "send prompts raw instead of in the model's chat template"
TIME_BUDGET_HELP = "seconds; stop scheduling runs after this (run again to resume)"


def int_at_least(minimum: int, maximum: int | None = None):
    """An argparse type: an integer >= ``minimum`` (and <= ``maximum``, if given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be an integer <= {maximum}, got {value}")
        return value

    return parse


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (time budgets, precisions)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def rule_name(*, sampled: bool = False):
    """An argparse type: a rule of ``blockspec.verify.RULES`` (``SAMPLED_RULES`` with ``sampled``). The registry
    imports torch, so it is read only when the flag is given: ``--help`` stays instant."""

    def parse(text: str) -> str:
        from ..verify import RULES, SAMPLED_RULES

        known = SAMPLED_RULES if sampled else tuple(RULES)
        if text not in known:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(known)}, got {text!r}")
        return text

    return parse


def tree_shape(text: str) -> tuple[int, ...]:
    """An argparse type: a tree shape, children per node at each depth ("2,1,1"), by the library's rules
    (``blockspec.checks.parse_tree``, which imports torch: read only when the flag is given)."""
    from ..checks import parse_tree

    try:
        return parse_tree(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
