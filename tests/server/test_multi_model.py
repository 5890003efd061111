"""Several engines behind one server (runtime/server/models.py): requests routed by `model` get each engine's own
greedy output, unknown models a 404 naming the served ones, and the loaded engines follow --models-max (LRU),
--pin and --unload-idle-seconds; a slow load never stalls requests to a loaded model."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from engine.core.errors import EngineError
from engine.runtime import LLM
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.server.config import ModelSpec
from tests.runtime.tiny_engine import build_tiny_engine

from .conftest import MODEL, SERVER_BUILD, RunningServer, first_data_event, slow_steps, sse_events

QWEN, LLAMA_B = "qwen", "tiny-b"     # tiny-b: the default's engine again, under another name
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def qwen_engine(tmp_path_factory):
    return build_tiny_engine(tmp_path_factory.mktemp("qwen_engine"), "Qwen2ForCausalLM", **SERVER_BUILD)[1]


def _loader(engine_dir, gate: threading.Event | None = None):
    def load():
        if gate is not None:
            assert gate.wait(60), "the test never opened the gate"
        return LLM(engine_dir, max_kv_tokens=8 * 256)
    return load


def _serve(server_engine, qwen_engine, *, gate=None, qwen_load=None, **config) -> RunningServer:
    """tiny (the default), qwen and tiny-b; qwen's load waits for `gate` when given, or is `qwen_load`."""
    dirs = {MODEL: server_engine, QWEN: qwen_engine, LLAMA_B: server_engine}
    loads = {name: _loader(d, gate if name == QWEN else None) for name, d in dirs.items()}
    loads[QWEN] = qwen_load or loads[QWEN]
    s = RunningServer(server_engine, load=loads, keepalive_s=0.5, extra_models=(
        ModelSpec(QWEN, qwen_engine), ModelSpec(LLAMA_B, server_engine)), **config)
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def multi(server_engine, qwen_engine):
    s = _serve(server_engine, qwen_engine)
    yield s
    s.stop()


def _client(s: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(s: RunningServer, model: str | None, max_tokens: int = 8) -> str:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **({"model": model} if model else {})}
    r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _statuses(s: RunningServer) -> dict[str, str]:
    return {c["id"]: c["status"] for c in httpx.get(s.url + "/v1/models").json()["data"]}


def test_each_model_answers_as_its_engine_served_alone(multi, server, qwen_engine):
    client = _client(multi)
    got = {m: client.completions.create(model=m, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
           for m in (MODEL, QWEN, LLAMA_B)}
    alone = _client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert got[MODEL] == got[LLAMA_B] == alone.choices[0].text
    qwen = LLM(qwen_engine, max_kv_tokens=2048)
    try:
        assert got[QWEN] == qwen.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0].text
    finally:
        qwen.close()
    assert got[QWEN] != got[MODEL]                   # two different models, so routing is seen
    chat = client.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == QWEN
    assert _complete(multi, None, max_tokens=12) == got[MODEL]       # no `model`: the first one


