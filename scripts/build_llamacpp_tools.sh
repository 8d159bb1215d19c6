#!/usr/bin/env bash
# Build llama.cpp's own programs, llama-bench, llama-completion and llama-speculative-simple, from the source vendored
# in the pinned llama-cpp-python and with the flags blockspec's build uses ($CMAKE_ARGS, as scripts/setup.sh takes it,
# else scripts/llamacpp_flags.sh): benchmarks/llamacpp_compare.py runs them beside blockspec. blockspec itself does
# not need them. About 7 minutes on 2 cores, once per version and flags; prints the folder that holds them
# ($LLAMACPP_TOOLS, default in blockspec's cache, named by the version and a digest of the flags) and the flags, in
# its file cmake-args, which llamacpp_compare.py checks against the llama.cpp blockspec runs.
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
args=$(echo "${CMAKE_ARGS:-$(bash scripts/llamacpp_flags.sh)}" | sed 's/-DLLAVA_BUILD=OFF//' | xargs)
digest=$(printf '%s' "$args" | sha256sum | cut -c1-8)
out="${LLAMACPP_TOOLS:-${BLOCKSPEC_CACHE:-$HOME/.cache/blockspec}/llamacpp-tools-$version-$digest}"
programs=(llama-bench llama-completion llama-speculative-simple)
built=1
for program in "${programs[@]}"; do [ -x "$out/$program" ] || built=0; done
if [ "$built" = 1 ] && [ "$(cat "$out/cmake-args" 2>/dev/null)" = "$args" ]; then
    echo "$out"
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version" >&2
tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
# shellcheck disable=SC2086  # the flags are separate words
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF $args >&2
cmake --build "$work/build" --target "${programs[@]}" -j"$(nproc)" >&2
mkdir -p "$out"
for program in "${programs[@]}"; do cp "$work/build/bin/$program" "$out/"; done
echo "$args" >"$out/cmake-args"
echo "$out"
