"""What a benchmark record names besides the machine (``blockspec.machine.facts``): the commit it ran at."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """The repository's short HEAD commit, wherever the benchmark is started from ('' outside a git checkout)."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
