"""Start-up (503 until loaded and warmed), a dead engine loop, a failed load, and SIGTERM's graceful drain."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from engine.core.errors import EngineError
from engine.runtime import LLM
from tests.server.conftest import RunningServer, first_data_event, sse_events


def test_health_is_503_while_loading(server_engine):
    gate = threading.Event()

    def load():
        assert gate.wait(30), "the test never opened the gate"
        return LLM(server_engine, max_kv_tokens=2048)
    s = RunningServer(server_engine, load=load)
    try:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert httpx.get(s.url + "/v1/models").status_code == 200        # metadata needs no engine
        assert httpx.get(s.url + "/metrics").status_code == 200
        gate.set()
        s.wait_ready()
        # warmed: the warm-up generation ran before /health said 200
        assert s.state.llm.stats().num_steps >= 2
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        gate.set()
        s.stop()


def test_failed_load_keeps_health_503(server_engine):
    def load():
        raise EngineError("the KV cache does not fit; lower --max-kv-tokens")
    s = RunningServer(server_engine, load=load)
    try:
        deadline = time.monotonic() + 10
        while s.state.load_error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and "does not fit" in r.json()["error"]["message"]
    finally:
        s.stop()


class _EngineDeath(BaseException):
    """Not an Exception: the engine loop's error handling does not catch it, so the thread dies."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_engine_loop_is_503_and_fails_waiting_requests(server_engine):
    s = RunningServer(server_engine, keepalive_s=0.1)
    try:
        s.wait_ready()

        def die():
            raise _EngineDeath()
        s.state.llm.core.step = die
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 5}, timeout=10)
        assert r.status_code == 500 and "engine loop stopped" in r.json()["error"]["message"]
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and "engine loop stopped" in r.json()["error"]["message"]
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "x"}).status_code == 503
    finally:
        s.stop()


def test_cli_refuses_bad_flags(server_engine):
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--engine-dir", str(server_engine),
                        "--scheduling-policy", "lottery"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "lottery" in r.stderr
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--engine-dir", str(server_engine),
                        "--stream-interval", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--stream-interval 0 must be >= 1" in r.stderr and "Traceback" not in r.stderr
    for flag, value, message in (("--max-header-bytes", "10", "must be at least 1024"),
                                 ("--header-timeout", "0", "must be > 0 seconds"),
                                 ("--keep-alive-timeout", "-1", "must be > 0 seconds")):
        r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--engine-dir", str(server_engine), flag,
                            value], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and f"{flag} {value}" in r.stderr and message in r.stderr, r.stderr


def test_sigterm_drains_in_flight_requests_then_exits(server_engine):
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "--engine-dir", str(server_engine),
                             "--port", "0", "--served-model-name", "tiny", "--max-kv-tokens", "2048",
                             "--shutdown-timeout", "30", "--threads", "1"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "ENGINE_API_KEY": "k"})
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "engine serve exited before listening"
            m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "no 'running on' line from uvicorn"
        auth = {"Authorization": "Bearer k"}                             # ENGINE_API_KEY was read
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        assert httpx.get(url + "/v1/models").status_code == 401
        events_after_term = []
        with httpx.Client(base_url=url, headers=auth, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, "ignore_eos": True,
                                                          "stream": True}) as r:
                lines = r.iter_lines()
                assert first_data_event(lines)["choices"]
                proc.send_signal(signal.SIGTERM)
                for line in lines:
                    events_after_term += sse_events([line])
        assert events_after_term[-1] == "[DONE]" and len(events_after_term) > 10, "the stream was cut"
        assert events_after_term[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
