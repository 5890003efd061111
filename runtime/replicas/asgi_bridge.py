"""One HTTP request, already read whole, through an ASGI app in this process, its response streamed back as
messages: how a replica runs the server's own app (runtime/server/app.py) for a request another replica forwarded.

    ForwardedRequest --> app(scope, receive, send) --> ResponseStart(status, headers), then body bytes, ...

Body chunks that are ready together leave as one message (under load, fewer messages through Ray per token).
When the caller stops reading (its client went away, or it was cancelled), the app's `receive` answers
http.disconnect and what it sends after is dropped, so the app aborts the request as it would for a client of its
own. Knows nothing of Ray.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None
    http_version: str = "1.1"


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


_END = object()


async def call_asgi(app, request: ForwardedRequest,
                    extra_headers: list[tuple[bytes, bytes]] = ()) -> AsyncIterator[ResponseStart | bytes]:
    """The response of `app` to `request`: a ResponseStart (with `extra_headers` added), then its body chunks."""
    queue: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if disconnected.is_set():
            return
        if message["type"] == "http.response.start":
            queue.put_nowait(ResponseStart(message["status"], list(message.get("headers", ())) + list(extra_headers)))
        elif message["type"] == "http.response.body":
            queue.put_nowait(message.get("body", b""))
            if not message.get("more_body", False):
                queue.put_nowait(_END)

    async def run():
        try:
            await app(_scope(request), receive, send)
        finally:
            queue.put_nowait(_END)       # an app that ends without a complete response ends the stream too

    task = asyncio.create_task(run())
    try:
        async for message in _coalesced(queue):
            yield message
        await task
    finally:
        disconnected.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=5.0)   # the app's own abort path runs (frees the request)
            except (asyncio.TimeoutError, Exception):       # noqa: BLE001 - the caller is gone either way
                task.cancel()


async def _coalesced(queue: asyncio.Queue) -> AsyncIterator[ResponseStart | bytes]:
    """The queue's messages until _END, body chunks that are already waiting joined into one."""
    while True:
        message = await queue.get()
        if message is _END:
            return
        if isinstance(message, ResponseStart):
            yield message
            continue
        chunks, end = [message], False
        while not queue.empty() and not end:       # the start always comes first: the rest are bytes or _END
            nxt = queue.get_nowait()
            end = nxt is _END
            if not end:
                chunks.append(nxt)
        if any(chunks):
            yield b"".join(chunks)
        if end:
            return


def _scope(request: ForwardedRequest) -> dict:
    path = request.path
    return {
        "type": "http", "http_version": request.http_version, "method": request.method, "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": request.query_string,
        "headers": request.headers, "client": request.client, "server": None,
        # 2.3, not 2.4: Starlette's StreamingResponse then listens for http.disconnect and stops a stream at once,
        # instead of noticing only at its next write.
        "asgi": {"version": "3.0", "spec_version": "2.3"}, "state": {},
    }
