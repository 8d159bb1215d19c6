#!/usr/bin/env bash
# Print the CMake arguments that build llama.cpp (through llama-cpp-python) for this CPU.
#
# GGML_NATIVE stays off and each instruction set is switched on from /proc/cpuinfo instead, so a build never
# turns on AMX: GCC 12's `_tile_loadconfig` lets the compiler drop the tile-configuration stores before
# `ldtilecfg`, and llama.cpp's AMX matmul then faults. AVX2, FMA, F16C and BMI2 are on in every build
# (llama.cpp's default without GGML_NATIVE); AVX-512 and its extensions are added where the CPU has them.
# The multimodal library is not built: blockspec does not use it.
set -euo pipefail
flags=$(grep -o -w 'avx512f\|avx512_vbmi\|avx512vbmi\|avx512_vnni\|avx512_bf16' /proc/cpuinfo | sort -u || true)
args="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"
has() { grep -q -x "$1" <<<"$flags"; }
if has avx512f; then
    args+=" -DGGML_AVX512=ON"
    { has avx512_vbmi || has avx512vbmi; } && args+=" -DGGML_AVX512_VBMI=ON"
    has avx512_vnni && args+=" -DGGML_AVX512_VNNI=ON"
    has avx512_bf16 && args+=" -DGGML_AVX512_BF16=ON"
fi
echo "$args"
