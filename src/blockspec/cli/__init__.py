"""The ``blockspec`` command line: ``main`` (generate, bench, align, models, env) and ``sv`` (SV's profiles)."""

from .commands import build_parser, main

__all__ = ["build_parser", "main"]
