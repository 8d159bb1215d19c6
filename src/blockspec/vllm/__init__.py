"""blockspec's verification rules inside vLLM's engine.

``ragged``: block verification on vLLM's flattened layout (every request's drafted tokens one after another),
vectorised over requests and fed with the random draws vLLM's own token rule consumes. It imports torch and
``blockspec.verify`` only, never vLLM, so it is tested without vLLM installed.

``plugin``: the vLLM plugin (entry point ``vllm.general_plugins``), switched on by ``BLOCKSPEC_VLLM_RULE``; it
puts ``ragged``'s rule in vLLM 0.32's rejection sampler and fixes vLLM CPU's expand kernel. See
docs/guide/vllm.md.
"""
