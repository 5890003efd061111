"""The last resort of the HTTP server: an exception no handler expected becomes a 500 in OpenAI's shape that names
a request id, never the exception's text (it may hold paths or data of the server); the cause is logged under that
id. Starlette's own catch-all handler answers and then re-raises, which makes uvicorn drop the keep-alive
connection; this middleware answers and stops there, so the client's connection keeps serving.

    app.add_middleware(InternalErrors)      # added last: outside every other middleware
"""
from __future__ import annotations

import logging
import uuid

from fastapi.responses import JSONResponse

from .protocol import internal_error

log = logging.getLogger("engine.server")


class InternalErrors:
    """ASGI middleware: 500 with a request id for an unexpected exception before the response started."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, receive, watched_send)
        except Exception:
            if started:             # half a response went out: only closing the connection can end it
                raise
            ref = f"err-{uuid.uuid4().hex}"
            log.exception("internal error %s on %s", ref, scope.get("path"))
            await JSONResponse(internal_error(ref).body(), status_code=500,
                               headers={"X-Request-Id": ref})(scope, receive, send)
