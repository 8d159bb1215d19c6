"""The installed llama.cpp is built for this CPU: pip reuses a wheel it compiled before, even one compiled on a
machine of another kind, and scripts/setup.sh compiles again where the instruction sets differ."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from blockspec.models.llamacpp import build_mismatches

ROOT = Path(__file__).resolve().parents[2]
ALL = "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
INFO_ALL = "CPU : AVX2 = 1 | F16C = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | OPENMP = 1 |"
INFO_AVX2 = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | REPACK = 1 |"


def test_a_build_agrees_with_its_flags_set_by_set():
    assert build_mismatches(ALL, INFO_ALL) == []
    assert build_mismatches("-DGGML_NATIVE=OFF", INFO_AVX2) == []
    assert build_mismatches(ALL, INFO_AVX2) == [
        "AVX512: asked for, not built",
        "AVX512_BF16: asked for, not built",
        "AVX512_VBMI: asked for, not built",
        "AVX512_VNNI: asked for, not built",
    ]
    assert build_mismatches("-DGGML_NATIVE=OFF", INFO_ALL)[0] == "AVX512: built, not asked for"
    # AVX512_VBMI is not AVX512, and a set reported as 0 is not built
    assert build_mismatches("-DGGML_AVX512_VBMI=ON", "CPU : AVX512_VBMI = 1 | AVX512 = 0 |") == []
    assert build_mismatches("-DGGML_AVX512=ON -DGGML_AVX512_BF16=OFF", INFO_ALL) == [
        "AVX512_BF16: built, not asked for",
        "AVX512_VBMI: built, not asked for",
        "AVX512_VNNI: built, not asked for",
    ]


def test_the_installed_llama_cpp_has_the_instruction_sets_set_up_asks_for_on_this_cpu():
    pytest.importorskip("llama_cpp")
    from blockspec.models.llamacpp import build_info

    args = (
        os.environ.get("CMAKE_ARGS")
        or subprocess.run(
            ["bash", str(ROOT / "scripts" / "llamacpp_flags.sh")], capture_output=True, text=True, check=True
        ).stdout
    )
    assert build_mismatches(args, build_info()) == []
