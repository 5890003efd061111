"""A small request body read in Ray's HTTP proxy and carried to the replica inside the request's ASGI scope, which
Ray pickles whole into its call to the replica: the replica's app reads the body from there instead of waiting for
its callback into the proxy to fetch it (bench/NOTES.md entry 58: 2-3.5 ms a request).

    proxy    BodyInScope (a middleware, proxy_guard.middlewares): a body whose Content-Length is at most
             MAX_SCOPE_BODY is read whole, put in scope[SCOPE_KEY], and replayed to Ray's proxy app, which queues
             it for the replica's callback as before (so an app on the cluster that is not ours still gets it)
    replica  receive_with_scope_body: the app's first receive() is answered from the scope; later ones go to
             Ray's receive, the replayed copy of the body skipped, so the app sees http.disconnect as before

A chunked body, one larger than MAX_SCOPE_BODY, and one its client left while sending keep Ray's own path. Knows
nothing of Ray.
"""
from __future__ import annotations

SCOPE_KEY = "engine.body"
MAX_SCOPE_BODY = 64 * 2**10     # what a pickled scope carries cheaply; a chat request is a few KiB


class BodyInScope:
    """ASGI middleware in Ray's proxy: a small body read before Ray routes the request, and sent in its scope."""

    def __init__(self, app, max_bytes: int = MAX_SCOPE_BODY):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _small_body(scope.get("headers") or (), self.max_bytes):
            return await self.app(scope, receive, send)
        read, size, complete = [], 0, False
        while not complete and size <= self.max_bytes:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":     # the client left mid-body: Ray's path tells the replica
                break
            size += len(message.get("body", b""))
            complete = not message.get("more_body", False)
        if complete:
            body = b"".join(m.get("body", b"") for m in read)
            scope = {**scope, SCOPE_KEY: body}
            read = [body_message(body)]
        await self.app(scope, replayed(read, receive), send)


def receive_with_scope_body(scope, receive):
    """(the app's `receive`, whether the body came in the scope). The scope's copy is taken out of the scope."""
    body = scope.pop(SCOPE_KEY, None)
    if body is None:
        return receive, False

    async def after_body():
        while True:
            message = await receive()
            if message["type"] != "http.request":     # an http.request here is the proxy's replay of the body
                return message
    return replayed([body_message(body)], after_body), True


def body_message(body: bytes) -> dict:
    """A whole request body as one ASGI http.request message."""
    return {"type": "http.request", "body": body, "more_body": False}


def _small_body(headers, max_bytes: int) -> bool:
    length, chunked = None, False
    for k, v in headers:
        k = k.lower()
        if k == b"content-length":
            length = v
        elif k == b"transfer-encoding":
            chunked = True
    return not chunked and length is not None and length.isdigit() and int(length) <= max_bytes


def replayed(messages: list, receive):
    """An ASGI receive that gives `messages` first, then what `receive` gives."""
    pending = list(messages)

    async def next_message():
        if pending:
            return pending.pop(0)
        return await receive()
    return next_message
