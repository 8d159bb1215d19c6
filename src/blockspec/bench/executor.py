"""One benchmark run: build the decoder a configuration names, generate, and turn the result into a Record.

Fixed-K runs score every step's draft under both rules (``ExpectedScores``, an ``on_step`` observer): the exact
expected accepted lengths and the draft-target overlap, computed outside the measured time. transformers' own
speculative decoding (``run_assisted``, ``run_lookup``) runs through its ``generate`` on the same models.
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import torch

from .. import defaults, machine
from . import records as rec

if TYPE_CHECKING:
    from .runner import BenchConfig, Run

# hf-lookup's settings: transformers' prompt lookup drafts up to 10 tokens that followed the first earlier match of
# the context's last 2 tokens (else of its last token); 2 is transformers' default, pinned so the records stay true.
LOOKUP = {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2}

# draft with the model auto.choose_arithmetic picked (int8 or not), as `blockspec generate` does by default
AUTO_DRAFT = ("auto", "lookup+model", rec.AUTO_TREE)
NO_DRAFT = ("target-only", "lookup", "hf-lookup")


def tree_of(name: str) -> tuple[int, ...]:
    """The shape of the tree configuration ``name`` ("tree-2,1,1" -> (2, 1, 1)), by the library's rules."""
    from ..checks import parse_tree

    return parse_tree(name.removeprefix(rec.TREE))


def draft_quant_of(name: str, arithmetic) -> str | None:
    """How the draft of configuration ``name`` is quantized, given the machine's ``auto.Arithmetic``: SV's on llama.cpp
    as the auto drafts', what ``blockspec sv`` and ``generate --policy sv`` run there by default (q4_0)."""
    if name == "block-int8":
        return "int8"
    if arithmetic is None:  # no auto configuration on transformers
        return None
    on_llamacpp = arithmetic.dtype == defaults.LLAMACPP_DTYPE  # runner.llamacpp_arithmetic's
    return arithmetic.draft_quant if name in AUTO_DRAFT or (on_llamacpp and name in rec.SV_CONFIGS) else None


