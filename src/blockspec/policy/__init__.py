"""Length policies: how many tokens each step drafts and verifies (the ``LengthPolicy`` contract in ``base``).

    FixedLength      draft and verify K tokens every step
    AdaptiveLength   each step's K from the step latency measured on this machine and the acceptance so far
    SVPolicy         Speculative Verification: per-row verification lengths from predicted gains and latency
    AdaptiveShape    each step's draft shape, tree or chain, from measured latency and acceptance (``shapes``)

``features``, ``predictor`` and ``latency`` hold what SV runs on: its per-position features, its calibrated gain
predictor and its latency profile; ``profiles`` where they are stored. The names below load on first use, so that
the command line can read ``profiles`` without importing torch.
"""

_EXPORTS = {
    "AdaptiveShape": "shapes",
    "AdaptiveLength": "fixed",
    "FixedLength": "fixed",
    "LatencyTable": "base",
    "LengthPolicy": "base",
    "SVPolicy": "sv",
    "ragged_stopping_lengths": "base",
    "stopping_lengths": "base",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'blockspec.policy' has no attribute {name!r}")
