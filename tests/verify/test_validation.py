"""Bad input gets a clear ValueError naming the argument; padding is ignored; validation can be switched off.

Also: blockspec.verify loads without transformers.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from blockspec.verify import RULES, Randomness, expected_accepted

B, K, V = 2, 3, 5


def good_inputs(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    draft_probs = torch.rand(B, K, V, generator=gen, dtype=dtype).softmax(-1)
    target_probs = torch.rand(B, K + 1, V, generator=gen, dtype=dtype).softmax(-1)
    draft_tokens = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=gen).reshape(B, K)
    return draft_tokens, draft_probs, target_probs


def broken(what: str):
    """Good inputs with one thing wrong, and the words the error must contain."""
    x, d, t = good_inputs()
    kwargs = {}
    if what == "tokens dtype":
        x = x.int()
        return (x, d, t), kwargs, "draft_tokens must be int64"
    if what == "tokens rank":
        return (x[0], d, t), kwargs, "draft_tokens must be a [B, K] tensor"
    if what == "K mismatch":
        return (x, d, t[:, :K]), kwargs, "target_probs must have shape [B, K+1, V]"
    if what == "draft shape":
        return (x, d[:, :, :-1], t), kwargs, "draft_probs must have shape"
    if what == "int probs":
        return (x, d, t.long()), kwargs, "target_probs must be float32 or float64"
    if what == "dtype mismatch":
        return (x, d.float(), t), kwargs, "draft_probs is torch.float32 but target_probs is torch.float64"
    if what == "NaN":
        t[1, 2, 0] = float("nan")
        return (x, d, t), kwargs, "target_probs[1, 2] contains NaN"
    if what == "negative":
        d[0, 1, 0] -= 0.5
        d[0, 1, 1] += 0.5
        return (x, d, t), kwargs, "draft_probs[0, 1] has negative entries"
    if what == "not normalised":
        return (x, d, t * 1.01), kwargs, "target_probs[0, 0] does not sum to 1"
    if what == "logits":
        return (x, d, torch.randn(B, K + 1, V, dtype=torch.float64)), kwargs, "pass probabilities, not logits"
    if what == "num_verified range":
        kwargs["num_verified"] = torch.tensor([K + 1, 0])
        return (x, d, t), kwargs, "num_verified must lie in [0, K]"
    if what == "num_verified dtype":
        kwargs["num_verified"] = torch.tensor([1.0, 2.0])
        return (x, d, t), kwargs, "num_verified must be int64"
    if what == "token out of vocabulary":
        x[1, 1] = V
        return (x, d, t), kwargs, f"draft_tokens[1, 1] = {V} is outside the vocabulary"
    if what == "negative token":
        x[0, 2] = -3
        return (x, d, t), kwargs, "draft_tokens[0, 2] = -3 is outside the vocabulary"
    if what == "impossible draft token":
        d[0, 0] = torch.tensor([0.0, 0.25, 0.25, 0.25, 0.25], dtype=d.dtype)
        x[0, 0] = 0
        return (x, d, t), kwargs, "draft_tokens[0, 0] = 0 has zero probability under draft_probs[0, 0]"
    if what == "uniforms shape":
        kwargs["randomness"] = Randomness(torch.rand(B, K + 1, dtype=t.dtype), torch.ones(B, V, dtype=t.dtype))
        return (x, d, t), kwargs, "randomness.uniforms must have shape [B, K]"
    if what == "uniforms range":
        kwargs["randomness"] = Randomness(torch.full((B, K), 1.0, dtype=t.dtype), torch.ones(B, V, dtype=t.dtype))
        return (x, d, t), kwargs, "randomness.uniforms must lie in [0, 1)"
    if what == "exponentials":
        kwargs["randomness"] = Randomness(torch.zeros(B, K, dtype=t.dtype), torch.zeros(B, V, dtype=t.dtype))
        return (x, d, t), kwargs, "randomness.exponentials must be finite and > 0"
    if what == "infinite exponentials":  # all infinite: the race's argmax returns token 0, of target probability 0
        exponentials = torch.ones(B, V, dtype=t.dtype)
        exponentials[1] = torch.inf
        kwargs["randomness"] = Randomness(torch.zeros(B, K, dtype=t.dtype), exponentials)
        return (x, d, t), kwargs, "randomness.exponentials must be finite and > 0"
    raise AssertionError(what)


CASES = [
    "tokens dtype",
    "tokens rank",
    "K mismatch",
    "draft shape",
    "int probs",
    "dtype mismatch",
    "NaN",
    "negative",
    "not normalised",
    "logits",
    "num_verified range",
    "num_verified dtype",
    "token out of vocabulary",
    "negative token",
    "impossible draft token",
    "uniforms shape",
    "uniforms range",
    "exponentials",
    "infinite exponentials",
]


@pytest.mark.parametrize("what", CASES)
def test_bad_input_is_refused_with_a_clear_message(rule, what):
    args, kwargs, message = broken(what)
    with pytest.raises(ValueError, match=re.escape(message)):
        RULES[rule].verify(*args, **kwargs)


@pytest.mark.parametrize("what", ["NaN", "not normalised", "token out of vocabulary", "impossible draft token"])
def test_expected_accepted_validates_too(what):
    args, kwargs, message = broken(what)
    with pytest.raises(ValueError, match=re.escape(message)):
        expected_accepted(*args, "block", **kwargs)


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="rule must be one of block, token, greedy, got 'tree'"):
        expected_accepted(*good_inputs(), "tree")


def test_a_rule_without_closed_forms_is_refused():
    with pytest.raises(ValueError, match="the 'greedy' rule has no closed form"):
        expected_accepted(*good_inputs(), "greedy")


def test_float32_softmax_rows_pass_and_float64_tolerance_is_tighter():
    x, d, t = good_inputs(torch.float32)
    RULES["block"].verify(x, d, t)  # float32 rounding of a softmax is well inside the float32 tolerance
    x, d, t = good_inputs(torch.float64)
    with pytest.raises(ValueError, match="does not sum to 1"):
        RULES["block"].verify(x, d, t * (1 + 1e-6))  # fine in float32, not in float64


def test_padding_beyond_num_verified_is_ignored(rule):
    x, d, t = good_inputs()
    x[0, 1:] = -1  # row 0 drafted one token: junk after it must not be validated
    d[0, 1:] = float("nan")
    t[0, 2:] = 5.0
    out = RULES[rule].verify(x, d, t, num_verified=torch.tensor([1, K]), generator=torch.Generator().manual_seed(0))
    assert int(out.num_accepted[0]) <= 1


def test_validation_can_be_switched_off():
    args, _, _ = broken("not normalised")
    RULES["token"].verify(*args, validate=False)  # no check, no error: the caller vouches for the inputs


def test_verify_imports_no_transformers():
    """The pure-tensor core stays importable without transformers (tests/test_layers.py checks every import)."""
    code = "import sys, blockspec.verify; print('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