class Executor:
    """Runs one planned generation and turns it into a Record; warms each variant up before its first run.
    ``drafts`` maps each draft quantization the configurations use (None: unquantized) to its loaded model;
    ``resolved`` is what the settings resolved to (``provenance.resolve``): dtype, versions, model fingerprints."""

    def __init__(self, target, drafts: dict, config: BenchConfig, resolved: dict, arithmetic=None):
        self.target, self.drafts, self.config, self.arithmetic = target, drafts, config, arithmetic
        self.warm: set[tuple] = set()
        dtype = resolved["dtype"]
        sv_quant = draft_quant_of(rec.SV_CONFIGS[0], arithmetic)  # every SV configuration drafts with the same model
        self.sv = SVSetup(target, config, sv_quant) if set(config.configs) & set(rec.SV_CONFIGS) else None
        self.meta = {
            "target": config.target,
            "draft": config.draft,
            "dtype": dtype,
            "target_quant": config.target_quant,
            "device": config.device,
            **machine.facts(),
            "machine": platform.platform(),
            "processor": platform.processor(),
            "versions": resolved["versions"],
            "models": resolved["models"],
        }

    def warm_up(self, item: Run) -> None:
        """A short generation of this variant (B copies of a short prompt, 8 tokens), once, outside the records."""
        variant = (item.config, item.max_draft, item.temperature, item.batch_size)
        if variant in self.warm:
            return
        prompt = tuple(self.target.tokenizer("Hello")["input_ids"])
        copies = {"prompt_ids": ("warm-up",) * item.batch_size, "prompts": (prompt,) * item.batch_size}
        self._generate(replace(item, dataset="warm-up", seed=0, **copies), 8)
        self.warm.add(variant)  # only once it went: a variant whose warm-up raised warms up before its next run

    def __call__(self, item: Run) -> rec.Record:
        self.warm_up(item)
        start = machine.cpu_clock()
        result = self._generate(item, self.config.max_new_tokens)
        return self._record(item, result, machine.others_load(start, machine.cpu_clock()))

    def failed(self, item: Run, error: Exception) -> rec.Record:
        """The record of a run that raised ``error``: no measurement."""
        return self._record(
            item,
            {
                "new_tokens": 0,
                "wall_time": 0.0,
                "prefill_time": None,
                "status": rec.FAILED,
                "error": f"{type(error).__name__}: {error}",
            },
        )

    def _record(self, item: Run, result: dict, load: dict | None = None) -> rec.Record:
        """A record of ``result`` (Record fields), with the CPU ``load`` of other processes in its meta."""
        meta = {**self.meta, **(load or {}), "date": datetime.now(UTC).isoformat(timespec="seconds")}
        if self.sv is not None and item.config in rec.SV_CONFIGS:
            meta.update(self.sv.meta(item))
        if item.config == "hf-lookup":
            meta["prompt_lookup"] = dict(LOOKUP)
        if item.config not in NO_DRAFT:
            meta["draft_quant"] = draft_quant_of(item.config, self.arithmetic)
        if rec.is_tree(item.config):
            meta["tree"] = list(tree_of(item.config))
        if item.config == rec.AUTO_TREE:
            meta["tree"] = "auto"
        if rec.is_paths(item.config):
            paths, drawn = rec.paths_of(item.config)
            meta["paths"] = {"paths": paths, "length": item.max_draft, "drawn": drawn}
        return rec.Record(
            dataset=item.dataset,
            prompt_id=item.prompt_id,
            config=item.config,
            max_draft=item.max_draft,
            temperature=item.temperature,
            batch_size=item.batch_size,
            seed=item.seed,
            prompt_ids=list(item.prompt_ids),
            draft_temperature=item.draft_temperature,
            **result,
            meta=meta,
        )

    def _decoder(self, item: Run):
        from ..auto import default_decoder, latency_probe
        from ..engine import SpeculativeDecoder

        draft = None if item.config in NO_DRAFT else self.drafts[draft_quant_of(item.config, self.arithmetic)]
        if item.config == "target-only":
            return SpeculativeDecoder(self.target)
        if rec.is_tree(item.config):  # the library's default rule, in its tree form
            return SpeculativeDecoder(self.target, draft, tree=tree_of(item.config))
        if item.config == rec.AUTO_TREE:  # as `generate --tree auto` decides, with fresh estimates per run
            from ..policy.shapes import AdaptiveShape

            shape = AdaptiveShape(latency_probe(self.target, draft, item.batch_size), max_draft=item.max_draft)
            return SpeculativeDecoder(self.target, draft, tree=shape)
        if rec.is_paths(item.config):  # the same rule, on the tree the paths form
            paths, drawn = rec.paths_of(item.config)
            return SpeculativeDecoder(self.target, draft, paths=paths, max_draft=item.max_draft, paths_drawn=drawn)
        if item.config in rec.FIXED_CONFIGS:
            rule = item.config.removesuffix("-int8")
            return SpeculativeDecoder(self.target, draft, rule=rule, max_draft=item.max_draft)
        if item.config in rec.ADAPTIVE_CONFIGS:  # as `blockspec generate` decides, with a fresh policy per run
            lookup = item.config != "auto"
            return default_decoder(
                self.target, draft, batch_size=item.batch_size, lookup=lookup, max_draft=item.max_draft
            )
        assert self.sv is not None, f"{item.config} is not a configuration of this bench"
        policy, companion, rule = self.sv.policy(item)  # a fresh policy: no history across runs
        return SpeculativeDecoder(
            self.target, draft, rule=rule, max_draft=item.max_draft, policy=policy, companion=companion
        )

    def _generate(self, item: Run, max_new_tokens: int) -> dict:
        from ..sampling import SamplingParams

        sampling = SamplingParams(temperature=item.temperature)
        draft_sampling = None if item.draft_temperature is None else SamplingParams(item.draft_temperature)
        if item.config == "hf-assisted":
            return run_assisted(
                self.target, self.drafts[None], list(item.prompts[0]), sampling, max_new_tokens, item.seed
            )
        if item.config == "hf-lookup":
            return run_lookup(self.target, list(item.prompts[0]), sampling, max_new_tokens, item.seed)
        decoder = self._decoder(item)
        scores = ExpectedScores() if item.config in rec.FIXED_CONFIGS else None
        result = decoder.generate(
            [list(p) for p in item.prompts],
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            draft_sampling=draft_sampling,
            seed=item.seed,
            on_step=scores,
        )
        steps = result.stats  # per-row lists flattened in step order, then row order
        return {
            "new_tokens": result.new_tokens,
            "wall_time": result.wall_time - (scores.seconds if scores else 0.0),  # the scoring is not decoding
            "prefill_time": result.prefill_s,
            "accepted": [a for s in steps for a in s.accepted],
            "verified": [k for s in steps for k in s.verified],
            "expected_token": scores.expected["token"] if scores else [],
            "expected_block": scores.expected["block"] if scores else [],
            # NaN (a row-step that verified nothing) is not JSON: stored as null
            "overlap": [None if math.isnan(o) else o for o in scores.overlap] if scores else [],
            "drafted": [s.drafted for s in steps],
            "rows": [len(s.rows) for s in steps],
            "finish_reason": result.finish_reasons[0],
            "finish_reasons": list(result.finish_reasons),
        }


