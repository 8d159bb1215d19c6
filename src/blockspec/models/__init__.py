"""Model adapters (`base.LanguageModel`, `base.TreeLanguageModel` for drafted trees, `adapt.as_model`), loading one
by name on either backend (`load`), llama.cpp models (`llamacpp`, `vocab_cut`), transformers models (`hf`, with its
`slots` cache and `attention` kernel), the bundled presets (`presets`), the model cache (`cache`, `integrity`) and
what fills it (`convert`), int8 draft quantization (`quant`), SV companions (`companion`) and prompt encoding (`chat`).

transformers' modeling code is imported by `hf`, `slots` and `attention` only (seconds), so `load` imports `hf` for
the transformers backend alone; its tokenizers are imported lazily inside functions of `convert`, `load` and `llamacpp`.
"""
