"""Clients that send too much header or too slowly, over real sockets: headers beyond the limit get a 431 at once,
a connection that does not finish its headers in time or stays idle is closed (slowloris), and neither stalls a
live stream of another client. The server has short timeouts so that the tests wait little."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from engine.runtime.server.http_limits import HTTPLimits
from tests.server.conftest import RunningServer, first_data_event, slow_steps

LIMITS = HTTPLimits(max_header_bytes=64 * 1024, header_timeout_s=1.0, keep_alive_timeout_s=1.0)


@pytest.fixture(scope="module")
def limited(server_engine):
    s = RunningServer(server_engine, http=LIMITS)
    s.wait_ready()
    yield s
    s.stop()


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def send_headers(sock: socket.socket, header_bytes: int) -> None:
    """A GET whose one header holds `header_bytes`; stops quietly once the server has closed the connection."""
    data = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * header_bytes + b"\r\n\r\n"
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


def test_headers_over_the_limit_are_431_at_once(limited):
    for size in (80 * 1024, 32 * 2**20):
        with connect(limited) as sock:
            start = time.monotonic()
            send_headers(sock, size)
            answer = read_all(sock)
            took = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        assert b'"request_header_fields_too_large"' in answer and b"65536 bytes" in answer
        assert took < 3, f"a {size}-byte header took {took:.1f} s to refuse"
    many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 60) for i in range(2000))      # 2000 small headers, ~140 KB
    with connect(limited) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
        assert read_all(sock).startswith(b"HTTP/1.1 431 ")


def test_headers_under_the_limit_are_served(limited):
    r = httpx.get(limited.url + "/health", headers={"X-Big": "a" * (60 * 1024)})
    assert r.status_code == 200


def test_a_silent_connection_is_closed(limited):
    with connect(limited) as sock:
        start = time.monotonic()
        assert read_all(sock) == b""
        assert 0.8 < time.monotonic() - start < 3


def test_headers_trickling_in_are_408_and_closed(limited):
    """A slowloris client: a header byte every 0.1 s keeps bytes flowing but never ends its headers."""
    with connect(limited) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        start, closed = time.monotonic(), False
        while time.monotonic() - start < 5:
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.1)
        sock.settimeout(5)
        answer = b"" if closed else read_all(sock)
        took = time.monotonic() - start
    assert closed or answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert took < 3, f"the trickling connection stayed open {took:.1f} s"


def test_an_idle_keep_alive_connection_is_closed(limited):
    with connect(limited) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        assert read_all(sock) == b""            # closed by the server, not by a request
        assert time.monotonic() - start < 3


def test_a_stream_does_not_pause_for_another_clients_headers(limited):
    """While a stream runs, clients push 32 MB headers; the stream's longest gap stays far below what parsing
    them took before the limit (seconds)."""
    gaps, stop = [], threading.Event()

    def hostile():
        while not stop.is_set():
            with connect(limited) as sock:
                send_headers(sock, 32 * 2**20)
    with slow_steps(limited, 0.01), httpx.Client(base_url=limited.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 150, "ignore_eos": True,
                                                       "stream": True}) as r:
            lines = r.iter_lines()
            first_data_event(lines)
            pushers = [threading.Thread(target=hostile, daemon=True) for _ in range(2)]
            for t in pushers:
                t.start()
            last = time.monotonic()
            for line in lines:
                if line.startswith("data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
            stop.set()
            for t in pushers:
                t.join(timeout=30)
    assert len(gaps) > 50 and max(gaps) < 1.0, f"longest gap {max(gaps):.2f} s"
    limited.wait_all_free()
