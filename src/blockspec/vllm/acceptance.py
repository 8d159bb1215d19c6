# vLLM lives in its own environment (scripts/setup_vllm.sh), not in the one pyright checks:
# pyright: reportMissingImports=false
"""Acceptance by request and by rule: the tokens each request drafted and had accepted, by the rule that verified
them ("block", "token", or "greedy" for vLLM's greedy kernel), and with ``BLOCKSPEC_VLLM_ANALYTIC`` the accepted
length its drafts were expected to reach under either rule. One log line when a request finishes; the same sums in
``STATE.acceptance`` (the worker's status) and in Prometheus counters labelled by rule (vLLM's prometheus_client).
Counting takes two small lists per step, no pass over the probabilities."""

from __future__ import annotations

import logging

import torch

from .state import STATE, RequestAcceptance

LOG = logging.getLogger("vllm.blockspec")  # under vLLM's logger: vLLM's handlers and VLLM_LOGGING_LEVEL apply
COUNTERS = {  # Prometheus name (prometheus_client adds _total) -> what it counts, labelled by rule
    "blockspec_vllm_drafted_tokens": "Draft tokens verified, by the rule that verified them",
    "blockspec_vllm_accepted_tokens": "Draft tokens accepted, by the rule that verified them",
    "blockspec_vllm_expected_accepted_tokens": "Accepted tokens expected of the block rule's drafts under each rule "
    "(BLOCKSPEC_VLLM_ANALYTIC)",
}
PROMETHEUS: dict = {}  # name -> Counter, made in the first step counted: in vLLM's worker, not in every process


def count_step(
    rule: str,
    sampled: torch.Tensor,  # [B] bool: verified by ``rule``; the other requests by vLLM's greedy kernel
    num_draft_tokens: list[int],  # [B]
    sampled_token_ids: torch.Tensor,  # [B, K + 1] int32: each request's emitted tokens, then -1 placeholders
    expected: dict[str, torch.Tensor] | None = None,  # rule -> [B] float: E[accepted], sampled rows that drafted
) -> None:
    """Add one verification step's drafted and accepted tokens, by rule, to the sums and Prometheus counters, and
    to each request's ``STATE.requests`` record while the model runner's batch is known (``STATE.req_ids``)."""
    # emitted [a1, a2, bonus, -1, -1] -> 3 tokens -> 2 accepted drafts
    accepted = ((sampled_token_ids != -1).sum(-1) - 1).tolist()
    rules = [rule if row else "greedy" for row in sampled.tolist()]
    expectations = {name: values.tolist() for name, values in (expected or {}).items()}
    step: dict[str, list[int]] = {}
    for b, drafted in enumerate(num_draft_tokens):
        if not drafted:
            continue
        totals = step.setdefault(rules[b], [0, 0])
        totals[0] += drafted
        totals[1] += accepted[b]
        if STATE.req_ids is not None:
            request = STATE.requests.setdefault(STATE.req_ids[b], RequestAcceptance())
            counts = request.counts.setdefault(rules[b], [0, 0])
            counts[0] += drafted
            counts[1] += accepted[b]
            if expectations and rules[b] != "greedy":
                for name, values in expectations.items():
                    request.expected[name] = request.expected.get(name, 0.0) + values[b]
    for name, (drafted, accepted_tokens) in step.items():
        sums = STATE.acceptance.setdefault(name, {"drafted": 0, "accepted": 0})
        sums["drafted"] += drafted
        sums["accepted"] += accepted_tokens
        counter("blockspec_vllm_drafted_tokens").labels(rule=name).inc(drafted)
        counter("blockspec_vllm_accepted_tokens").labels(rule=name).inc(accepted_tokens)
    for name, values in (expected or {}).items():
        counter("blockspec_vllm_expected_accepted_tokens").labels(rule=name).inc(float(values.sum()))


def counter(name: str):
    """The Prometheus counter ``name`` of this process, labelled by rule. With PROMETHEUS_MULTIPROC_DIR set where
    vLLM starts, prometheus_client writes it to that folder, from which the server's /metrics reads every process."""
    if name not in PROMETHEUS:
        from prometheus_client import Counter

        PROMETHEUS[name] = Counter(name, COUNTERS[name], ["rule"])
    return PROMETHEUS[name]


def finish_requests(self, scheduler_output, *args, **kwargs):
    """vLLM's ``_update_states``, after one log line for each request the scheduler reports finished (or aborted)
    that drafted something: its drafted and accepted tokens by rule, and with the analytic sums the accepted
    length expected of its drafts under either rule and the block rule's gain."""
    for req_id in scheduler_output.finished_req_ids:
        request = STATE.requests.pop(req_id, None)
        if request is not None:
            LOG.info("blockspec: request %s: %s", req_id, request.summary())
    return finish_requests.stock(self, scheduler_output, *args, **kwargs)
