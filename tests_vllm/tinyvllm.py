"""A tiny target and draft for vLLM, built in-process: Llama models over a 16-token WordLevel tokenizer, saved
in float32, and the target's exact joint law of its first tokens computed from the same weights.

With 16 tokens the joint law of 3 tokens has 4096 cells, few enough to test by chi-square against samples.
The functions taking a ``worker`` run in vLLM's worker (``llm.collective_rpc``): they put one of the plugin's
pieces, or a broken variant of it, in place there.
"""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path

import torch
from kits import lawkit
from kits.tiny import exact_law_of_first_tokens

VOCAB = 16
WORDS = ["<pad>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
PROMPT = [2, 5, 9]  # token ids: the prompt is given to vLLM as ids, so no tokenizer decides it
SAMPLES, LENGTH = 6000, 3  # the engine law tests: rows, and tokens of each row whose joint law is tested


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def model(seed: int, noise: float = 0.0, base_seed: int | None = None):
    """A float32 Llama; with ``noise``, the model of ``base_seed`` with Gaussian noise on every weight."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed if base_seed is None else base_seed)
    built = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        built.lm_head.weight.mul_(12.0)  # laws peaked enough that a 3-token outcome has few likely cells
        if noise:
            generator = torch.Generator().manual_seed(seed)
            for param in built.parameters():
                param.add_(noise * param.std() * torch.randn(param.shape, generator=generator))
    return built


def save(directory: Path) -> tuple[str, str]:
    """(target path, draft path): the target and a draft that agrees with it often but not always."""
    paths = []
    for name, built in (("target", model(0)), ("draft", model(1, noise=0.5, base_seed=0))):
        path = directory / name
        built.save_pretrained(path)
        tokenizer().save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]


def load(path: str):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def exact_law(
    path: str, length: int, repetition_penalty: float = 1.0, allowed: list[int] | None = None
) -> torch.Tensor:
    """The saved model's exact joint law of its first ``length`` tokens after PROMPT, [V] * length float64 (with
    ``allowed``: restricted to those tokens at every position)."""
    return exact_law_of_first_tokens(load(path), PROMPT, length, repetition_penalty, allowed)


def greedy_continuation(path: str, length: int) -> list[int]:
    built = load(path)
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in range(length):
            tokens.append(int(built(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(PROMPT) :]


def law_test(sequences, law: torch.Tensor) -> lawkit.ChiSquare:
    """Chi-square of sampled sequences against an exact joint law, cells expected fewer than 5 times pooled."""
    counts = lawkit.joint_counts(sequences, VOCAB)
    groups = lawkit.sparse_cell_groups(law, len(sequences))
    return lawkit.chi_square(lawkit.pool_cells(counts, groups), lawkit.pool_cells(law, groups))


def start(
    directory: Path,
    rule: str | None,
    num_speculative_tokens: int = 2,
    schedule: list[tuple[int, int, int]] | None = None,
    draft_sample_method: str = "probabilistic",
    asynchronous: bool = False,
    **engine,
):
    """vLLM's offline engine on the tiny pair, float32, drafting with probabilities unless ``draft_sample_method``
    says otherwise (``num_speculative_tokens`` 0:
    the target alone; ``schedule``: vLLM's batch-size schedule of K, ``num_speculative_tokens_per_batch_size``);
    the worker process inherits ``BLOCKSPEC_VLLM_RULE`` = ``rule`` (None: unset, vLLM as shipped). ``engine``:
    more of ``LLM``'s arguments. ``asynchronous``: vLLM's ``AsyncLLM``, the engine its OpenAI server runs, in
    place of ``LLM``."""
    import os

    from vllm import LLM, AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    target, draft = save(directory)
    os.environ.pop("BLOCKSPEC_VLLM_RULE", None)
    if rule:
        os.environ["BLOCKSPEC_VLLM_RULE"] = rule
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # lets the tests send functions to the worker (below)
    try:
        speculative = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": num_speculative_tokens,
            "draft_sample_method": draft_sample_method,
            "rejection_sample_method": "standard",
            "num_speculative_tokens_per_batch_size": schedule,
        }
        arguments = {
            "model": target,
            "dtype": "float32",
            "max_model_len": 64,
            "seed": 0,
            "enforce_eager": True,
            "speculative_config": speculative if num_speculative_tokens else None,
            **engine,
        }
        if asynchronous:
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**arguments))
        return LLM(**arguments)
    finally:
        os.environ.pop("BLOCKSPEC_VLLM_RULE", None)


def long_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` token ids (none of them <pad> or <eos>), random from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (count, length), generator=generator).tolist()


def continuations(
    llm, prompts: list[list[int]], length: int, seeds: list[int] | None = None, **params
) -> list[list[int]]:
    """One request per prompt, all submitted at once, ``length`` tokens each (EOS ignored); with ``seeds``,
    request i has seed ``seeds[i]``. Their tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(max_tokens=length, ignore_eos=True, seed=seed, **params)
        for seed in (seeds or [None] * len(prompts))
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in prompts], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def first_tokens(llm, samples: int, length: int, seeds: list[int] | None = None, **params) -> list[list[int]]:
    """``samples`` continuations of PROMPT."""
    return continuations(llm, [PROMPT] * samples, length, seeds, **params)


