"""Speculative Verification in one line: ``SpeculativeDecoder(target, draft, policy="sv")`` finds the profiles
that ``blockspec sv profile`` and ``blockspec sv calibrate`` saved for the models, as the command line does, says
which command to run when one is missing, and starts every ``generate`` call from the profile's state unless the
policy is built to carry it over."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kits.svkit import ENGINE_LATENCY, hand_profile
from kits.tiny import perturbed, tiny_model

from blockspec import SamplingParams, SpeculativeDecoder
from blockspec.defaults import COMPANION
from blockspec.models.hf import HFModel
from blockspec.policy import SVPolicy
from blockspec.policy.latency import META_FIELDS
from blockspec.policy.profiles import latency_path, profile_path, sampling_key

pytestmark = pytest.mark.usefixtures("probes_in_a_temporary_cache", "one_thread")

SAMPLING = SamplingParams(temperature=1.0)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9]]
DRAFT_WEIGHTS = (3.0, -0.5, -0.5, 1.0, 0.4)  # test_sv's, with the bias raised: on these models some drafts pay


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(sharpness=5.0)
    return (HFModel(target, name="tiny-target"), HFModel(perturbed(target, scale=0.3, seed=1), name="tiny-draft"))


def save_profiles(target, draft, sampling=SAMPLING, companion=COMPANION):
    """A hand-made calibration and latency profile where the command line would have saved them."""
    profile = hand_profile(DRAFT_WEIGHTS, companion=companion, sampling=sampling_key(sampling))
    profile_file = profile_path("tiny-target", "tiny-draft", companion, sampling_key(sampling))
    profile_file.parent.mkdir(parents=True, exist_ok=True)
    profile.save(profile_file)
    meta = {"target": "tiny-target", "draft": "tiny-draft", "companion": companion, "dtype": "float32", "device": "cpu"}
    latency = dataclasses.replace(ENGINE_LATENCY, meta={field: meta.get(field) for field in META_FIELDS})
    latency_file = latency_path("tiny-target", "tiny-draft", companion, "float32", "cpu")
    latency.save(latency_file)
    return profile, latency, profile_file, latency_file


def test_a_missing_profile_names_the_command_that_makes_it(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, draft, policy="sv")
    with pytest.raises(FileNotFoundError, match="run `blockspec sv calibrate` with the same models"):
        decoder.generate(PROMPTS, max_new_tokens=4, sampling=SAMPLING, seed=0)
    _, _, _, latency_file = save_profiles(target, draft)
    latency_file.unlink()
    with pytest.raises(FileNotFoundError, match="run `blockspec sv profile` with the same models"):
        decoder.generate(PROMPTS, max_new_tokens=4, sampling=SAMPLING, seed=0)
    with pytest.raises(FileNotFoundError, match="sv calibrate"):  # another sampling has no calibration
        decoder.generate(PROMPTS, max_new_tokens=4, sampling=SamplingParams(temperature=0.5), seed=0)


def test_policy_sv_is_the_policy_from_the_cache_with_the_decoders_rule_and_length(pair):
    target, draft = pair
    profile, latency, _, _ = save_profiles(target, draft)
    one_line = SpeculativeDecoder(target, draft, policy="sv", max_draft=4)
    result = one_line.generate(PROMPTS, max_new_tokens=12, sampling=SAMPLING, seed=3)
    assert isinstance(one_line.policy, SVPolicy)
    assert (one_line.policy.rule, one_line.policy.max_draft, one_line.policy.kind) == ("block", 4, "draft")

    explicit = SVPolicy(profile, latency, rule="block", max_draft=4, kind="draft")
    spelled_out = SpeculativeDecoder(target, draft, policy=explicit)
    expected = spelled_out.generate(PROMPTS, max_new_tokens=12, sampling=SAMPLING, seed=3)
    assert result.sequences == expected.sequences
    assert [s.verified for s in result.stats] == [s.verified for s in expected.stats]
    assert 0 < sum(k for s in result.stats for k in s.verified) < sum(4 * len(s.rows) for s in result.stats)

    token = SpeculativeDecoder(target, draft, policy="sv", rule="token", max_draft=3)
    token.generate(PROMPTS, max_new_tokens=4, sampling=SAMPLING, seed=3)
    assert (token.policy.rule, token.policy.max_draft) == ("token", 3)


def test_each_generate_call_starts_from_the_profile_unless_the_policy_carries_over(pair):
    target, draft = pair
    profile, latency, _, _ = save_profiles(target, draft)
    fresh = SVPolicy(profile, latency, rule="block", max_draft=4)
    decoder = SpeculativeDecoder(target, draft, policy=fresh)
    first = decoder.generate(PROMPTS, max_new_tokens=16, sampling=SAMPLING, seed=5)
    learnt = dict(fresh.offsets)
    assert any(offset != 0 for offset in learnt.values())  # it learnt during the call
    second = decoder.generate(PROMPTS, max_new_tokens=16, sampling=SAMPLING, seed=5)
    assert second.sequences == first.sequences and fresh.offsets == learnt  # the same call, the same outcome

    kept = SVPolicy(profile, latency, rule="block", max_draft=4, carry_over=True)
    decoder = SpeculativeDecoder(target, draft, policy=kept)
    decoder.generate(PROMPTS, max_new_tokens=16, sampling=SAMPLING, seed=5)
    assert kept.offsets == learnt
    decoder.generate(PROMPTS, max_new_tokens=16, sampling=SAMPLING, seed=5)
    assert kept.offsets != learnt  # the second call started from the first one's offsets


def test_from_cache_refuses_a_profile_of_other_models(pair):
    target, draft = pair
    save_profiles(target, draft)
    renamed = HFModel(target.model, name="another-target")
    with pytest.raises(FileNotFoundError, match="sv calibrate"):
        SVPolicy.from_cache(renamed, draft, sampling=SAMPLING)
    policy = SVPolicy.from_cache(renamed, draft, sampling=SAMPLING, names=("tiny-target", "tiny-draft"))
    assert policy.kind == "draft" and policy.rule == "block"
    with pytest.raises(ValueError, match="calibrated with target 'tiny-target', not 'another-target'"):
        SVPolicy.from_cache(
            renamed,
            draft,
            sampling=SAMPLING,
            profile=profile_path("tiny-target", "tiny-draft", COMPANION, sampling_key(SAMPLING)),
        )


def test_sv_at_temperature_zero_is_greedy_decoding(pair):
    target, draft = pair
    greedy = SamplingParams(temperature=0.0)
    save_profiles(target, draft, sampling=greedy)
    result = SpeculativeDecoder(target, draft, policy="sv").generate(PROMPTS, max_new_tokens=10, sampling=greedy)
    plain = SpeculativeDecoder(target).generate(PROMPTS, max_new_tokens=10, sampling=greedy)
    assert result.sequences == plain.sequences
    assert torch.tensor([k for s in result.stats for k in s.verified]).sum() > 0


def test_from_cache_refuses_a_latency_profile_measured_on_other_kernels(pair, monkeypatch):
    """A profile kept in a cache shared by machines of other kinds (or across a new torch) must not price this
    machine's steps: the kernels it was measured on are in its meta, and another CPU's refuse it."""
    from blockspec import machine
    from blockspec.policy.latency import LatencyProfile, kernels

    target, draft = pair
    _, latency, _, latency_file = save_profiles(target, draft)
    dataclasses.replace(latency, meta={**latency.meta, "kernels": kernels(target)}).save(latency_file)
    assert SVPolicy.from_cache(target, draft, sampling=SAMPLING).latency.meta["kernels"] == kernels(target)
    monkeypatch.setattr(machine, "cpu_model", lambda: "another CPU")
    with pytest.raises(ValueError, match="other kernels than this machine's .*run `blockspec sv profile`"):
        SVPolicy.from_cache(target, draft, sampling=SAMPLING)
    # a profile made before the kernels were recorded cannot tell: it is taken, as before
    latency.save(latency_file)
    assert "kernels" not in LatencyProfile.load(latency_file).meta
    assert SVPolicy.from_cache(target, draft, sampling=SAMPLING).latency.meta == latency.meta
