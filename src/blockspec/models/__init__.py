"""Model adapters (`base.LanguageModel`, `base.TreeLanguageModel` for drafted trees, `adapt.as_model`), transformers
models (`hf`, with its `slots` cache and `attention` kernel), the bundled presets (`presets`), the model cache
(`cache`, `integrity`) and what fills it (`convert`), int8 draft quantization (`quant`), SV companions (`companion`)
and prompt encoding (`chat`).

transformers is imported by `hf`, `slots` and `attention`, and lazily inside functions of `convert`.
"""
