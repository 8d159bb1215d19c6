"""Former names keep working for one release, with a warning that names the new one.

"How many tokens" has one name per meaning (the glossary of ``blockspec.verify.base``): the verify functions'
``num_draft=`` became ``num_verified=``, ``SpeculativeDecoder(draft_len=)`` became ``max_draft=``, the command
line's ``--draft-len`` / ``--draft-lens`` became ``--max-draft``, and a saved SV recording's ``num_draft``
became ``num_verified``. Each old spelling must give exactly what the new one gives.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_validation import B, K, V, good_inputs
from tiny import perturbed, tiny_model

from blockspec import SpeculativeDecoder
from blockspec.bench.calibrate import Recording
from blockspec.cli import build_parser
from blockspec.sampling import SamplingParams
from blockspec.verify import (
    VERIFIERS,
    Randomness,
    acceptance_survival,
    accepted_length_law,
    block_acceptance,
    expected_accepted,
    final_distributions,
    token_acceptance,
)


def test_verifiers_take_num_draft_as_the_former_name_of_num_verified():
    x, d, t = good_inputs()
    rows = torch.tensor([K, 1])
    randomness = Randomness.draw(B, K, V, dtype=t.dtype, generator=torch.Generator().manual_seed(3))
    for name, verifier in VERIFIERS.items():
        new = verifier(x, d, t, num_verified=rows, randomness=randomness)
        with pytest.warns(DeprecationWarning, match=rf"{name}\(num_draft=\.\.\.\) is deprecated: use num_verified="):
            old = verifier(x, d, t, num_draft=rows, randomness=randomness)
        assert torch.equal(old.tokens, new.tokens) and torch.equal(old.num_accepted, new.num_accepted)
    with pytest.raises(TypeError, match="got both num_draft= and num_verified="):
        VERIFIERS["block"](x, d, t, num_draft=rows, num_verified=rows)


@pytest.mark.parametrize("function", [accepted_length_law, acceptance_survival, expected_accepted, final_distributions])
def test_closed_forms_take_num_draft_as_the_former_name_of_num_verified(function):
    x, d, t = good_inputs()
    rows = torch.tensor([2, 0])
    new = function(x, d, t, "block", num_verified=rows)
    with pytest.warns(DeprecationWarning, match="use num_verified="):
        old = function(x, d, t, "block", num_draft=rows)
    torch.testing.assert_close(old, new, rtol=0, atol=0)


@pytest.mark.parametrize("function", [token_acceptance, block_acceptance])
def test_acceptance_tables_take_num_draft_as_the_former_name_of_num_verified(function):
    x, d, t = good_inputs()
    rows = torch.tensor([1, K])
    new = function(x, d, t, num_verified=rows)
    with pytest.warns(DeprecationWarning, match="use num_verified="):
        old = function(x, d, t, num_draft=rows)
    for a, b in zip(old if isinstance(old, tuple) else (old,), new if isinstance(new, tuple) else (new,)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_decoder_takes_draft_len_as_the_former_name_of_max_draft():
    target = tiny_model(sharpness=5.0)
    draft = perturbed(target, scale=0.3, seed=1)
    new = SpeculativeDecoder(target, draft, max_draft=3)
    with pytest.warns(DeprecationWarning, match=r"SpeculativeDecoder.__init__\(draft_len=\.\.\.\) is deprecated"):
        old = SpeculativeDecoder(target, draft, draft_len=3)
    assert old.max_draft == new.max_draft == 3
    run = dict(max_new_tokens=8, sampling=SamplingParams(1.0), seed=4)
    assert old.generate([[1, 2, 3]], **run).sequences == new.generate([[1, 2, 3]], **run).sequences


@pytest.mark.parametrize(
    ("argv", "dest", "value"),
    [
        (["generate", "--draft-len", "3", "hi"], "max_draft", 3),
        (["bench", "--draft-lens", "2", "4"], "max_drafts", [2, 4]),
        (["align", "--draft-len", "5"], "max_draft", 5),
        (["sv", "calibrate", "--draft-len", "6"], "max_draft", 6),
    ],
)
def test_the_command_line_takes_the_former_flag_names_with_a_warning(argv, dest, value, capsys):
    former = next(a for a in argv if a.startswith("--draft-len"))
    old = build_parser().parse_args(argv)
    assert f"warning: {former} is deprecated: use --max-draft" in capsys.readouterr().err
    new = build_parser().parse_args(["--max-draft" if a == former else a for a in argv])
    assert capsys.readouterr().err == ""
    assert getattr(old, dest) == getattr(new, dest) == value


def test_the_former_flags_are_hidden_from_help(capsys):
    for command in (["generate"], ["bench"], ["align"], ["sv", "calibrate"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--help"])
        shown = capsys.readouterr().out
        assert "--max-draft" in shown and "--draft-len" not in shown


def test_a_recording_saved_under_the_former_field_name_loads(tmp_path):
    recording = Recording(
        prompt=torch.tensor([0, 1]),
        num_verified=torch.tensor([3, 2]),
        accepted=torch.tensor([1, 2]),
        draft=torch.zeros(2, 3, 4),
        companion={},
        labels={},
    )
    old = dict(recording.__dict__)
    old["num_draft"] = old.pop("num_verified")
    torch.save(old, tmp_path / "old.pt")
    loaded = Recording.load(tmp_path / "old.pt")
    assert torch.equal(loaded.num_verified, recording.num_verified)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recording.save(tmp_path / "new.pt")
        assert torch.equal(Recording.load(tmp_path / "new.pt").num_verified, recording.num_verified)
