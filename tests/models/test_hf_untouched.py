"""HFModel leaves the caller's transformers model as it found it: eval mode and grouped_sdpa hold only during
HFModel's own forwards, so the model's own ``generate`` runs transformers' kernels; attention the explicit slot
mask cannot express is refused, with the model's name and the reason."""

from __future__ import annotations

import collections
import copy
import re

import pytest
import torch
from kits.tiny import tiny_model
from transformers import AttentionInterface

from blockspec.models.attention import GROUPED_SDPA
from blockspec.models.companion import target_prefix
from blockspec.models.hf import HFModel

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
VALID = torch.tensor([[True, True, True], [True, False, True], [True, True, False]])  # [B, 3]: two holes


def settings(model) -> tuple[list[bool], str]:
    """Every module's training flag, and the config's attention implementation."""
    return [module.training for module in model.modules()], model.config._attn_implementation


def drive(adapter: HFModel) -> list[torch.Tensor]:
    """Prefill PROMPTS, then three forwards of 3 tokens per row (with holes), each followed by a rollback."""
    gen = torch.Generator().manual_seed(0)
    adapter.prefill(PROMPTS)
    logits = []
    for _ in range(3):
        logits.append(adapter.forward(torch.randint(1, 40, VALID.shape, generator=gen), VALID))  # [B, 3, V]
        adapter.rollback((adapter.lengths - 1).clamp(min=1))
    return logits


@pytest.fixture
def kernels(monkeypatch):
    """Calls, by name, to grouped_sdpa and to transformers' sdpa through the attention registry (grouped_sdpa's
    own fallback calls sdpa directly, so an "sdpa" call is one the model's config asked for)."""
    calls = collections.Counter()
    for name in (GROUPED_SDPA, "sdpa"):

        def spy(*args, _name=name, _kernel=AttentionInterface._global_mapping[name], **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setitem(AttentionInterface._global_mapping, name, spy)
    return calls


# --- the caller's training flags and attention implementation survive wrapping and forwards ----------------


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("training", [False, True])
def test_wrapping_and_forwarding_leave_the_callers_training_flags_and_attention(implementation, training):
    model = tiny_model()
    model.set_attn_implementation(implementation)
    if training:
        model.train()
        model.model.layers[0].eval()  # a mix of train and eval flags must come back flag by flag
    before = settings(model)
    adapter = HFModel(model)
    assert settings(model) == before
    drive(adapter)
    assert settings(model) == before


# --- HFModel's own forwards still run grouped_sdpa, with the logits of the permanent switch of before --------


def test_forwards_run_grouped_sdpa_and_give_the_logits_of_a_model_switched_for_good(kernels):
    model = tiny_model(sharpness=5.0)
    switched = copy.deepcopy(model)
    switched.set_attn_implementation(GROUPED_SDPA)  # what HFModel.__init__ once did to the caller's model
    ours = drive(HFModel(model))
    assert kernels[GROUPED_SDPA] > 0 and kernels["sdpa"] == 0
    before = drive(HFModel(switched))
    assert all(torch.equal(a, b) for a, b in zip(ours, before))  # float32, bit for bit


def test_a_target_prefix_companion_runs_grouped_sdpa_in_the_layers_it_shares_with_the_target(kernels):
    model = tiny_model(layers=3)
    companion = target_prefix(HFModel(model), 2)  # its layers are the target's, and read the target's config
    drive(companion)
    assert kernels[GROUPED_SDPA] > 0 and kernels["sdpa"] == 0
    assert model.config._attn_implementation == "sdpa"


# --- transformers' generate on a wrapped model is the stock one --------------------------------------------


def test_generate_on_a_wrapped_model_equals_generate_on_an_unwrapped_copy(kernels):
    model = tiny_model(sharpness=5.0)
    unwrapped = copy.deepcopy(model)
    drive(HFModel(model))
    kernels.clear()
    ids = torch.tensor([[0, 0, 1, 2, 3, 4], [5, 6, 7, 8, 9, 10]])  # row 0 left-padded: a 4D mask in the prefill
    options = dict(
        attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]),
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    wrapped = model.generate(ids, **options)
    assert kernels[GROUPED_SDPA] == 0 and kernels["sdpa"] > 0
    reference = unwrapped.generate(ids, **options)
    assert torch.equal(wrapped.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(wrapped.logits, reference.logits))