def arriving_first_tokens(llm, samples: int, length: int, arrivals: int, seed: int, **params) -> list[list[int]]:
    """``samples`` continuations of PROMPT (``length`` tokens, EOS ignored) that arrive while others are decoded:
    before each engine step, 0 (1 when none is in flight) to ``arrivals`` new requests, uniformly, drawn from
    ``seed``, so the number of requests in a step changes from step to step. Their tokens, in order of arrival."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine, draw, submitted, finished = llm.llm_engine, random.Random(seed), 0, {}
    while len(finished) < samples:
        arriving = draw.randint(0 if engine.has_unfinished_requests() else 1, arrivals)  # a step waits for work
        for _ in range(min(arriving, samples - submitted)):
            engine.add_request(
                f"arriving-{submitted}",
                TokensPrompt(prompt_token_ids=PROMPT),
                SamplingParams(max_tokens=length, ignore_eos=True, **params),
            )
            submitted += 1
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    return [finished[f"arriving-{i}"] for i in range(samples)]


SCHEDULED_K = collections.Counter()  # in vLLM's worker: steps by the number of tokens the scheduler asked to draft


def count_scheduled_k(worker, counting: bool) -> dict[int, int]:
    """Run in vLLM's worker by ``llm.collective_rpc``: count the steps by the K the scheduler asks the drafter for
    (``counting``: from zero on; else stop). The counts so far."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock = getattr(GPUModelRunner.execute_model, "stock", GPUModelRunner.execute_model)

    def counted(self, scheduler_output, *args, **kwargs):
        if scheduler_output.total_num_scheduled_tokens:
            SCHEDULED_K[scheduler_output.num_spec_tokens_to_schedule] += 1
        return stock(self, scheduler_output, *args, **kwargs)

    counted.stock = stock
    if counting:
        SCHEDULED_K.clear()
    GPUModelRunner.execute_model = counted if counting else stock
    return dict(SCHEDULED_K)


