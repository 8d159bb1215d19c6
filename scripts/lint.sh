#!/usr/bin/env bash
# Lint, format and type checks (ruff and pyright, pinned in the `dev` extra): what the pre-commit hooks run, and
# what scripts/test.sh runs before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check .
ruff format --check .
pyright
