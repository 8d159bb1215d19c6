"""Every default a user can see, in one place: the CLI, the bench and the library read them from here.

Stdlib only (no torch), so ``blockspec --help`` lists them instantly.
"""

# The logging level of the messages that announce slow work done once and kept in the model cache (a tokenizer read
# from a GGUF header, a requantized or dequantized copy): between INFO and WARNING, so the CLI shows them by default
NOTICE = 25
TARGET = "qwen2.5-coder-1.5b"  # the bundled pair: a preset name (blockspec.models.presets)
DRAFT = "qwen2.5-coder-0.5b"
DTYPES = ("bfloat16", "float16", "float32")  # model weights and activations
QUANTS = ("int8",)  # weight quantizations of a model's linear layers (blockspec.models.quant)
LLAMACPP_QUANTS = ("q4_0",)  # llama.cpp requantizations of a whole GGUF (blockspec.models.llamacpp.QUANTS)
LLAMACPP_DTYPE = "gguf"  # a llama.cpp model's dtype, and the bench's arithmetic there: the file's own types
BACKENDS = ("llamacpp", "hf")  # who runs a model: llama.cpp on the GGUF as it is, or transformers (models.load_model)
RULE = "block"  # the verification rule: optimal in expected accepted tokens (Sun et al.)
MAX_DRAFT = 4  # tokens a step drafts per row under a fixed length (and the most SV drafts)
DRAFT_LIMIT = 64  # the most --max-draft accepts: a longer draft costs more than any acceptance pays back
# How paths=k / --paths k draws its paths: the first tokens without replacement ("distinct"; "iid": k independent
# paths). Distinct first tokens never spend a path on a copy: more accepted tokens per step than i.i.d. paths, by far
# where the draft is far from the target, and about as many where it is close (docs/algorithms.md)
PATHS_DRAWN = "distinct"
PATH_DRAWINGS = ("distinct", "iid")
LOOKUP_MAX_DRAFT = 32  # the most tokens one prompt lookup proposal holds (PromptLookup.max_draft)
ADAPTIVE_MAX_DRAFT = 8  # the most a step drafts when the length adapts to measured latency (AdaptiveLength)
CATCH_UP_HORIZON = 30  # steps over which AdaptiveLength pays back a catch-up of its draft beyond 2 tokens
COMPANION = "prefix:8"  # SV's companion: the target's own first 8 layers (shared weights)
SV_PREDICTOR = "draft"  # SV's features: draft-only (no companion forward)
SV_BATCH_SIZES = (1, 4, 16, 32, 64)  # the batch sizes an SV latency profile measures and replays
# The alignment sweep (`blockspec align`, the bench's "align" preset): block verification at K = 4 with the draft
# sampling at temperatures of its own, the target at 1; the other settings are the bench's defaults
ALIGN = {
    "dtype": "bfloat16",
    "prompts_per_dataset": 4,
    "max_drafts": (4,),
    "configs": ("block",),
    "draft_temperatures": (0.4, 0.7, 1.0, 1.5, 2.0),
    "out": "results/align",
}
