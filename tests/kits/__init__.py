"""What the tests share: tiny models (``tiny``), exact laws and chi-square tests (``lawkit``), drafted trees
(``treekit``), trees as an adapter's ``forward_tree`` takes them and each tree adapter as the protocol's suite checks
it (``treeforward``), the engine's reference and broken variants (``enginekit``, ``broken``), hand-made SV profiles and
latencies (``svkit``)."""
