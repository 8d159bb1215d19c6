"""vLLM's offline engine with blockspec's plugin refuses to start, naming the switch, where a stopping rule could
not work as asked: SV (BLOCKSPEC_VLLM_SV) with a latency profile measured on other models than those served, and
a draft threshold (BLOCKSPEC_VLLM_MIN_DRAFT_PROB) over a drafter that keeps no draft probabilities. Started, the
first would fail at the first request, inside vLLM's worker, and the second would never cut anything."""

from __future__ import annotations

import re

import pytest
import tinyvllm

from blockspec.vllm.switches import CUT_SWITCH, SV_SWITCH


class Served:
    """What ``tinyvllm.sv_profiles`` reads of an engine, for models it does not serve."""

    class llm_engine:
        class model_config:
            model = "models/another-target"

        class vllm_config:
            class speculative_config:
                model = "models/another-draft"


@pytest.mark.parametrize("refused", ["sv measured on other models", "threshold without draft probabilities"])
def test_the_engine_refuses_to_start_with_a_stopping_rule_that_cannot_work(tmp_path, monkeypatch, capfd, refused):
    method = "probabilistic"
    if refused == "sv measured on other models":
        paths = tinyvllm.sv_profiles(tmp_path, drafting=0.0, prior=0.9, llm=Served)
        monkeypatch.setenv(SV_SWITCH, ":".join(paths))
        message = f"{SV_SWITCH}: latency profile .* was measured with target 'models/another-target'"
    else:
        monkeypatch.setenv(CUT_SWITCH, "0.5")
        method = "greedy"
        message = f"{CUT_SWITCH} chooses among sampled drafts by their draft probabilities"
    with pytest.raises(Exception):  # noqa: B017 - vLLM reports a failed worker start by a generic error
        tinyvllm.start(tmp_path / "models", "block", draft_sample_method=method)
    captured = capfd.readouterr()
    assert re.search(message, captured.out + captured.err), "the worker's error names the switch"
