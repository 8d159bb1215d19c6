"""blockspec: lossless speculative decoding with token, block and speculative verification.

    from blockspec import SpeculativeDecoder, SamplingParams

    decoder = SpeculativeDecoder(target, draft)                  # block verification, 4 drafted tokens a step
    decoder = SpeculativeDecoder(target, draft, policy="sv")     # Speculative Verification, from saved profiles

The names below load on first use, so that `blockspec --help` does not wait for torch.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "GenerationResult": "outputs",
    "SpeculativeDecoder": "engine",
    "StepStats": "outputs",
    "PromptLookup": "drafting",
    "AdaptiveLength": "policy",
    "AdaptiveShape": "policy",
    "FixedLength": "policy",
    "LengthPolicy": "policy",
    "SVPolicy": "policy",
    "SamplingParams": "sampling",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'blockspec' has no attribute {name!r}")
