"""Loading models and SV files: names that are not models fail before any network access, devices torch cannot
use are refused before loading, long prefills report progress, recordings load without running code, and the
SV profile folder follows BLOCKSPEC_CACHE."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kits.tiny import save_tiny, tiny_model, tiny_tokenizer

from blockspec.models.hf import HFModel
from blockspec.models.load import load_model, resolve_device

# --- model names --------------------------------------------------------------------------------------------

# Runs in a child process so that HF_ENDPOINT is set before huggingface_hub reads it (at import). The child serves
# a fake hub on 127.0.0.1 that answers 404 and counts requests, then tries each case.
HUB_SCRIPT = r"""
import http.server, json, os, sys, threading

requests = []

class Hub(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        requests.append(self.path)
        self.send_error(404)
    do_HEAD = do_GET
    def log_message(self, *args):
        pass

server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
threading.Thread(target=server.serve_forever, daemon=True).start()
os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{server.server_port}"

from blockspec.models.load import load_model

out = {}
for name, allow_download in json.loads(sys.argv[1]):
    requests.clear()
    try:
        model = load_model(name, dtype="float32", allow_download=allow_download)
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    out[f"{name} {allow_download}"] = {"error": error, "requests": len(requests)}
print(json.dumps(out))
"""

FAKE_REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_outcomes(tmp_path_factory):
    """{"<name> <allow_download>": {"error": message or None, "requests": count}} for the cases below, with a Hugging
    Face cache holding only `someorg/tiny` (a tiny model laid out as a download leaves it)."""
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--someorg--tiny"
    save_tiny(repo / "snapshots" / FAKE_REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(FAKE_REVISION)
    coded = home / "hub" / "models--someorg--coded"  # the same model, its config mapped to code in its folder
    shutil.copytree(repo, coded)
    config = json.loads((coded / "snapshots" / FAKE_REVISION / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling.Evil"}
    (coded / "snapshots" / FAKE_REVISION / "config.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE")}
    env.update(HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1")
    cases = [
        ["someorg/some-model", False],
        ["qwen2.5-coder-1.5B", False],
        ["someorg/tiny", False],
        ["someorg/coded", False],
        ["someorg/some-model", True],
    ]
    result = subprocess.run(
        [sys.executable, "-c", HUB_SCRIPT, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_unknown_hub_id_is_refused_before_any_request(hub_outcomes):
    outcome = hub_outcomes["someorg/some-model False"]
    assert outcome["requests"] == 0
    assert outcome["error"].startswith("ValueError: unknown model 'someorg/some-model'; presets: qwen2.5-coder-1.5b")
    assert "--allow-download" in outcome["error"] and "allow_download=True" in outcome["error"]


def test_mistyped_preset_name_gets_the_closest_preset(hub_outcomes):
    outcome = hub_outcomes["qwen2.5-coder-1.5B False"]
    assert outcome["requests"] == 0
    assert "unknown model 'qwen2.5-coder-1.5B'" in outcome["error"]
    assert "(did you mean 'qwen2.5-coder-1.5b'?)" in outcome["error"]


def test_hub_id_in_the_local_cache_loads_without_requests(hub_outcomes):
    assert hub_outcomes["someorg/tiny False"] == {"error": None, "requests": 0}


def test_a_hub_model_in_the_cache_with_code_is_refused_before_it_loads(hub_outcomes):
    """A hub id is checked like a folder: its config maps to code, so it is refused, not loaded with transformers'
    built-in class for its model_type (which need not be the model its code defines)."""
    outcome = hub_outcomes["someorg/coded False"]
    assert outcome["requests"] == 0 and outcome["error"] is not None
    assert outcome["error"].endswith(
        "its config.json maps to Python code in the folder (auto_map); blockspec never runs code from a model folder"
    )


def test_allow_download_reaches_the_hub(hub_outcomes):
    """Negative control: the fake hub does see requests when downloading is allowed."""
    outcome = hub_outcomes["someorg/some-model True"]
    assert outcome["requests"] > 0 and outcome["error"] is not None


def test_a_model_folder_loads_from_local_files_only(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    seen = {}
    original = AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    model = load_model(save_tiny(tmp_path / "tiny"), dtype="float32")
    assert seen["local_files_only"] is True and model.vocab_size == 48


@pytest.mark.parametrize("config_file", ["config.json", "tokenizer_config.json"])
def test_a_model_folder_with_code_is_refused_before_anything_loads(tmp_path, monkeypatch, config_file):
    from transformers import AutoModelForCausalLM

    folder = save_tiny(tmp_path / "tiny")
    path = Path(folder) / config_file
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "modeling.Model"}}))
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(
        ValueError, match=rf"^{folder}: its {config_file} maps to Python code in the folder.*never runs"
    ):
        load_model(folder, dtype="float32")


def test_every_from_pretrained_in_the_library_refuses_remote_code():
    """Without trust_remote_code=False, transformers asks on stdin whether to run a model folder's code."""
    import ast

    import blockspec

    calls = []
    for source in Path(blockspec.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "from_pretrained":
                refused = any(
                    k.arg == "trust_remote_code" and isinstance(k.value, ast.Constant) and k.value.value is False
                    for k in node.keywords
                )
                calls.append((f"{source.name}:{node.lineno}", refused))
    # the scan finds the calls of each module that loads a model or tokenizer from files
    assert {"load.py", "convert.py"} <= {call.split(":")[0] for call, _ in calls} and len(calls) >= 8
    assert [call for call, refused in calls if not refused] == []


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory):
    from kits.tinygguf import save_gguf

    return save_gguf(tiny_model(), tmp_path_factory.mktemp("gguf") / "good.gguf")


@pytest.mark.parametrize("backend", ["hf", "llamacpp"])
@pytest.mark.parametrize("how", ["tensor count", "metadata count", "100 bytes", "truncated"])
def test_a_damaged_gguf_file_is_a_clear_error_naming_it(good_gguf, tmp_path, monkeypatch, how, backend):
    """The loaders fail deep in the parse of such a file (with numpy's or struct's words, naming no file): the error
    names the file and says it is truncated or corrupted."""
    from kits.tinygguf import damage_gguf

    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path / "cache"))  # where its tokenizer would be kept

    path = damage_gguf(good_gguf, tmp_path / "damaged.gguf", how)
    with pytest.raises(ValueError, match=rf"^{path}: not a valid GGUF file; it is truncated or corrupted$"):
        load_model(path, dtype="float32", backend=backend)