def draft_sampler(worker, kind: str) -> None:
    """Run in vLLM's worker by ``llm.collective_rpc``: put a draft sampler in place, one of
    "request seeds"  the plugin's, which draws a seeded request's drafts from its own generator
    "global"         vLLM's own, which draws them from the global generator
    "replayed"       broken: the request's draws taken from a copy of its generator, so that the verifier draws
                     the same numbers again for its uniforms."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from blockspec.vllm.fixes import draft_with_request_seeds

    samplers = {
        "request seeds": draft_with_request_seeds,
        "global": draft_with_request_seeds.stock,
        "replayed": replayed_draws,
    }
    SpecDecodeBaseProposer._sample_from_logits = samplers[kind]


def replayed_draws(self, logits, sampling_metadata):
    from blockspec.vllm.fixes import draft_with_request_seeds

    generators = {
        request: torch.Generator().set_state(generator.get_state())
        for request, generator in sampling_metadata.generators.items()
    }
    return draft_with_request_seeds(self, logits, dataclasses.replace(sampling_metadata, generators=generators))


def chunk_sampler(worker, kind: str) -> None:
    """Run in vLLM's worker by ``llm.collective_rpc``: the plugin's sampling step, which draws a prefill chunk's
    discarded sample of a seeded request from a copy of its generator ("apart"), or a broken one that lets the
    request's own generator take those draws ("consumed", what a rewind that does nothing would leave)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from blockspec.vllm.fixes import sample_with_chunk_draws_apart

    GPUModelRunner.sample_tokens = {"apart": sample_with_chunk_draws_apart, "consumed": draws_consumed}[kind]


def draws_consumed(self, grammar_output):
    """vLLM's sampling step with every seeded request's draws, a discarded chunk sample's too, left in its generator."""
    from blockspec.vllm.fixes import ChunkDraws, sample_with_chunk_draws_apart

    generators = self.input_batch.generators
    own = dict(generators)
    generators.update({request: ChunkDraws(generator) for request, generator in own.items()})
    try:
        return sample_with_chunk_draws_apart.stock(self, grammar_output)
    finally:
        for request, generator in own.items():
            generator.set_state(generators[request].get_state())
            generators[request] = generator


def draft_cut(worker, min_prob: float | None, kind: str) -> None:
    """Run in vLLM's worker by ``llm.collective_rpc``: verify drafts only while the draft's top probability is at
    least ``min_prob`` (None: verify all), the plugin's stopping rule ("top probability"), or a broken cut that
    looks at the drafted token's own probability ("drafted token's probability": not a stopping rule)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from blockspec.vllm.state import STATE
    from blockspec.vllm.sv_hook import plan_drafts

    STATE.min_prob = min_prob
    GPUModelRunner.propose_draft_token_ids = {
        "top probability": plan_drafts,
        "drafted token's probability": cut_by_drafted_token,
    }[kind]


def cut_by_drafted_token(self, *args, **kwargs):
    from blockspec.vllm.state import STATE
    from blockspec.vllm.sv_hook import plan_drafts

    drafts = plan_drafts.stock(self, *args, **kwargs)
    if not torch.is_tensor(drafts) or self._draft_probs is None:
        return drafts
    probs = self._draft_probs[: len(drafts), : drafts.shape[1]]
    drawn = probs.gather(-1, drafts.long()[..., None]).squeeze(-1)
    lengths = (drawn >= STATE.min_prob).cumprod(-1).sum(-1).tolist()
    return [row[:length] for row, length in zip(drafts.tolist(), lengths)]


def sv_profiles(directory: Path, drafting: float, prior: float, llm) -> tuple[str, str]:
    """SV's profiles for the tiny pair, made by hand: a calibration whose block-rule gain is about 1 where the
    draft's top probability is above 0.3 and about 0 below, expected to be ``prior`` at every position before any
    step, and a latency where each verified token costs a fifth of a step and one draft forward ``drafting`` steps,
    "measured" on the models, dtype and device the engine ``llm`` serves. (calibration path, latency path)."""
    from blockspec.policy.base import LatencyTable
    from blockspec.policy.features import DRAFT_FEATURES
    from blockspec.policy.latency import META_FIELDS, LatencyProfile
    from blockspec.policy.predictor import Predictor, Profile

    weights = dict.fromkeys(DRAFT_FEATURES, 0.0) | {"bias": 12.0, "log_max_prob": 10.0}  # logit 10 log(m / 0.3)
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    calibration = Profile(
        "target",
        "draft",
        None,
        sampling,
        {"block": {"draft": Predictor(DRAFT_FEATURES, tuple(weights.values()))}},
        {"block": [prior, prior]},
    )
    steps = LatencyTable((1, 64), (1, 2, 3), ((1.0, 1.2, 1.4), (1.0, 1.2, 1.4)))
    served = {
        "target": llm.llm_engine.model_config.model,
        "draft": llm.llm_engine.vllm_config.speculative_config.model,
        "dtype": "float32",
        "device": "cpu",
    }
    latency = LatencyProfile(
        steps,
        LatencyTable((1, 64), (1, 2, 3), ((drafting,) * 3, (drafting,) * 3)),
        None,
        dict.fromkeys(META_FIELDS, "tiny") | served,
    )
    paths = str(directory / "calibration.json"), str(directory / "latency.json")
    calibration.save(paths[0])
    latency.save(paths[1])
    return paths


def sv(worker, paths: tuple[str, str] | None, looks_at_x_i: bool = False) -> None:
    """Run in vLLM's worker by ``llm.collective_rpc``: SV with the profiles at ``paths`` (None: no SV), by the
    plugin's stopping rule, or a broken SV that reads the drafted token's own probability in place of the
    draft's top probability (``looks_at_x_i``: not a stopping rule)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from blockspec.vllm.sv_hook import plan_drafts, use_sv

    use_sv(paths)
    GPUModelRunner.propose_draft_token_ids = sv_reading_x_i if looks_at_x_i else plan_drafts


