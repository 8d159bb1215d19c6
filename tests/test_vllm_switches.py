"""The vLLM plugin's switches, read from the environment where vLLM starts: a value the plugin cannot use is refused
with the switch's name (vLLM then logs the plugin's failure and ``check`` reports it missing), never guessed."""

from __future__ import annotations

import pytest

from blockspec.vllm import plugin


@pytest.mark.parametrize(("value", "rule"), [(None, None), ("", None), ("off", None), (" Block ", "block"),
                                             ("token", "token")])
def test_the_rule_switch(monkeypatch, value, rule):
    if value is None:
        monkeypatch.delenv(plugin.SWITCH, raising=False)
    else:
        monkeypatch.setenv(plugin.SWITCH, value)
    assert plugin.requested_rule() == rule


@pytest.mark.parametrize(("value", "threshold"), [(None, None), ("", None), ("0.5", 0.5), ("1", 1.0)])
def test_the_draft_cut_switch(monkeypatch, value, threshold):
    if value is None:
        monkeypatch.delenv(plugin.CUT_SWITCH, raising=False)
    else:
        monkeypatch.setenv(plugin.CUT_SWITCH, value)
    assert plugin.min_draft_prob() == threshold


@pytest.mark.parametrize(("switch", "value"), [("SWITCH", "blocks"), ("CUT_SWITCH", "0"), ("CUT_SWITCH", "1.5"),
                                               ("CUT_SWITCH", "-0.2"), ("CUT_SWITCH", "half"), ("CUT_SWITCH", "nan")])
def test_unusable_values_are_refused_by_name(monkeypatch, switch, value):
    name = getattr(plugin, switch)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        plugin.requested_rule() if switch == "SWITCH" else plugin.min_draft_prob()
