"""blockspec's verification rules on vLLM's data layout, for running them inside vLLM's engine.

``ragged``: block verification on vLLM's flattened layout (every request's drafted tokens one after another),
vectorised over requests and fed with the random draws vLLM's own token rule consumes. It imports torch and
``blockspec.verify`` only, never vLLM, so it is tested without vLLM installed.
"""
