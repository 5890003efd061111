"""The server against hostile or careless clients, and what it trusts: oversized bodies are 413 before they are
buffered, oversized prompts 400 in OpenAI's shape, the API key is compared in constant time, the default bind is
127.0.0.1, and loading (convert, build, run) never unpickles anything from the files it reads."""
from __future__ import annotations

import ast
import hmac
import inspect
import json
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import BUILD_FLAGS, run_cli
from tests.server.conftest import RunningServer

LIMIT = 64 * 1024
REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def server(artifacts):
    s = RunningServer(artifacts.engine, api_key="sekret", max_body_bytes=LIMIT)
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": "Bearer sekret"}) as c:
        yield c


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_oversized_body_is_413(client, server, path):
    body = json.dumps({"prompt": "x" * (2 * LIMIT)}).encode()
    err = _error(client.post(path, content=body, headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"]

    def chunks():               # no Content-Length: the limit holds while the body streams in
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]
    err = _error(client.post(path, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert err["code"] == "request_too_large"
    server.wait_all_free()
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_body_under_the_limit_is_served(client):
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "user": "u" * (LIMIT // 2)})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body", [
    {"prompt": "word " * 5000},                                          # text, far over max_input_len 64
    {"prompt": [5] * 5000},                                              # token ids
    {"prompt": ["hi", "word " * 5000]},                                  # one of several prompts
    {"messages": [{"role": "user", "content": "word " * 5000}]},         # chat
])
def test_oversized_prompt_is_400_context_length(client, server, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    err = _error(client.post(path, json=body), 400)
    assert err["code"] == "context_length_exceeded" and "maximum context length is 256 tokens" in err["message"]
    server.wait_all_free()


def test_api_key_is_compared_in_constant_time(server, monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)
    monkeypatch.setattr(hmac, "compare_digest", spy)
    for key, status in (("wrong", 401), ("sekret", 200), ("sekreT", 401), ("sekret" * 10, 401)):
        r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == status
    assert [a for a, _ in calls] == [b"wrong", b"sekret", b"sekreT", b"sekret" * 10]
    assert all(b == b"sekret" for _, b in calls)


def test_default_bind_is_localhost():
    from engine.cli.serve import serve_command
    from engine.runtime.server.config import ServerConfig
    assert inspect.signature(serve_command).parameters["host"].default.default == "127.0.0.1"
    assert ServerConfig(engine_dir=Path("."), served_model_name="m").host == "127.0.0.1"


# ---- no code runs from the files: no pickle anywhere on the load paths ------------------------------------------

def _trap(monkeypatch, calls: list) -> None:
    """Every unpickling entry point (and torch.load, numpy.load with pickles) raises, and is counted."""
    import _pickle
    import pickle

    import numpy
    import torch

    def refuse(name):
        def f(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} called while loading")
        return f
    for mod in (pickle, _pickle):
        for name in ("load", "loads", "Unpickler"):
            monkeypatch.setattr(mod, name, refuse(f"{mod.__name__}.{name}"))
    monkeypatch.setattr(torch, "load", refuse("torch.load"))
    real_np_load = numpy.load

    def np_load(*a, allow_pickle=False, **k):
        if allow_pickle:
            calls.append("numpy.load(allow_pickle=True)")
            raise AssertionError("numpy.load with pickles")
        return real_np_load(*a, allow_pickle=False, **k)
    monkeypatch.setattr(numpy, "load", np_load)


def test_convert_build_run_never_unpickle(artifacts, tmp_path, monkeypatch):
    calls: list = []
    _trap(monkeypatch, calls)
    ckpt, engine = tmp_path / "ckpt", tmp_path / "engine"
    assert run_cli("convert", "--model-dir", str(artifacts.hf), "--output-dir", str(ckpt))[0] == 0
    assert run_cli("build", "--checkpoint-dir", str(ckpt), "--output-dir", str(engine), *BUILD_FLAGS)[0] == 0
    code, err = run_cli("run", "--engine-dir", str(engine), "--input-text", "hello", "--max-output-len", "8")
    assert code == 0, err
    assert calls == []
    # the trap is armed: the one source format that is a pickle (pytorch_model.bin) does reach torch.load
    import shutil

    from safetensors.torch import load_file
    bin_model = Path(shutil.copytree(artifacts.hf, tmp_path / "bin_model"))
    tensors = load_file(bin_model / "model.safetensors")
    (bin_model / "model.safetensors").unlink()
    monkeypatch.undo()
    import torch
    torch.save(tensors, bin_model / "pytorch_model.bin")
    _trap(monkeypatch, calls)
    assert run_cli("convert", "--model-dir", str(bin_model), "--output-dir", str(tmp_path / "x"))[0] == 1
    assert calls == ["torch.load"]


def _calls_in(tree: ast.AST, names: set[str]) -> list[ast.Call]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            dotted = f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                else getattr(f, "id", "")
            if dotted in names:
                found.append(node)
    return found


def test_no_loader_can_unpickle():
    """Statically: no module of the toolchain calls pickle.load(s) or numpy.load with pickles, and the one
    torch.load (the pytorch_model.bin fallback of an HF source) passes weights_only=True. Engines and checkpoints
    are safetensors, ONNX and JSON only."""
    offenders = []
    for folder in ("core", "recipes", "builder", "runtime", "quantization", "plugins", "cli"):
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for call in _calls_in(tree, {"pickle.load", "pickle.loads", "dill.load", "cloudpickle.load"}):
                offenders.append(f"{path.relative_to(REPO)}:{call.lineno}")
            for call in _calls_in(tree, {"np.load", "numpy.load"}):
                if any(k.arg == "allow_pickle" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                       for k in call.keywords):
                    offenders.append(f"{path.relative_to(REPO)}:{call.lineno}")
            for call in _calls_in(tree, {"torch.load"}):
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in call.keywords)
                if not safe:
                    offenders.append(f"{path.relative_to(REPO)}:{call.lineno} torch.load without weights_only=True")
    assert offenders == []
