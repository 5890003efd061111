"""A lone UTF-16 surrogate ("\\ud800" in the JSON) is valid JSON but no Unicode text: wherever a client puts one,
the answer is a 400 naming that field, never a 500, and the keep-alive connection it came on keeps serving.
The requests go over one raw socket, so a connection the server dropped fails the test."""
from __future__ import annotations

import json
import socket

import pytest

LONE = "\\ud800"          # JSON's escape, sent as these six characters
CHAT = '{"messages": [{"role": "user", "content": %s}]}'


def exchange(sock: socket.socket, path: str, body: str) -> tuple[int, dict]:
    """One HTTP/1.1 keep-alive request on `sock`: (status, JSON body)."""
    data = body.encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    f = sock.makefile("rb")
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    assert headers.get("connection") != "close", f"the server closes the connection after {status}"
    return status, json.loads(f.read(int(headers["content-length"])))


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "a%sb"}' % LONE, "prompt"),
    ("/v1/completions", '{"prompt": "x%s", "stream": true}' % LONE, "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "%s"]}' % LONE, "prompt[1]"),
    ("/v1/completions", '{"prompt": "x", "stop": ["%s"]}' % LONE, "stop[0]"),
    ("/v1/completions", '{"prompt": "x", "model": "m%s"}' % LONE, "model"),
    ("/v1/chat/completions", CHAT % f'"{LONE}"', "messages[0].content"),
    ("/v1/chat/completions", CHAT % f'[{{"type": "text", "text": "{LONE}"}}]', "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "%s": 1}]}' % LONE, "messages[0]"),
    ("/tokenize", '{"prompt": "%s"}' % LONE, "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "%s"}]}' % LONE, "messages[0].content"),
    ("/detokenize", '{"tokens": [1], "model": "%s"}' % LONE, "model"),
])
def test_a_lone_surrogate_is_400_naming_the_field(server, path, body, param):
    with socket.create_connection(server.url.removeprefix("http://").split(":"), timeout=30) as sock:
        status, err = exchange(sock, path, body)
        assert status == 400, err
        assert err["error"]["param"] == param and err["error"]["code"] == "invalid_value"
        assert param in err["error"]["message"] and "surrogate" in err["error"]["message"]
        status, ok = exchange(sock, "/tokenize", '{"prompt": "hello"}')     # the same connection still serves
        assert status == 200 and ok["count"] > 0
    server.wait_all_free()