# --- a forward that raises restores the caller's settings too ------------------------------------------------


def test_a_forward_that_raises_still_restores_the_callers_settings(monkeypatch):
    model = tiny_model()
    model.train()
    before = settings(model)
    adapter = HFModel(model)

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failure")

    monkeypatch.setitem(AttentionInterface._global_mapping, GROUPED_SDPA, broken)  # raises mid-forward, switched
    with pytest.raises(RuntimeError, match="kernel failure"):
        adapter.prefill(PROMPTS)
    assert settings(model) == before


# --- attention the slot mask cannot express is refused; windows a row cannot outgrow are not ------------------


@pytest.mark.parametrize(
    "implementation",
    [
        "flash_attention_2",
        "flash_attention_3",
        "flash_attention_4",
        "kernels-community/flash-attn2",
        "paged|eager",
        "flex_attention",
    ],
)
def test_attention_implementations_not_known_to_apply_an_explicit_4d_mask_are_refused(implementation):
    model = tiny_model()
    model.config._attn_implementation = implementation  # as loading with it sets it (its kernels are not installed)
    pattern = f"Qwen2ForCausalLM: attention implementation '{re.escape(implementation)}' is not supported"
    with pytest.raises(ValueError, match=pattern):
        HFModel(model)


def build(family: str, **options):
    """A tiny model of transformers family ``family`` (Mistral, Qwen2, ...): two layers, 4 query heads sharing 2
    key/value heads, a context of 256, and config ``options``."""
    import transformers

    config_class, model_class = (getattr(transformers, family + suffix) for suffix in ("Config", "ForCausalLM"))
    torch.manual_seed(0)
    return model_class(
        config_class(
            vocab_size=48,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            **options,
        )
    ).eval()


def carrying_a_switched_off_window(family: str, **options):
    """Qwen2.5's hub configs say sliding_window=32768 with use_sliding_window=False; the config classes drop such
    a window, a config edited afterwards carries it."""
    model = build(family, use_sliding_window=False, **options)
    model.config.sliding_window = 16
    return model


def test_a_sliding_window_shorter_than_the_context_is_refused():
    with pytest.raises(
        ValueError,
        match="MistralForCausalLM: sliding_attention over a window of 16 tokens, shorter "
        "than the context of 256, is not supported",
    ):
        HFModel(build("Mistral", sliding_window=16))  # no layer types: config.sliding_window applies to every layer
    with pytest.raises(ValueError, match="Qwen2ForCausalLM: sliding_attention over a window of 16 tokens"):
        HFModel(build("Qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1))  # 2nd layer slides


def test_layer_types_other_than_full_and_sliding_attention_are_refused():
    model = tiny_model()
    model.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM: attention layers of type \['linear_attention'\]"):
        HFModel(model)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: build("Mistral", sliding_window=256), id="window-as-long-as-the-context"),
        pytest.param(lambda: carrying_a_switched_off_window("Qwen2"), id="qwen2-switched-off-all-layers-full"),
        pytest.param(
            lambda: carrying_a_switched_off_window(
                "Qwen3Moe", head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2
            ),
            id="qwen3-moe-switched-off-no-layer-types",
        ),
    ],
)
def test_windows_that_never_bind_load_and_give_full_attention(make):
    model = make()
    adapter = HFModel(model)
    adapter.prefill([[1, 2, 3, 4, 5]])
    logits = adapter.forward(torch.tensor([[6, 7]]), torch.ones(1, 2, dtype=torch.bool))
    fresh = model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]])).logits[:, 5:]  # no cache, no explicit mask
    torch.testing.assert_close(logits, fresh, atol=1e-5, rtol=1e-5)
