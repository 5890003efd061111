"""Real uvicorn servers on 127.0.0.1 (ephemeral ports) in a thread of the test process, on a tiny engine.

The tiny engine has room for long generations (max_seq_len 256) so that requests are still running when the
tests cancel them, and a small batch (8) so that a burst of requests queues.
"""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from engine.runtime import LLM
from engine.runtime.server.app import create_app, uvicorn_config
from engine.runtime.server.config import ServerConfig
from tests.runtime.tiny_engine import build_tiny_engine

SERVER_BUILD = dict(max_batch_size=8, max_input_len=64, max_seq_len=256, max_num_tokens=64, tokens_per_block=8)
MODEL = "tiny"


class RunningServer:
    """create_app + uvicorn on a socket bound to 127.0.0.1:0; `stop()` shuts it down as SIGTERM would."""

    def __init__(self, engine_dir: Path, load=None, adapters=None, **config):
        import uvicorn
        self.config = ServerConfig(engine_dir=engine_dir, served_model_name=MODEL, **config)
        self.app = create_app(self.config, load or (lambda: LLM(engine_dir, max_kv_tokens=8 * 256,
                                                                 scheduling_policy=self.config.scheduling_policy)),
                              adapters=adapters)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn_config(self.app, log_level="warning",
                                                   timeout_graceful_shutdown=self.config.shutdown_timeout))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    @property
    def state(self):
        return self.app.state.server

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(self.url + "/health").status_code != 200:
            assert time.monotonic() < deadline, f"/health not 200 after {timeout} s: {self.state.load_error}"
            time.sleep(0.05)

    def wait_all_free(self, timeout: float = 5.0) -> None:
        """Every sequence finished or aborted and every KV block back in the pool, within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                assert self.state.in_flight == 0, f"{self.state.in_flight} sequences still admitted"
                self.state.llm.check_all_free()
                return
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="session")
def server_engine(tmp_path_factory) -> Path:
    return build_tiny_engine(tmp_path_factory.mktemp("server_engine"), **SERVER_BUILD)[1]


@pytest.fixture(scope="session")
def server(server_engine):
    """The shared server: no API key, fcfs, the default queue."""
    s = RunningServer(server_engine, keepalive_s=0.5)
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="session")
def strict_server(server_engine):
    """An API key, no queue beyond one batch (8 sequences), and keep-alive comments after 20 ms without a token."""
    s = RunningServer(server_engine, api_key="sekret", max_queue=0, keepalive_s=0.02)
    s.wait_ready()
    yield s
    s.stop()


def first_data_event(lines) -> dict:
    """The first JSON event of an SSE line iterator, skipping keep-alive comments (sent during slow prefills).
    Hold on to the iterator: httpx closes the response when its line iterator is garbage-collected."""
    for line in lines:
        for event in sse_events([line]):
            if not (isinstance(event, str) and event.startswith(":")):
                return event
    raise AssertionError("the stream ended before its first data event")


def sse_events(lines) -> list:
    """The events of an SSE body: parsed JSON objects, "[DONE]", or ":comment" strings; blank lines separate."""
    import json
    events = []
    for line in lines:
        if not line:
            continue
        if line.startswith(":"):
            events.append(line)
        else:
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@contextmanager
def slow_steps(server: RunningServer, seconds: float):
    """Every engine step takes `seconds` longer (a slower model), so a test can act while a request runs."""
    core = server.state.llm.core
    real_step = core.step

    def slow_step():
        time.sleep(seconds)
        return real_step()
    core.step = slow_step
    try:
        yield
    finally:
        core.step = real_step
