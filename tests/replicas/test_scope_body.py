"""scope_body: a small body read in the proxy travels in the scope and is replayed to Ray's proxy app; the replica's
app gets it once from the scope, then the client's disconnect. Chunked, large, and cut bodies pass untouched."""
from __future__ import annotations

import asyncio

from engine.runtime.replicas.scope_body import SCOPE_KEY, BodyInScope, receive_with_scope_body


def through_proxy(headers, messages) -> tuple[dict, list]:
    """(the scope Ray's proxy app saw, every message it received) for a client sending `messages`."""
    seen = {}

    async def proxy_app(scope, receive, send):        # as Ray's proxy: it reads the client until it disconnects
        seen["scope"], seen["messages"] = scope, []
        while not seen["messages"] or seen["messages"][-1]["type"] != "http.disconnect":
            seen["messages"].append(await receive())

    pending = list(messages) + [{"type": "http.disconnect"}]

    async def receive():
        return pending.pop(0)
    asyncio.run(BodyInScope(proxy_app, max_bytes=16)({"type": "http", "headers": headers}, receive, None))
    return seen["scope"], seen["messages"]


def part(body: bytes, more: bool) -> dict:
    return {"type": "http.request", "body": body, "more_body": more}


def test_a_small_body_travels_in_the_scope_and_is_replayed_whole_to_the_proxy():
    scope, got = through_proxy([(b"content-length", b"6")], [part(b"abc", True), part(b"def", False)])
    assert scope[SCOPE_KEY] == b"abcdef"
    assert got == [part(b"abcdef", False), {"type": "http.disconnect"}]


def test_large_chunked_and_cut_bodies_keep_rays_path():
    for headers, messages in (([(b"content-length", b"17")], [part(b"x" * 17, False)]),
                              ([(b"transfer-encoding", b"chunked")], [part(b"abc", False)]),
                              ([], [part(b"", False)]),
                              ([(b"content-length", b"6")], [part(b"abc", True)])):     # then the client left
        scope, got = through_proxy(headers, messages)
        assert SCOPE_KEY not in scope and got == messages + [{"type": "http.disconnect"}]


def test_the_replicas_app_reads_the_body_from_the_scope_then_the_disconnect():
    proxied = [part(b"abcdef", False), {"type": "http.disconnect"}]    # Ray's receive: the replayed body first

    async def ray_receive():
        return proxied.pop(0)

    async def app_reads():
        scope = {"type": "http", SCOPE_KEY: b"abcdef"}
        receive, in_scope = receive_with_scope_body(scope, ray_receive)
        assert in_scope and SCOPE_KEY not in scope
        return [await receive(), await receive()]
    assert asyncio.run(app_reads()) == [part(b"abcdef", False), {"type": "http.disconnect"}]
    assert receive_with_scope_body({"type": "http"}, ray_receive) == (ray_receive, False)
