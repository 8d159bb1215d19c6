"""The vLLM plugin's presence check for a running server (``check_server``), against a stand-in for vLLM's
development endpoint /collective_rpc on 127.0.0.1: it passes only when every worker reports the rule asked for
on vLLM's V1 model runner with a working expand kernel and seeded drafts (and, asked to, having verified sampled
steps by it), and says what to do otherwise. No vLLM needed (the real server is
exercised by benchmarks/vllm_serve.py, which checks every server it starts this way).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from blockspec.vllm.status import check_server

BLOCK = {
    "rule": "block",
    "runner": "v1",
    "expand": "fixed",
    "drafts": "request seeds",
    "steps": {"block": 3, "token": 0},
}
V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"


@pytest.fixture
def server():
    """(url, replies): the stand-in answers POST /collective_rpc with replies["status"] (HTTP code) and
    replies["body"], and records the method asked for."""
    replies = {"status": 200, "body": {"results": [BLOCK]}, "asked": []}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            if self.path != "/collective_rpc":
                self.send_error(404)
                return
            replies["asked"].append(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["method"])
            self.send_response(replies["status"])
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(replies["body"]).encode())

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/", replies
    httpd.shutdown()
    httpd.server_close()


def test_a_server_running_the_rule_passes(server):
    url, replies = server
    assert check_server(url, "block") == [BLOCK]
    assert replies["asked"] == ["blockspec_status"]


@pytest.mark.parametrize(
    "status", [{**BLOCK, "rule": "token"}, {**BLOCK, "expand": "stock"}, {**BLOCK, "drafts": "global"}]
)
def test_a_worker_with_another_rule_the_broken_kernel_or_unseeded_drafts_fails(server, status):
    url, replies = server
    replies["body"] = {"results": [BLOCK, status]}
    with pytest.raises(RuntimeError, match="asked for the block rule, but a worker runs"):
        check_server(url, "block")


def test_a_worker_on_vllm_s_model_runner_v2_fails(server):
    """vLLM's Model Runner V2 (GPU) has its own sampler: the plugin's block rule, fixes and drafting hook never
    run there, whatever the patched V1 functions report."""
    url, replies = server
    replies["body"] = {"results": [BLOCK, {**BLOCK, "runner": V2_RUNNER}]}
    with pytest.raises(RuntimeError, match=f"model runner {V2_RUNNER}.*VLLM_USE_V2_MODEL_RUNNER=0"):
        check_server(url, "block")


def test_a_rule_that_verified_no_sampled_step_fails_when_asked_to_have_verified(server):
    """In place is not the same as run: after sampled traffic, ``verified=True`` asks that the rule verified
    some of its steps on some worker (a runner that bypasses vLLM's V1 rejection sampler never counts any; with
    pipeline parallelism only the last rank samples, so one idle worker is fine)."""
    url, replies = server
    assert check_server(url, "block", verified=True) == [BLOCK]
    idle = {**BLOCK, "steps": {"block": 0, "token": 4}}
    replies["body"] = {"results": [BLOCK, idle]}
    assert check_server(url, "block", verified=True) == replies["body"]["results"]
    replies["body"] = {"results": [idle, idle]}
    assert check_server(url, "block") == replies["body"]["results"]  # at start: nothing verified yet
    with pytest.raises(RuntimeError, match="no worker has verified a step with sampled requests by it"):
        check_server(url, "block", verified=True)


def test_no_worker_fails(server):
    url, replies = server
    replies["body"] = {"results": []}
    with pytest.raises(RuntimeError, match="runs nothing"):
        check_server(url, "block")


def test_a_server_without_the_plugin_or_the_endpoint_says_what_to_do(server):
    url, replies = server
    replies["status"], replies["body"] = 500, {"error": "AttributeError: blockspec_status"}
    with pytest.raises(RuntimeError, match="is blockspec installed in vLLM's environment"):
        check_server(url, "block")
    replies["status"] = 404
    with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
        check_server(url, "block")


def test_no_rule_asked_for_is_refused(server, monkeypatch):
    monkeypatch.delenv("BLOCKSPEC_VLLM_RULE", raising=False)
    with pytest.raises(ValueError, match="no rule asked for"):
        check_server(server[0])