def sv_reading_x_i(self, scheduler_output, *args, **kwargs):
    from blockspec.policy.features import DRAFT_FEATURES, draft_features, prefix_logprob
    from blockspec.vllm.sv_hook import plan_drafts, sv_policy

    policy = sv_policy(self)
    policy.draft_budget(self.input_batch.num_reqs, 1)
    drafts = plan_drafts.stock(self, scheduler_output, *args, **kwargs)
    if not torch.is_tensor(drafts) or self._draft_probs is None:
        return drafts
    drafts = drafts.long()
    probs = self._draft_probs[: len(drafts), : drafts.shape[1]]
    features = draft_features(probs, prefix_logprob(drafts, probs))
    drawn = probs.gather(-1, drafts[..., None]).squeeze(-1)
    features[..., DRAFT_FEATURES.index("log_max_prob")] = drawn.clamp(min=1e-6).log()  # THE BREAK
    lengths = policy.lengths_given(features, torch.full((len(drafts),), drafts.shape[1])).tolist()
    return [row[:length] for row, length in zip(drafts.tolist(), lengths)]


def verification_rule(worker, rule: str) -> None:
    """Run in vLLM's worker by ``llm.collective_rpc``: verify sampled drafts by the plugin's block rule ("block")
    or by vLLM's own token rule ("token")."""
    import vllm.v1.sample.rejection_sampler as sampler

    from blockspec.vllm.rejection import block_rejection_sample

    sampler.rejection_sample = {"block": block_rejection_sample, "token": block_rejection_sample.stock}[rule]


def acceptance_counters(worker) -> dict[str, dict[str, float]]:
    """Run in vLLM's worker by ``llm.collective_rpc``: the plugin's Prometheus counters there, by rule."""
    from prometheus_client import REGISTRY

    counters = {"drafted": {}, "accepted": {}, "expected": {}}
    for metric in REGISTRY.collect():
        for key, name in (
            ("drafted", "blockspec_vllm_drafted_tokens"),
            ("accepted", "blockspec_vllm_accepted_tokens"),
            ("expected", "blockspec_vllm_expected_accepted_tokens"),
        ):
            if metric.name == name:
                for sample in metric.samples:
                    if sample.name == f"{name}_total":
                        counters[key][sample.labels["rule"]] = sample.value
    return counters
