"""--state-dir: a server killed (SIGKILL) or stopped (SIGTERM) mid-stream and restarted on the same state directory
resumes its requests, and clients that reconnect with their last event id get the rest of the text: joined, it
equals an uninterrupted run (greedy and seeded sampling), no token lost or duplicated. Real `engine serve`
processes on a tiny engine, checkpointing every 0.1 s."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from engine.runtime.server.state_file import state_path

MAX_TOKENS = 200
PROMPTS = [f"story number {i} begins" for i in range(16)]


def body(i: int, **extra) -> dict:
    """Request i: greedy, except every fourth is sampled with a seed."""
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i} if i % 4 == 3 else {"temperature": 0}
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "ignore_eos": True, **sampling, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CliServer:
    """`engine serve` in a subprocess on a fixed port (the restarted one must be found at the same address)."""

    def __init__(self, engine_dir: Path, state_dir: Path, port: int, interval: float = 0.1):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.cli", "serve", "--engine-dir", str(engine_dir), "--port", str(port),
             "--served-model-name", "tiny", "--max-kv-tokens", "2048", "--threads", "1", "--state-dir",
             str(state_dir), "--state-checkpoint-interval", str(interval), "--log-level", "warning"],
            stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, f"engine serve exited: {''.join(self.log)}"
            assert time.monotonic() < deadline, "engine serve did not become healthy"
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def read_sse(response, into: dict) -> None:
    """Parse an SSE body: text per choice into into["text"], the last `id:` into into["last"], finish reasons
    into into["finish"], [DONE] into into["done"], in-band errors into into["errors"]."""
    for line in response.iter_lines():
        if line.startswith("id: "):
            into["last"] = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
            if data == "[DONE]":
                into["done"] = True
                continue
            event = json.loads(data)
            if "error" in event:
                into["errors"].append(event["error"]["message"])
                continue
            for ch in event["choices"]:
                into["text"] += ch.get("text", "")
                if ch.get("finish_reason"):
                    into["finish"].append(ch["finish_reason"])


def stream_until_cut(url: str, request: dict, request_id: str, r: dict, read=read_sse) -> httpx.Response | None:
    """POST a streamed completion and read it into `r` until it ends or the server dies; the response (its
    status and headers), None when the server died before answering."""
    resp = None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=request, headers={"X-Request-Id": request_id},
                          timeout=120) as resp:
            read(resp, r)
    except httpx.TransportError:
        pass
    return resp


def let_clients_finish(restarted: threading.Event, clients: list[threading.Thread]) -> None:
    """The restarted server is up: the clients waiting on `restarted` reconnect, and all of them must finish."""
    restarted.set()
    for t in clients:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in clients), "a client did not finish"


def resume_stream(url: str, response_id: str, r: dict, read=read_sse) -> int:
    """Reconnect to a restarted server for the rest of a response, from the client's last event id (all of it
    without one: the text so far is dropped); the status, and the events read into `r` when it is 200."""
    headers = {"Last-Event-ID": r["last"]} if r["last"] else {}
    with httpx.stream("GET", f"{url}/v1/requests/{response_id}/stream", headers=headers, timeout=120) as resp:
        if resp.status_code == 200:
            if r["last"] is None:
                r["text"] = ""
            read(resp, r)
        return resp.status_code


def saved_ids(state_dir: Path) -> dict[str, int]:
    """Response id -> tokens generated, per response in the state file ({} before the first checkpoint)."""
    try:
        doc = json.loads(state_path(state_dir).read_text())
    except FileNotFoundError:
        return {}
    return {r["id"]: sum(len(c["sequence"]["output_token_ids"]) for c in r["choices"] if c["sequence"])
            for r in doc["responses"]}


def reference(url: str) -> list[str]:
    """The uninterrupted runs: the same requests, unstreamed, on a server that nobody stops."""
    with httpx.Client(base_url=url, timeout=120) as c:
        return [c.post("/v1/completions", json=body(i)).json()["choices"][0]["text"] for i in range(len(PROMPTS))]


def kill_when_resumable(proc: subprocess.Popen, state_dir: Path, results: list[dict], nonstream: dict) -> None:
    """SIGKILL the server at a moment when the last checkpoint holds every response its client has not had in
    full, and at least one client is mid-stream on a saved response with tokens. The tiny engine finishes all 17
    requests in under a second, faster than a few checkpoints, so the test freezes the server (SIGSTOP), lets
    the clients read what was sent, judges that still picture and either kills or lets it run on (SIGCONT)."""
    deadline = time.monotonic() + 120
    while True:
        time.sleep(0.02)
        proc.send_signal(signal.SIGSTOP)
        progress, still = None, 0
        while still < 5:                    # what was sent before the stop has reached the clients
            time.sleep(0.02)
            now = [(len(r["text"]), r["done"]) for r in results]
            progress, still = now, still + 1 if now == progress else 0
        saved = saved_ids(state_dir)
        unfinished = {f"cmpl-r{i}" for i, r in enumerate(results) if not r["done"]}
        if "response" not in nonstream:
            unfinished.add("cmpl-plain")
        mid_stream = [i for i, r in enumerate(results) if r["text"] and not r["done"] and saved.get(f"cmpl-r{i}")]
        if mid_stream and unfinished <= saved.keys():
            proc.send_signal(signal.SIGKILL)
            return
        assert unfinished and time.monotonic() < deadline, f"no checkpoint held every unfinished request: {saved}"
        proc.send_signal(signal.SIGCONT)


def test_kill_9_mid_stream_then_restart_resumes_every_request(server_engine, tmp_path):
    state_dir, port = tmp_path / "state", free_port()
    first = CliServer(server_engine, state_dir, port)
    restarted = threading.Event()
    results = [{"text": "", "last": None, "finish": [], "done": False, "errors": [], "resumed": False}
               for _ in PROMPTS]
    nonstream = {}

    def stream_client(i: int):
        try:
            resuming_client(i)
        except Exception as e:  # noqa: BLE001 - shown by the assertions below
            results[i]["errors"].append(f"client: {e!r}")

    def resuming_client(i: int):
        r = results[i]
        resp = stream_until_cut(first.url, body(i, stream=True), f"r{i}", r)
        assert resp is None or resp.headers["X-Request-Id"] == f"cmpl-r{i}"
        if r["done"]:
            return
        restarted.wait(120)
        r["resumed"] = True
        assert resume_stream(first.url, f"cmpl-r{i}", r) == 200

    def nonstream_client():
        try:
            nonstream["response"] = httpx.post(first.url + "/v1/completions", json=body(0),
                                               headers={"X-Request-Id": "plain"}, timeout=120)
            return                                  # answered before the kill
        except httpx.TransportError:
            pass
        restarted.wait(120)
        nonstream["response"] = httpx.get(first.url + "/v1/requests/cmpl-plain", timeout=120)

    clients = [threading.Thread(target=stream_client, args=(i,)) for i in range(len(PROMPTS))]
    clients.append(threading.Thread(target=nonstream_client))
    try:
        for t in clients:
            t.start()
        kill_when_resumable(first.proc, state_dir, results, nonstream)
        first.proc.wait(timeout=30)
        cut = [(len(r["text"]), r["done"]) for r in results]
        assert any(n > 0 and not done for n, done in cut), f"no stream was cut mid-way: {cut}"
        second = CliServer(server_engine, state_dir, port)
        try:
            let_clients_finish(restarted, clients)
            expected = reference(second.url)
        finally:
            second.close()
    finally:
        restarted.set()
        first.close()
    for i, r in enumerate(results):
        assert r["errors"] == [] and r["done"], (i, r)
        assert r["finish"] == ["length"], (i, r["finish"])          # exactly one finish event
        first_diff = next((k for k, (a, b) in enumerate(zip(r["text"], expected[i])) if a != b), None)
        assert r["text"] == expected[i], (f"request {i} (cut after {cut[i][0]} chars): text differs from char "
                                          f"{first_diff}, lengths {len(r['text'])} / {len(expected[i])}")
    assert sum(r["resumed"] for r in results) >= 1
    plain = nonstream["response"]
    assert plain.status_code == 200 and plain.json()["id"] == "cmpl-plain"
    choice = plain.json()["choices"][0]
    assert choice["text"] == expected[0] and choice["finish_reason"] == "length"
    assert plain.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_sigterm_saves_state_and_exits_then_resume(server_engine, tmp_path):
    state_dir, port = tmp_path / "state", free_port()
    first = CliServer(server_engine, state_dir, port, interval=60)       # only SIGTERM writes the state
    r = {"text": "", "last": None, "finish": [], "done": False, "errors": []}
    try:
        with httpx.stream("POST", first.url + "/v1/completions", json=body(3, stream=True), timeout=60) as resp:
            rid = resp.headers["X-Request-Id"]
            lines = resp.iter_lines()
            for line in lines:          # some text first
                if line.startswith("id: "):
                    r["last"] = line[4:]
                elif line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    r["text"] += json.loads(line[6:])["choices"][0]["text"]
                    break
            first.proc.send_signal(signal.SIGTERM)

            class Rest:
                def iter_lines(self):
                    return lines
            read_sse(Rest(), r)
        assert first.proc.wait(timeout=30) == 0
    finally:
        first.close()
    assert r["done"] and r["finish"] == [] and len(r["errors"]) == 1
    assert f"/v1/requests/{rid}/stream" in r["errors"][0]
    assert rid in saved_ids(state_dir)
    second = CliServer(server_engine, state_dir, port, interval=60)
    try:
        with httpx.stream("GET", f"{second.url}/v1/requests/{rid}/stream", headers={"Last-Event-ID": r["last"]},
                          timeout=60) as resp:
            read_sse(resp, r)
        assert r["errors"] == [r["errors"][0]] and r["finish"] == ["length"]
        expected = reference(second.url)[3]
        assert r["text"] == expected
        # a Last-Event-ID naming a choice the response does not have is refused, not answered with choice 0
        bad = httpx.get(f"{second.url}/v1/requests/{rid}/stream", headers={"Last-Event-ID": "0:3,4:0"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"
        assert "choice 4" in bad.json()["error"]["message"]
        # a non-streaming client polls the same response as JSON
        again = httpx.get(f"{second.url}/v1/requests/{rid}", timeout=60).json()
        assert again["choices"][0]["text"] == expected and again["usage"]["completion_tokens"] == MAX_TOKENS
        # Resuming from the start (no Last-Event-ID) sends the whole response again
        full = {"text": "", "last": None, "finish": [], "done": False, "errors": []}
        with httpx.stream("GET", f"{second.url}/v1/requests/{rid}/stream", timeout=60) as resp:
            read_sse(resp, full)
        assert full["text"] == expected and full["finish"] == ["length"] and full["done"]
    finally:
        second.close()


def test_resume_errors(server_engine, tmp_path):
    port = free_port()
    s = CliServer(server_engine, tmp_path / "state", port)
    try:
        r = httpx.get(s.url + "/v1/requests/cmpl-nothing/stream")
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        r = httpx.get(s.url + "/v1/requests/cmpl-nothing")
        assert r.status_code == 404
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"X-Request-Id": "bad id!"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
        # a request that finished on a live server is not kept: its client had it
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"X-Request-Id": "ok"})
        assert r.status_code == 200 and r.json()["id"] == "cmpl-ok" and r.headers["X-Request-Id"] == "cmpl-ok"
        assert httpx.get(s.url + "/v1/requests/cmpl-ok").status_code == 404
    finally:
        s.close()


def test_damaged_state_file_refuses_to_start(server_engine, tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    state_path(state_dir).write_text('{"format": "engine.inference_state", "format_version": 99}')
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--engine-dir", str(server_engine),
                        "--port", "0", "--state-dir", str(state_dir)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "format_version 99" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--engine-dir", str(server_engine),
                        "--state-dir", str(state_dir), "--state-checkpoint-interval", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--state-checkpoint-interval 0" in r.stderr
