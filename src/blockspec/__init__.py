"""blockspec: lossless speculative decoding with token, block and speculative verification."""

__version__ = "0.1.0"
