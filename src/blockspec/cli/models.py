"""``blockspec models``: the bundled presets, installed or not, their cache state, what else the cache holds, and
optionally a full hash check."""

from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    models = sub.add_parser("models", help="list the bundled model presets, installed or not, and their cache state")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")
    models.add_argument(
        "--verify", action="store_true", help="hash every cached file in full and report any mismatch (slow)"
    )
    models.set_defaults(run=run)


def run(args) -> int:
    from ..models import cache, presets

    rows = cache.status_all()
    # one message per file that differs, naming it and the fix
    problems = {s.name: cache.verify(s.name, progress=sys.stderr.isatty()) for s in rows} if args.verify else {}
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": s.name,
                        "role": s.role,
                        "installed": s.installed,
                        "missing": list(s.missing),
                        "cache_state": s.cache_state,
                        "converted": list(s.converted),
                        "cache_dir": str(s.cache_dir),
                        **({"mismatches": problems[s.name]} if args.verify else {}),
                    }
                    for s in rows
                ],
                indent=1,
            )
        )
        return _verified(problems, rows)
    print(f"{'preset':<22} {'role':<7} {'installed':<10} {'cache':<10} cache directory")
    for s in rows:
        state = s.cache_state + (f" ({', '.join(s.converted)})" if s.converted else "")
        print(f"{s.name:<22} {s.role:<7} {'yes' if s.installed else 'no':<10} {state:<10} {s.cache_dir}")
    if not all(s.installed for s in rows):
        print(f"install the missing ones with: {presets.INSTALL_HINT}")
    for folder, files, size, what in cache.other_folders():
        print(f"also cached: {folder}/, {files} file(s), {cache.size_text(size)}: {what}")
    for problem in (p for found in problems.values() for p in found):
        print(f"mismatch: {problem}")
    return _verified(problems, rows)


def _verified(problems: dict[str, list[str]], rows) -> int:
    """0, or, when `models --verify` found cached files that differ, the usual one-line error (exit 2)."""
    count = sum(len(found) for found in problems.values())
    if count:
        raise ValueError(f"{count} cached file(s) differ from what was recorded: see the mismatch lines")
    if problems:
        cached = [s.name for s in rows if s.cache_state != "empty"]
        print(
            f"verified: the cached files of {', '.join(cached)} match their recorded sha256"
            if cached
            else "verified: nothing is cached yet",
            file=sys.stderr,
        )
    return 0
