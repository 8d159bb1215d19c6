"""``blockspec env``: versions, threads, device, CPU flags and the arithmetic chosen, for bug reports."""

from __future__ import annotations

import json
import platform
import sys


def add_parser(sub) -> None:
    env = sub.add_parser(
        "env",
        help="versions, threads, device, CPU flags and the arithmetic chosen for this machine, "
        "to paste into a bug report",
    )
    env.add_argument("--json", action="store_true", help="print JSON instead of lines")
    env.set_defaults(run=run)


def run(args) -> int:
    import os

    import torch

    from .. import __version__, machine
    from ..auto import choose_arithmetic, native_bf16
    from ..bench.provenance import package_version

    info = {
        "blockspec": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": " ".join(machine.cpu_flags()) or "none of avx2, avx512*, amx*",
        "native_bf16": native_bf16(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        **{
            package: package_version(package)
            for package in ("transformers", "accelerate", "gguf", "safetensors", "llama-cpp-python")
        },
        "llamacpp_build": _llamacpp_build(),
        "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", ""),
    }
    arithmetic = choose_arithmetic("cuda" if torch.cuda.is_available() else "cpu")  # probes once per machine
    info |= {
        "auto_dtype": arithmetic.dtype,
        "auto_draft_quant": arithmetic.draft_quant or "none",
        "auto_reason": arithmetic.reason,
    }
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        for key, value in info.items():
            print(f"{key}: {value}")
    return 0


def _llamacpp_build() -> str:
    """The instruction sets the installed llama.cpp was built with (its system info), or why there is none."""
    from ..models.llamacpp import build_info

    try:
        return build_info()
    except ImportError as error:
        return str(error)
