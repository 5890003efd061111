"""proxy_guard: an event stream cut off by its replica's death ends with an error event and [DONE]; a whole stream and
a JSON response are passed through unchanged."""
from __future__ import annotations

import asyncio
import json

from engine.runtime.replicas.proxy_guard import StreamEndGuard

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def run(app) -> list[dict]:
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.disconnect"}
    asyncio.run(StreamEndGuard(app)({"type": "http", "path": "/v1/completions"}, receive, send))
    return sent


def cut_stream(headers):
    async def app(scope, receive, send):     # as Ray's proxy does when the replica dies mid-stream
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
    return app


def test_a_cut_event_stream_ends_with_the_replicas_error_and_done():
    sent = run(cut_stream(SSE))
    last = sent[-1]
    assert last["more_body"] is False
    event, done = last["body"].decode().split("\n\n")[:2]
    error = json.loads(event.removeprefix("data: "))["error"]
    assert error["code"] == "replica_failed" and "replica" in error["message"] and done == "data: [DONE]"


def test_whole_streams_and_cut_json_pass_unchanged():
    async def whole(scope, receive, send):
        await cut_stream(SSE)(scope, receive, send)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
    assert [m.get("body") for m in run(whole)] == [None, b"data: {}\n\n", b"data: [DONE]\n\n"]
    assert len(run(cut_stream([(b"content-type", b"application/json")]))) == 2
