"""The vLLM plugin's switches, read from the environment where vLLM starts: a value the plugin cannot use is refused
with the switch's name (vLLM then logs the plugin's failure and ``check`` reports it missing), never guessed."""

from __future__ import annotations

import pytest

from blockspec.vllm import switches

READERS = {"SWITCH": switches.requested_rule, "CUT_SWITCH": switches.min_draft_prob, "SV_SWITCH": switches.sv_profiles}


@pytest.mark.parametrize(
    ("switch", "value", "read"),
    [
        ("SWITCH", None, None),
        ("SWITCH", "", None),
        ("SWITCH", "off", None),
        ("SWITCH", " Block ", "block"),
        ("SWITCH", "token", "token"),
        ("CUT_SWITCH", None, None),
        ("CUT_SWITCH", "", None),
        ("CUT_SWITCH", "0.5", 0.5),
        ("CUT_SWITCH", "1", 1.0),
        ("SV_SWITCH", None, None),
        ("SV_SWITCH", " ", None),
        ("SV_SWITCH", "a/c.json:b/l.json", ("a/c.json", "b/l.json")),
    ],
)
def test_what_each_switch_reads(monkeypatch, switch, value, read):
    if value is None:
        monkeypatch.delenv(getattr(switches, switch), raising=False)
    else:
        monkeypatch.setenv(getattr(switches, switch), value)
    assert READERS[switch]() == read


@pytest.mark.parametrize(
    ("switch", "value"),
    [
        ("SWITCH", "blocks"),
        ("CUT_SWITCH", "0"),
        ("CUT_SWITCH", "1.5"),
        ("CUT_SWITCH", "-0.2"),
        ("CUT_SWITCH", "half"),
        ("CUT_SWITCH", "nan"),
        ("SV_SWITCH", "c.json"),
        ("SV_SWITCH", "c.json:"),
        ("SV_SWITCH", "a:b:c"),
    ],
)
def test_unusable_values_are_refused_by_name(monkeypatch, switch, value):
    name = getattr(switches, switch)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        READERS[switch]()
