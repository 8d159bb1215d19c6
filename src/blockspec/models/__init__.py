"""Model adapters and the bundled presets (`blockspec.models.presets`). transformers is imported lazily."""
