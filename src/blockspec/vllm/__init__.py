"""blockspec's verification rules inside vLLM 0.32's V1 engine (docs/guide/vllm.md).

``plugin``: the entry point (``vllm.general_plugins``), switched on by ``BLOCKSPEC_VLLM_RULE`` (``switches``);
it puts in place ``fixes`` (vLLM's defects), ``rejection`` (the block rule on vLLM's rejection-sampling path),
``sv_hook`` (how many drafts each request verifies: SV or a threshold) and ``status`` (what each worker runs,
and ``check``/``check_server``), all counting into one ``state.STATE``. ``ragged``: block verification on vLLM's
flattened layout, tested without vLLM. ``profile``: the latency profile SV prices vLLM's steps with.
"""
