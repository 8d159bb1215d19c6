"""blockspec: lossless speculative decoding with token, block and speculative verification."""

from .engine import GenerationResult, SpeculativeDecoder, StepStats
from .sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["GenerationResult", "SamplingParams", "SpeculativeDecoder", "StepStats", "__version__"]
