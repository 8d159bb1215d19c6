#!/usr/bin/env bash
# Install everything the tests need on a fresh machine (the package with its test extra, the bundled model
# presets the slow tests load, and the benchmark prompt sets), then run the whole suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -e ".[test]"
bash scripts/install_models.sh --no-hf
bash scripts/install_data.sh
python -m pytest "$@"
