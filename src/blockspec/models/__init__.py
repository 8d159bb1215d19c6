"""Model adapters (`base.LanguageModel`), transformers models (`hf`), the bundled presets (`presets`), int8
draft quantization (`quant`), SV companions (`companion`) and prompt encoding (`chat`).

transformers is imported lazily, inside functions.
"""
