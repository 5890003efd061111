"""asgi_bridge: a forwarded request runs through an ASGI app as through uvicorn; a caller that stops reading
makes the app see its client disconnect."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.runtime.replicas.asgi_bridge import ForwardedRequest, ResponseStart, call_asgi


def make_app(events: list):
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.json()
        return JSONResponse({"got": body, "q": request.query_params.get("q"), "h": request.headers.get("x-k")},
                            status_code=201)

    @app.get("/stream")
    async def stream():
        async def tokens():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.01)
            finally:
                events.append("stream closed")
        return StreamingResponse(tokens(), media_type="text/event-stream")

    return app


def request(method: str, path: str, body: bytes = b"", query: bytes = b"", headers=()) -> ForwardedRequest:
    return ForwardedRequest(method, path, query, [(b"content-type", b"application/json"), *headers], body)


async def collect(gen) -> list:
    return [m async for m in gen]


def test_a_json_request_gets_the_apps_status_headers_and_body():
    messages = asyncio.run(collect(call_asgi(make_app([]), request("POST", "/echo", b'{"a": 1}', b"q=7",
                                                                    [(b"x-k", b"v")]), [(b"x-extra", b"1")])))
    start, body = messages[0], b"".join(messages[1:])
    assert isinstance(start, ResponseStart) and start.status == 201
    assert (b"x-extra", b"1") in start.headers
    assert body == b'{"got":{"a":1},"q":"7","h":"v"}'


def test_an_unknown_route_is_the_apps_404():
    messages = asyncio.run(collect(call_asgi(make_app([]), request("GET", "/nope"))))
    assert messages[0].status == 404


def test_a_caller_that_stops_reading_disconnects_the_apps_stream():
    events: list = []

    async def read_three_then_stop():
        gen = call_asgi(make_app(events), request("GET", "/stream"))
        got = []
        async for m in gen:
            got.append(m)
            if len(got) == 4:       # the start and three chunks (or more, coalesced)
                break
        await gen.aclose()
        return got

    got = asyncio.run(read_three_then_stop())
    assert isinstance(got[0], ResponseStart) and got[1].startswith(b"data: 0")
    assert events == ["stream closed"]


def test_chunks_that_wait_together_leave_as_one():
    async def main():
        app = FastAPI()

        @app.get("/burst")
        async def burst():
            async def parts():
                for i in range(50):
                    yield f"{i},"
            return StreamingResponse(parts())
        gen = call_asgi(app, request("GET", "/burst"))
        start = await gen.__anext__()
        await asyncio.sleep(0.05)               # the app has written everything meanwhile
        return start, [m async for m in gen]
    start, chunks = asyncio.run(main())
    assert start.status == 200 and b"".join(chunks) == "".join(f"{i}," for i in range(50)).encode()
    assert len(chunks) < 50
