"""Model adapters and the bundled presets (`blockspec.models.presets`). transformers is imported lazily."""

# Named here, free of torch imports, so the CLI can offer them before loading anything.
DTYPES = ("bfloat16", "float16", "float32")
QUANTS = ("int8",)  # models.quant
