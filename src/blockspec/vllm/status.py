# vLLM lives in its own environment (scripts/setup_vllm.sh), not in the one pyright checks:
# pyright: reportMissingImports=false
"""What each vLLM worker runs and has counted (``worker_status``, a method the plugin adds to vLLM's workers), and
the checks built on it: vLLM only logs a plugin that fails to import, so ``check(llm)`` and ``check_server(url)``
ask every worker which rule it runs and raise unless it is the one asked for."""

from __future__ import annotations

from ..verify import SAMPLED_RULES
from .fixes import draft_with_request_seeds, expand_in_place
from .rejection import block_rejection_sample
from .state import STATE
from .switches import SWITCH, requested_rule

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"  # the name vLLM registers its kernel under


def worker_status(self) -> dict:
    """Which verification rule, model runner, expand kernel and draft sampler this worker runs, how many steps with
    sampled requests it verified by each rule, how many chunk samples it drew apart, the stopping rule in place with the
    tokens it saw drafted and kept, the analytic sums, and the drafted and accepted tokens by rule (``STATE``);
    ``check`` calls it on every worker."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils.dispatcher import _registry
    from vllm.v1.sample import rejection_sampler as sampler
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    expand = _registry.get(EXPAND_KERNEL, (None, None))[1]
    seeded = SpecDecodeBaseProposer._sample_from_logits is draft_with_request_seeds
    runner = getattr(self, "model_runner", None)
    kind = type(runner)
    return {
        "rule": STATE.rule if sampler.rejection_sample is block_rejection_sample else "token",
        # vLLM's Model Runner V2 (GPU, VLLM_USE_V2_MODEL_RUNNER) has its own sampler: none of the plugin's steps run
        "runner": "v1"
        if isinstance(runner, GPUModelRunner)
        else ("none" if runner is None else f"{kind.__module__}.{kind.__qualname__}"),
        "expand": "triton" if HAS_TRITON else ("fixed" if expand is expand_in_place else "stock"),
        "drafts": "request seeds" if seeded else "global",
        "steps": dict(STATE.steps),
        "chunks": {"drawn apart": STATE.chunks_drawn_apart},
        "cut": {
            "min_prob": STATE.min_prob,
            "sv": STATE.sv_paths,
            "skipped": STATE.skipped,
            "drafted": STATE.drafted,
            "verified": STATE.verified,
            "offset": STATE.offset,
        },
        "analytic": {"rows": STATE.analytic_rows, **STATE.expected},
        "acceptance": {rule: dict(sums) for rule, sums in STATE.acceptance.items()},
    }


def check(llm, rule: str | None = None, *, verified: bool = False) -> list[dict]:
    """Raise unless every worker of the vLLM ``LLM`` runs ``rule`` (default: what ``BLOCKSPEC_VLLM_RULE`` asks)
    on vLLM's V1 model runner with a working expand kernel and seeded drafts, and, with ``verified`` (after
    serving sampled requests with drafts), unless the rule has verified some of their steps; returns the workers'
    statuses."""
    rule = asked(rule)
    try:
        statuses = llm.collective_rpc("blockspec_status")
    except Exception as error:  # an AttributeError raised in the worker comes back wrapped
        raise RuntimeError(
            f"blockspec's vLLM plugin is not loaded in vLLM's worker ({error}); is blockspec "
            f"installed in vLLM's environment and {SWITCH} set where vLLM starts?"
        ) from error
    return require(statuses, rule, verified)


def check_server(url: str, rule: str | None = None, timeout: float = 60, *, verified: bool = False) -> list[dict]:
    """``check`` for a running ``vllm serve`` at ``url`` (e.g. http://127.0.0.1:8000), through its development
    endpoint /collective_rpc, which vLLM serves only when started with VLLM_SERVER_DEV_MODE=1 (it lets any
    client call methods of the workers: serve it on a trusted network only)."""
    import json
    import urllib.error
    import urllib.request

    rule = asked(rule)
    request = urllib.request.Request(
        url.rstrip("/") + "/collective_rpc",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"method": "blockspec_status"}).encode(),
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            statuses = json.loads(response.read())["results"]
    except urllib.error.HTTPError as error:
        hint = (
            "start vllm serve with VLLM_SERVER_DEV_MODE=1"
            if error.code == 404
            else f"is blockspec installed in vLLM's environment and {SWITCH} set where vLLM starts?"
        )
        raise RuntimeError(f"{url}: no blockspec status from vLLM's workers (HTTP {error.code}); {hint}") from error
    return require(statuses, rule, verified)


def asked(rule: str | None) -> str:
    """``rule``, or the one ``BLOCKSPEC_VLLM_RULE`` asks for; a ValueError when neither names one."""
    rule = rule or requested_rule()
    if rule not in SAMPLED_RULES:
        raise ValueError(f"check: no rule asked for (set {SWITCH} to one of {', '.join(SAMPLED_RULES)})")
    return rule


def require(statuses: list[dict], rule: str, verified: bool = False) -> list[dict]:
    """``statuses``, unless one of them runs another rule, another model runner than vLLM's V1 (whose rejection
    sampler the plugin replaces), vLLM CPU's broken expand kernel or unseeded drafts; with ``verified``, unless
    none of them has verified a step with sampled requests by ``rule`` (with pipeline parallelism only the last
    rank samples)."""
    other = [status for status in statuses if status["runner"] != "v1"]
    if other:
        raise RuntimeError(
            f"blockspec's vLLM plugin asked for the {rule} rule, but a worker runs vLLM's model runner "
            f"{other[0]['runner']}, which never calls the V1 rejection sampler the plugin replaces: start vLLM "
            "with VLLM_USE_V2_MODEL_RUNNER=0"
        )
    wrong = [
        status
        for status in statuses
        if status["rule"] != rule or status["expand"] == "stock" or status["drafts"] != "request seeds"
    ]
    if wrong or not statuses:
        raise RuntimeError(
            f"blockspec's vLLM plugin asked for the {rule} rule, but a worker runs {wrong[0] if wrong else 'nothing'}"
        )
    if verified and not any(status["steps"][rule] for status in statuses):
        raise RuntimeError(
            f"blockspec's vLLM plugin has the {rule} rule in place, but no worker has verified a step with sampled "
            f"requests by it ({statuses[0]['steps']}): check after serving requests at temperature > 0 with "
            "drafts; if it still says so, vLLM bypasses the rejection sampler the plugin replaces"
        )
    return statuses