def test_an_unknown_model_is_a_404_naming_the_served_ones(multi):
    with pytest.raises(openai.NotFoundError) as e:
        _client(multi).completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model" and err["type"] == "invalid_request_error"
    assert all(f"`{m}`" in err["message"] for m in (MODEL, QWEN, LLAMA_B)) and "`nope`" in err["message"]
    r = httpx.post(multi.url + "/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_models_lists_every_model_and_metrics_carry_each_name(multi):
    cards = httpx.get(multi.url + "/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [MODEL, QWEN, LLAMA_B]
    assert all(c["parent"] is None and c["root"] == c["id"] for c in cards)
    _complete(multi, QWEN)
    assert _statuses(multi)[QWEN] == "loaded"
    text = httpx.get(multi.url + "/metrics").text
    assert f'engine:model_loaded{{model_name="{QWEN}"}} 1.0' in text
    assert re.search(rf'vllm:generation_tokens_total{{model_name="{QWEN}"}} [1-9]', text)
    assert f'vllm:num_requests_running{{model_name="{QWEN}"}}' in text


def test_lru_cap_unloads_the_least_recently_used_and_never_the_pinned(server_engine, qwen_engine):
    s = _serve(server_engine, qwen_engine, models_max=2)
    try:
        assert _statuses(s) == {MODEL: "loaded", QWEN: "unloaded", LLAMA_B: "unloaded"}   # the default at start
        _complete(s, QWEN)
        _complete(s, MODEL)                                   # now qwen is the least recently used
        _complete(s, LLAMA_B)
        assert _statuses(s) == {MODEL: "loaded", QWEN: "unloaded", LLAMA_B: "loaded"}
        assert f'engine:model_unloads_total{{model_name="{QWEN}"}} 1.0' in httpx.get(s.url + "/metrics").text
    finally:
        s.stop()
    s = _serve(server_engine, qwen_engine, models_max=2, pinned=(MODEL,))
    try:
        for m in (QWEN, LLAMA_B, QWEN, LLAMA_B):              # the pinned default is the least recently used
            _complete(s, m)
            assert _statuses(s)[MODEL] == "loaded" and _statuses(s)[m] == "loaded"
    finally:
        s.stop()


def test_a_model_with_requests_in_flight_is_not_unloaded(server_engine, qwen_engine):
    s = _serve(server_engine, qwen_engine, models_max=1)
    try:
        with slow_steps(s, 0.05), httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 40,
                                                          "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                assert first_data_event(lines)["choices"]
                busy = c.post("/v1/completions", json={"model": QWEN, "prompt": PROMPT, "max_tokens": 2})
                assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
                assert busy.json()["error"]["code"] == "models_busy" and f"`{MODEL}`" in busy.text
                events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        _complete(s, QWEN)                                    # the stream is over: tiny goes, qwen comes
        assert _statuses(s) == {MODEL: "unloaded", QWEN: "loaded", LLAMA_B: "unloaded"}
        assert s.state.in_flight == 0
        s.state.registry.models[QWEN].llm.check_all_free()
    finally:
        s.stop()


def test_idle_models_are_unloaded_but_not_the_pinned(server_engine, qwen_engine):
    s = _serve(server_engine, qwen_engine, unload_idle_s=0.3, pinned=(MODEL,))
    try:
        _complete(s, QWEN)
        deadline = time.monotonic() + 10
        while _statuses(s)[QWEN] != "unloaded":
            assert time.monotonic() < deadline, "qwen was never unloaded"
            time.sleep(0.05)
        assert _statuses(s)[MODEL] == "loaded"
        assert _complete(s, QWEN)                             # loads again on its next request
    finally:
        s.stop()


def test_a_slow_load_does_not_stall_requests_to_a_loaded_model(server_engine, qwen_engine):
    gate = threading.Event()
    s = _serve(server_engine, qwen_engine, gate=gate)
    try:
        waiting: dict[str, str] = {}
        t = threading.Thread(target=lambda: waiting.update(text=_complete(s, QWEN)))
        t.start()
        deadline = time.monotonic() + 10
        while _statuses(s)[QWEN] != "loading":
            assert time.monotonic() < deadline, "qwen's load never began"
            time.sleep(0.02)
        for _ in range(3):                                    # served while qwen's load is held at the gate
            assert _complete(s, MODEL)
        assert _statuses(s)[QWEN] == "loading" and t.is_alive()
        gate.set()
        t.join(60)
        assert waiting["text"] and _statuses(s)[QWEN] == "loaded"
    finally:
        gate.set()
        s.stop()


def test_a_failed_load_is_a_503_naming_it_and_the_next_request_tries_again(server_engine, qwen_engine):
    tries = []

    def flaky():
        tries.append(1)
        if len(tries) == 1:
            raise EngineError("the KV cache does not fit; lower --max-kv-tokens")
        return LLM(qwen_engine, max_kv_tokens=2048)
    s = _serve(server_engine, qwen_engine, qwen_load=flaky)
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": QWEN, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and f"model `{QWEN}` failed to load" in r.text and "does not fit" in r.text
        assert httpx.get(s.url + "/health").status_code == 200 and _statuses(s)[QWEN] == "unloaded"
        assert s.state.in_flight == 0
        assert _complete(s, QWEN) and len(tries) == 2
    finally:
        s.stop()


class _OneAdapter:
    """The registry's LoRA hook (models.Adapters) with one adapter of the default model."""

    def base_of(self, name):
        return MODEL if name == "tiny-lora" else None

    def names(self):
        return [("tiny-lora", MODEL)]


def test_an_adapter_hook_routes_to_its_base_and_lists_it_as_a_child(multi):
    multi.state.registry.adapters = _OneAdapter()
    try:
        card = httpx.get(multi.url + "/v1/models").json()["data"][-1]
        assert card["id"] == "tiny-lora" and card["parent"] == MODEL and card["root"] == MODEL
        r = httpx.post(multi.url + "/v1/completions", json={"model": "tiny-lora", "prompt": PROMPT, "max_tokens": 2})
        # the adapter's name reached the base's LLM, which has no adapters (the tiny engine has no LoRA inputs)
        assert r.status_code == 400 and "LoRA adapter" in r.json()["error"]["message"], r.text
        r = httpx.post(multi.url + "/v1/completions", json={"model": "nope", "prompt": PROMPT})
        assert r.status_code == 404 and "`tiny-lora`" in r.json()["error"]["message"]
    finally:
        multi.state.registry.adapters = None


def test_engine_serve_models_dir_routes_then_drains_on_sigterm(server_engine, qwen_engine, tmp_path):
    (tmp_path / "a-tiny").symlink_to(server_engine)
    (tmp_path / "b-qwen").symlink_to(qwen_engine)
    (tmp_path / "notes").mkdir()                                       # no engine: skipped
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--models-dir", str(tmp_path), "--port", "0",
                             "--max-kv-tokens", "2048", "--threads", "1", "--api-key", "k", "--models-max", "1"],
                            stderr=subprocess.PIPE, text=True)
    try:
        url, deadline = None, time.monotonic() + 60
        while url is None:
            line = proc.stderr.readline()
            assert line and time.monotonic() < deadline, "engine serve exited before listening"
            m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer k"}, timeout=60) as c:
            while c.get("/health").status_code != 200:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["a-tiny", "b-qwen"]
            with c.stream("POST", "/v1/completions", json={"model": "b-qwen", "prompt": PROMPT, "max_tokens": 50,
                                                          "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                assert first_data_event(lines)["model"] == "b-qwen"
                proc.send_signal(signal.SIGTERM)                        # drains the stream, then exits
                events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_reload_may_keep_the_first_loads_tokenizer(server_engine):
    first = LLM(server_engine, max_kv_tokens=2048)
    try:
        want = first.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].text
    finally:
        first.close()
    again = LLM(server_engine, max_kv_tokens=2048, tokenizer=first.tokenizer)   # as engine serve's loaders do
    try:
        assert again.tokenizer is first.tokenizer
        assert again.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0].text == want
    finally:
        again.close()


def test_admission_is_per_model(server_engine, qwen_engine):
    s = _serve(server_engine, qwen_engine, max_queue=0)               # each model admits its batch of 8
    try:
        with slow_steps(s, 0.05), httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 30,
                                                          "n": 8, "ignore_eos": True, "stream": True}) as r:
                lines = r.iter_lines()
                assert first_data_event(lines)["choices"]
                full = c.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
                assert full.status_code == 429 and f"model `{MODEL}`" in full.json()["error"]["message"]
                assert c.post("/v1/completions", json={"model": QWEN, "prompt": PROMPT,
                                                       "max_tokens": 2}).status_code == 200
                sse_events(lines)
    finally:
        s.stop()
