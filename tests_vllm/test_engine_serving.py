"""The plugin as a server meets it, on the tiny pair: which model runner vLLM uses, forced both ways (V1 starts and
says so in one line; Model Runner V2, which never calls what the plugin replaces, is refused naming
VLLM_USE_V2_MODEL_RUNNER=0), each request's drafted and accepted tokens logged when it finishes as vLLM's own
per-request metrics count them, with the block rule's analytic gain, and in Prometheus counters by rule; the
refusal of structured outputs at temperature > 0 reaching a client of vLLM's server as HTTP 400 with its reason.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
import types

import pytest
import tinyvllm
import torch

from blockspec.vllm.status import check, require, worker_status

REQUEST_LINE = re.compile(r"blockspec: request (\S+): (.*)")
COUNTS = re.compile(r"(\w+): (\d+) drafted, (\d+) accepted")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(llm, log): vLLM's offline engine with the block rule and the analytic sums, vLLM's per-request metrics on
    and its V1 model runner forced (VLLM_USE_V2_MODEL_RUNNER=0); its processes write to the file ``log``."""
    directory = tmp_path_factory.mktemp("served")
    log = directory / "vllm.log"
    saved = os.dup(1), os.dup(2)
    os.environ.update(VLLM_USE_V2_MODEL_RUNNER="0", BLOCKSPEC_VLLM_ANALYTIC="1")
    with open(log, "wb") as sink:  # the engine's processes inherit these descriptors
        os.dup2(sink.fileno(), 1), os.dup2(sink.fileno(), 2)
        try:
            llm = tinyvllm.start(directory / "models", "block", per_request_spec_decode_metrics="summary")
        finally:
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            for name in ("VLLM_USE_V2_MODEL_RUNNER", "BLOCKSPEC_VLLM_ANALYTIC"):
                os.environ.pop(name)
    yield llm, log
    del llm


def test_the_v1_runner_forced_is_reported_and_announced_in_one_line(served):
    llm, log = served
    assert {status["runner"] for status in check(llm, "block")} == {"v1"}
    announced = re.findall(r"blockspec: the (\w+) rule verifies sampled drafts on vLLM's V1", log.read_text())
    assert announced == ["block"]


def test_model_runner_v2_forced_is_refused_naming_the_switch(monkeypatch, tmp_path):
    """On CPU vLLM itself refuses Model Runner V2 (it needs Triton); on GPUs, where it is vLLM's default, the plugin
    refuses it where the worker builds it, before any model loads: its sampler never calls the plugin's rule. A
    worker reporting it fails ``check``."""
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2

    from blockspec.vllm import plugin

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(Exception, match="Model Runner V2 requires Triton"):
        tinyvllm.start(tmp_path / "models", "block")
    monkeypatch.setenv("BLOCKSPEC_VLLM_RULE", "block")
    plugin.register()
    with pytest.raises(RuntimeError, match="Model Runner V2 .* VLLM_USE_V2_MODEL_RUNNER=0") as refused:
        CPUModelRunnerV2(None, torch.device("cpu"))
    assert "\n" not in str(refused.value)
    status = worker_status(types.SimpleNamespace(model_runner=object.__new__(CPUModelRunnerV2)))
    assert status["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        require([status], "block")


def logged_requests(log, count: int) -> dict[str, str]:
    """Request id -> what its line says, once ``count`` requests are logged (a request's line comes at the step
    after it finished, which the engine runs after handing the output back)."""
    for _ in range(100):
        lines = dict(REQUEST_LINE.findall(log.read_text()))
        if len(lines) >= count:
            return lines
        time.sleep(0.1)
    raise AssertionError(f"{len(lines)} request lines logged, expected {count}")


def test_each_request_s_acceptance_is_logged_as_vllm_counts_it(served):
    """Sampled requests verified by the block rule, greedy ones by vLLM's kernel: each request's line gives the
    drafted and accepted tokens vLLM's own per-request metrics count, and for sampled requests the accepted length
    its drafts were expected to reach under each rule. The worker's status and Prometheus counters (in the worker:
    no PROMETHEUS_MULTIPROC_DIR here) add up the same tokens by rule."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, log = served
    before = check(llm, "block")[0]["acceptance"]
    counters_before = llm.collective_rpc(tinyvllm.acceptance_counters)[0]
    params = [SamplingParams(temperature=1.0 if i < 24 else 0.0, max_tokens=12, ignore_eos=True) for i in range(32)]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=tinyvllm.PROMPT)] * 32, params, use_tqdm=False)
    lines = logged_requests(log, 32)
    totals: dict[str, list[int]] = {}
    for output, param in zip(outputs, params):
        [(request_id, line)] = [(key, line) for key, line in lines.items() if key.startswith(f"{output.request_id}-")]
        counts = {rule: (int(drafted), int(accepted)) for rule, drafted, accepted in COUNTS.findall(line)}
        rule = "block" if param.temperature > 0 else "greedy"
        metrics = output.outputs[0].spec_decode_metrics.to_dict()
        assert counts == {rule: (metrics["num_draft_tokens"], metrics["num_accepted_draft_tokens"])}, request_id
        assert ("block rule's gain" in line) == (rule == "block"), line
        for index, value in enumerate(counts[rule]):
            totals.setdefault(rule, [0, 0])[index] += value
    after = check(llm, "block")[0]["acceptance"]
    counters_after = llm.collective_rpc(tinyvllm.acceptance_counters)[0]
    for rule, (drafted, accepted) in totals.items():
        assert drafted > 0 and (accepted > 0 or rule == "greedy"), (rule, drafted, accepted)
        sums = {key: after[rule][key] - before.get(rule, {}).get(key, 0) for key in ("drafted", "accepted")}
        assert sums == {"drafted": drafted, "accepted": accepted}
        for key, value in sums.items():
            assert counters_after[key][rule] - counters_before[key].get(rule, 0) == value
    assert totals.keys() == {"block", "greedy"}
    assert counters_after["expected"].keys() == {"block", "token"}  # the analytic sums: sampled requests only
    assert counters_after["expected"]["block"] > counters_before["expected"].get("block", 0)


def test_the_refusal_of_structured_outputs_reaches_the_server_s_client_as_a_400_with_its_reason(tmp_path):
    """Through vLLM's AsyncLLM, the engine its OpenAI server runs: the refusal comes out as vLLM's validation error,
    which the server's error handler (``create_error_response``) answers with HTTP 400 and the message. A
    ValueError there came out as ``EngineGenerateError``: HTTP 500 without a message."""
    from vllm import SamplingParams
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import StructuredOutputsParams

    async def refused() -> Exception:
        engine = tinyvllm.start(tmp_path / "models", "block", asynchronous=True)
        try:
            grammar = StructuredOutputsParams(choice=["w3"])
            params = SamplingParams(temperature=1.0, max_tokens=2, structured_outputs=grammar)
            try:
                async for _ in engine.generate(TokensPrompt(prompt_token_ids=tinyvllm.PROMPT), params, "grammar"):
                    pass
            except Exception as error:  # noqa: BLE001 - what the server's handler receives, whatever its type
                return error
            raise AssertionError("a sampled request with structured outputs was served")
        finally:
            engine.shutdown()

    response = create_error_response(asyncio.run(refused()))
    assert response.error.code == 400
    assert "structured outputs at temperature > 0" in response.error.message
    assert response.error.param == "structured_outputs"
