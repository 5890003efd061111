"""HTTP/1.0 clients cannot read chunked transfer encoding (HTTP/1.1 only): a stream reaches them as plain bytes,
ended by the server closing the connection, and responses with a length keep their Content-Length."""
from __future__ import annotations

import json

from tests.server.test_slow_clients import connect, read_all


def http10(server, path: str, body: dict) -> tuple[bytes, bytes]:
    """(head, body) of one HTTP/1.0 POST, read until the server closes."""
    data = json.dumps(body).encode()
    with connect(server) as sock:
        sock.sendall(f"POST {path} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     "\r\n".encode() + data)
        head, _, rest = read_all(sock).partition(b"\r\n\r\n")
    return head.lower(), rest


def test_a_stream_to_an_http10_client_is_not_chunked(server):
    head, body = http10(server, "/v1/completions", {"prompt": "x", "max_tokens": 8, "stream": True,
                                                     "ignore_eos": True})
    assert head.startswith(b"http/1.1 200 ") and b"transfer-encoding" not in head and b"connection: close" in head
    events = [line for line in body.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events), events[:3]     # no chunk-size lines between them
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])


def test_a_whole_response_to_an_http10_client_has_its_length(server):
    head, body = http10(server, "/tokenize", {"prompt": "hello"})
    assert b"content-length: %d" % len(body) in head and json.loads(body)["count"] > 0
