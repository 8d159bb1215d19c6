"""``as_model``: whatever the engine is handed as a model, as a ``LanguageModel``."""

from __future__ import annotations

from .base import LanguageModel


def as_model(model) -> LanguageModel:
    """An adapter as is; a transformers PreTrainedModel wrapped in HFModel (imported only then, so that a caller
    with its own adapters never imports transformers)."""
    if isinstance(model, LanguageModel):
        return model
    from .hf import HFModel

    return HFModel(model)