class ExpectedScores:
    """An ``on_step`` observer: per step and row, E[tau | this draft] under the token and the block rule, and the
    mean over verified positions of sum_v min(draft, target); ``seconds`` it spent, to take off the wall clock."""

    def __init__(self):
        self.expected: dict[str, list[float]] = {"token": [], "block": []}
        self.overlap: list[float] = []
        self.seconds = 0.0

    def __call__(self, step, proposal, target_probs: torch.Tensor) -> None:
        from ..verify import agreement, draft_distributions, expected_accepted
        from ..verify.base import verified_mask

        start = time.perf_counter()
        tokens, verified = proposal.tokens, proposal.verified.to(proposal.tokens.device)
        for rule, values in self.expected.items():
            values += expected_accepted(tokens, proposal.probs, target_probs, rule, verified, validate=False).tolist()
        probs = draft_distributions(tokens, proposal.probs, target_probs.shape[-1])  # [B, W, V]
        mask = verified_mask(verified, tokens.shape[1])  # [B, W]
        summed = (agreement(probs, target_probs[:, : tokens.shape[1]]) * mask).sum(1)
        self.overlap += (summed / mask.sum(1).clamp(min=1)).where(mask.any(1), float("nan")).tolist()
        self.seconds += time.perf_counter() - start


class SVSetup:
    """The SV pieces shared by every SV run: calibration profiles (one per temperature), the latency profile and
    the companion, loaded and checked once, before the first run, so a missing profile fails fast."""

    SPEC = {"sv-token": ("token", "companion"), "sv-block": ("block", "companion"), "sv-draft": ("block", "draft")}

    def __init__(self, target, config: BenchConfig, draft_quant: str | None):
        """As ``SVPolicy.from_cache`` finds them for the loaded target: by the models' names as the profiles know them
        (``run_name``: on llama.cpp with the backend and the draft's ``draft_quant``), the target's dtype and device;
        on llama.cpp without a companion (runner.llamacpp_arithmetic refuses the companion configurations there)."""
        from ..models.companion import load_companion
        from ..models.llamacpp import LlamaCppModel
        from ..policy.latency import dtype_name, kernels
        from ..policy.profiles import run_name
        from ..policy.sv import load_calibration, load_latency
        from ..sampling import SamplingParams

        backend = "llamacpp" if isinstance(target, LlamaCppModel) else "hf"
        names = run_name(config.target, backend), run_name(config.draft, backend, draft_quant)
        companion = None if backend == "llamacpp" else config.companion
        self.config, self.companion_name, self.profiles, self.paths = config, companion, {}, {}
        for temperature in config.temperatures:
            sampling = SamplingParams(temperature=temperature)
            profile, path = load_calibration(*names, companion, sampling, config.sv_profile)
            self.profiles[temperature], self.paths[temperature] = profile, str(path)
        dtype = dtype_name(target.dtype)
        self.latency, path = load_latency(*names, companion, dtype, target.device, config.latency, kernels(target))
        self.latency_path = str(path)
        needs_companion = bool({"sv-token", "sv-block"} & set(config.configs))
        self.companion = (
            load_companion(
                config.companion, target, dtype=dtype, device=config.device, allow_download=config.allow_download
            )
            if needs_companion  # on transformers only
            else None
        )

    def policy(self, item: Run):
        """(a fresh SVPolicy, the companion or None, the verification rule) for this run."""
        from ..policy import SVPolicy

        rule, kind = self.SPEC[item.config]
        policy = SVPolicy(self.profiles[item.temperature], self.latency, rule=rule, max_draft=item.max_draft, kind=kind)
        return policy, (self.companion if kind == "companion" else None), rule

    def meta(self, item: Run) -> dict:
        return {
            "companion": self.companion_name,
            "sv_profile": self.paths[item.temperature],
            "latency": self.latency_path,
        }


def run_assisted(target, draft, prompt: list[int], sampling, max_new_tokens: int, seed: int) -> dict:
    """transformers' own assisted generation (its default assistant schedule) on the same models and sampling."""
    return hf_generate(target, prompt, sampling, max_new_tokens, seed, assistant_model=draft.model)


def run_lookup(target, prompt: list[int], sampling, max_new_tokens: int, seed: int) -> dict:
    """transformers' prompt lookup decoding (``LOOKUP``) on the target and the same sampling: drafts copied from
    the context, verified by the target (greedy: kept while they equal its argmax; sampled: while they equal its
    samples, which keeps its distribution)."""
    return hf_generate(target, prompt, sampling, max_new_tokens, seed, **LOOKUP)


def hf_generate(target, prompt: list[int], sampling, max_new_tokens: int, seed: int, **drafting) -> dict:
    """One row through the target's transformers ``generate`` with ``drafting`` options, as Record fields."""
    torch.manual_seed(seed)  # transformers samples from the global generator (top_k=0 disables its default 50)
    ids = torch.tensor([prompt], device=target.device)
    options = (
        {"do_sample": False}
        if sampling.greedy
        else {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
    )
    start = time.perf_counter()
    out = target.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        eos_token_id=list(target.eos_token_ids),
        pad_token_id=target.eos_token_ids[0],
        **drafting,
        **options,
    )
    new = out[0, len(prompt) :].tolist()
    reason = "eos" if new and new[-1] in target.eos_token_ids else "length"
    return {
        "new_tokens": len(new),
        "wall_time": time.perf_counter() - start,
        "prefill_time": None,
        "finish_reason": reason,
        "finish_reasons": [reason],
    }
