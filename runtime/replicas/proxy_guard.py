"""The middlewares of Ray's HTTP proxy: a small request body sent to the replica in the request's scope
(scope_body.py), and StreamEndGuard: an event stream that its replica stopped writing (the replica died) ends with
an error event and [DONE], as the server ends its own failed streams, so the client fails at once and knows why,
instead of reading a cut connection.

    data: {"choices": ...}            <- the replica's, relayed by the proxy
    data: {"error": {"code": "replica_failed", ...}}
    data: [DONE]                      <- this middleware's, when the proxy's call ended without the stream's end

Ray 2.60 takes a proxy's middlewares only from the environment of the cluster's processes: `engine serve --ray`
sets PROXY_CALLBACK_ENV for a cluster it starts (run.py); `ray start` of a cluster that `serve run` or a RayService
deploys to needs RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=engine.runtime.replicas.proxy_guard:middlewares in its
environment. It imports no Ray.
"""
from __future__ import annotations

from starlette.middleware import Middleware

from ..server.api_errors import APIError
from ..server.sse import sse_data
from .scope_body import BodyInScope

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "engine.runtime.replicas.proxy_guard:middlewares"


def replica_failed() -> APIError:
    return APIError("the replica serving this request stopped; send the request again", status=503,
                    type="service_unavailable", code="replica_failed")


class StreamEndGuard:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = {"sse": False, "open": False}

        async def watched(message):
            if message["type"] == "http.response.start":
                state["sse"] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                   for k, v in message.get("headers", ()))
                state["open"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["open"] = False
            await send(message)
        try:
            await self.app(scope, receive, watched)
        finally:
            if state["sse"] and state["open"]:
                await _end_stream(send)


async def _end_stream(send) -> None:
    body = (sse_data(replica_failed().body()) + "data: [DONE]\n\n").encode()
    try:
        await send({"type": "http.response.body", "body": body, "more_body": False})
    except Exception:  # noqa: BLE001 - the client left first: nobody to tell
        pass


def middlewares() -> list[Middleware]:
    """The proxy's middlewares, for RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH."""
    return [Middleware(StreamEndGuard), Middleware(BodyInScope)]
