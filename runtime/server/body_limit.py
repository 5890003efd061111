"""The request-body size limit of the HTTP server: bodies over max_bytes are answered 413 in OpenAI's error shape.

A body is refused before it is read when its Content-Length says it is too large, and while it is read when it
arrives in chunks (no Content-Length, or one that lies): the app sees at most max_bytes of it, so a client cannot
make the server buffer, parse or tokenize an unbounded body. Prompts that fit the body limit but not the model are
the serving layer's business (400, context_length_exceeded). This module knows nothing of the routes.

    app.add_middleware(BodySizeLimit, max_bytes=4 * 2**20)
"""
from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .protocol import APIError


def _message(max_bytes: int) -> str:
    return (f"the request body is larger than this server accepts ({max_bytes} bytes, --max-body-bytes); send a "
            "shorter prompt or fewer messages")


class BodyTooLarge(HTTPException):
    """Raised from the body stream once it passes the limit; FastAPI passes HTTPExceptions through its body
    parsing (anything else would become a 400), and the app's handler answers it in OpenAI's shape."""

    def __init__(self, max_bytes: int):
        super().__init__(status_code=413, detail=_message(max_bytes))


class BodySizeLimit:
    """ASGI middleware: 413 for HTTP request bodies over `max_bytes`."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            error = APIError(_message(self.max_bytes), status=413, code="request_too_large")
            return await JSONResponse(error.body(), status_code=413)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)
