#!/usr/bin/env bash
# Build llama.cpp's own programs, llama-bench and llama-speculative-simple, from the source vendored in the pinned
# llama-cpp-python and with the flags blockspec's build uses ($CMAKE_ARGS, as scripts/setup.sh takes it, else
# scripts/llamacpp_flags.sh): the benchmark's llama.cpp rows run them (`blockspec bench --preset llamacpp`).
# blockspec itself does not need them. About 10 minutes on 2 cores, once; prints the folder that holds them
# ($LLAMACPP_TOOLS, default in blockspec's cache).
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
out="${LLAMACPP_TOOLS:-${BLOCKSPEC_CACHE:-$HOME/.cache/blockspec}/llamacpp-tools-$version}"
if [ -x "$out/llama-bench" ] && [ -x "$out/llama-speculative-simple" ]; then
    echo "$out"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version" >&2
tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
# shellcheck disable=SC2046  # the flags are separate words
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF $(echo "${CMAKE_ARGS:-$(bash scripts/llamacpp_flags.sh)}" | sed 's/-DLLAVA_BUILD=OFF//') >&2
cmake --build "$work/build" --target llama-bench llama-speculative-simple -j"$(nproc)" >&2
mkdir -p "$out"
cp "$work/build/bin/llama-bench" "$work/build/bin/llama-speculative-simple" "$out/"
echo "$out"
