"""Quantized drafts: a cheaper forward for the model that only proposes tokens.

At batch 1 a speculative step costs K draft forwards and one target forward, so the draft's forward is the lever.
Verification sees the distribution the quantized draft actually proposed from, so quantizing the draft changes
how many tokens are accepted, never the output law (which stays the target's, as loaded). What ``int8`` runs,
and why those kernels: ``quantize``.
"""

from __future__ import annotations

import warnings

import torch

from ..defaults import QUANTS


def quantize(model: torch.nn.Module, quant: str) -> torch.nn.Module:
    """``model`` (a transformers causal LM on the CPU) with its linear layers quantized in place, as ``quant``
    says; the model is first cast to float32, the only dtype the int8 kernels take activations in.

    ``int8``: torch's dynamic quantization (``quantize_dynamic``: int8 weights per output channel, activations
    quantized on the fly, fbgemm kernels) of every ``nn.Linear``, the output projection included; the rest of the
    model (embeddings, norms, attention over the cache) runs in float32. On an AVX2-only CPU it was the fastest of
    the int8 and int4 kernels torch and torchao offer without torch.compile. CPU only: fbgemm has no CUDA kernels.
    ``quantize_dynamic`` is deprecated in torch 2.13 in favour of torchao (whose CPU kernels are the slow ones
    above); where a later torch removes it, asking for ``int8`` fails with that reason instead of silently running
    unquantized."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"int8 quantization runs on the CPU only (fbgemm kernels); the model is on {device}")
    quantization = getattr(getattr(torch, "ao", None), "quantization", None)
    if quantization is None or not hasattr(quantization, "quantize_dynamic"):
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.ao.quantization.quantize_dynamic: int8 drafts "
            "need torch 2.13 or another release that still ships it"
        )
    engines = torch.backends.quantized.supported_engines
    if "fbgemm" not in engines and "x86" not in engines:
        raise RuntimeError(f"this torch build has no x86 int8 kernels (its quantized engines: {engines})")
    model = model.float()
    with warnings.catch_warnings():  # its deprecation notices say nothing the module docstring does not
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*deprecated", category=UserWarning)
        quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    return model