# --- devices ------------------------------------------------------------------------------------------------


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_clear_error(no_cuda, device):
    with pytest.raises(ValueError, match=rf"device '{device}' requested but torch has no CUDA here.*--device cpu"):
        resolve_device(device)


@pytest.mark.parametrize("device", ["gpu", "", "cuda:x", "meta"])
def test_unknown_device_string_is_a_clear_error(device):
    with pytest.raises(ValueError, match=rf"unknown device '{device}'; use auto, cpu, cuda, cuda:N or mps"):
        resolve_device(device)


def test_usable_devices_resolve(no_cuda):
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")


def test_load_model_refuses_a_cuda_device_before_loading(no_cuda, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    path = save_tiny(tmp_path / "tiny")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(ValueError, match="no CUDA"):
        load_model(path, dtype="float32", device="cuda")


# --- prefill progress ---------------------------------------------------------------------------------------

PROMPTS = [list(range(1, 11)), [20, 21, 22]]  # 10 and 3 tokens


def test_long_prefill_reports_progress_within_a_prompt():
    calls = []
    model = HFModel(tiny_model(), tiny_tokenizer(), on_prefill=lambda done, total: calls.append((done, total)))
    model.prefill_tokens = 4  # the 10-token prompt alone exceeds it: prefilled in chunks of 4, 4 and 2
    model.prefill(PROMPTS)
    assert calls == [(4, 13), (8, 13), (10, 13), (13, 13)]


def test_chunked_prefill_gives_the_logits_of_one_forward():
    model = tiny_model()
    whole, chunked = HFModel(model, name="whole"), HFModel(model, name="chunked")
    chunked.prefill_tokens = 3  # every prompt in chunks of at most 3 tokens
    valid = torch.ones(2, 2, dtype=torch.bool)
    after = []
    for adapter in (whole, chunked):
        adapter.prefill(PROMPTS)
        after.append(adapter.forward(torch.tensor([[30, 31], [32, 33]]), valid))  # [2, 2, V]
    torch.testing.assert_close(after[1], after[0], atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # and both are the plain forward of the whole sequence
        reference = model(torch.tensor([PROMPTS[0] + [30, 31]])).logits[0, -2:]  # [2, V]
    torch.testing.assert_close(after[1][0], reference, atol=1e-5, rtol=1e-5)


# --- SV files -----------------------------------------------------------------------------------------------


def test_recording_round_trips(tmp_path):
    from blockspec.bench.calibrate import Recording

    recording = Recording(
        prompt=torch.tensor([0, 1]),
        num_verified=torch.tensor([2, 1]),
        accepted=torch.tensor([1, 0]),
        draft=torch.rand(2, 2, 3),
        companion={"token": torch.rand(2, 2, 4), "block": torch.rand(2, 2, 4)},
        labels={"token": torch.rand(2, 2), "block": torch.rand(2, 2)},
    )
    recording.save(tmp_path / "rec.pt")
    loaded = Recording.load(tmp_path / "rec.pt")
    for name, value in recording.__dict__.items():
        if isinstance(value, dict):
            assert value.keys() == loaded.__dict__[name].keys()
            assert all(torch.equal(v, loaded.__dict__[name][k]) for k, v in value.items())
        else:
            assert torch.equal(value, loaded.__dict__[name])


class _Payload:
    """Unpickling this calls os.makedirs(target): a stand-in for arbitrary code."""

    def __init__(self, target: str):
        self.target = target

    def __reduce__(self):
        return os.makedirs, (self.target,)


def test_recording_with_pickled_code_is_refused(tmp_path, monkeypatch):
    import pickle

    from blockspec.bench.calibrate import Recording

    ran = tmp_path / "payload-ran"
    torch.save({"prompt": _Payload(str(ran))}, tmp_path / "evil.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # full unpickling unless the call site says otherwise
    with pytest.raises(pickle.UnpicklingError):
        Recording.load(tmp_path / "evil.pt")
    assert not ran.exists()


def test_sv_profiles_follow_the_cache_variable_set_after_import(tmp_path, monkeypatch):
    from blockspec.policy import profiles as sv_cli

    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    assert sv_cli.profile_path("t", "d", None, sampling).parent == tmp_path / "sv"
    assert sv_cli.latency_path("t", "d", None, "float32", "cpu").parent == tmp_path / "sv"
    monkeypatch.setenv("BLOCKSPEC_CACHE", "~/elsewhere")
    assert sv_cli.profile_path("t", "d", None, sampling).parent == Path.home() / "elsewhere" / "sv"
    monkeypatch.setenv("BLOCKSPEC_CACHE", "")  # empty means unset, not the current directory
    assert sv_cli.latency_path("t", "d", None, "float32", "cpu").parent == Path.home() / ".cache" / "blockspec" / "sv"
