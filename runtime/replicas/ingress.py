"""The ingress of the server on Ray Serve: it takes every HTTP request from Ray's proxy, reads its body, and forwards
it whole to one replica (replica.py) through a deployment handle whose router (router.py) picks the replica by the
prompt's prefix (prefix_key.py); the replica's response streams back unchanged.

    client -> Ray proxy -> Ingress ---- handle_http(request, prefix=hashes) ----> LLMReplica (the server's app)
                                   <--- ResponseStart, body chunks ------------

It answers itself only what no single replica can:
    /metrics        every replica's metrics, each series labelled with its replica (metrics_merge.py)
    /health         200 while at least one replica can serve, else 503
    429             more requests in flight than the replicas' capacity (max batch size + max queue each): Ray
                    sends a replica no more than its capacity and holds the rest, up to this bound
    503             the replica died before answering; a stream it was writing ends with an error event and
                    [DONE], so its client fails at once rather than hanging, and other requests go on
A client that goes away cancels the handle's call, which the replica turns into the app's own disconnect.
"""
from __future__ import annotations

import logging
import uuid
import weakref
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from ray import exceptions as ray_errors
from ray.serve import exceptions as serve_errors
from starlette.requests import Request
from starlette.responses import Response

from ..server.metrics import CONTENT_TYPE
from ..server.api_errors import APIError, internal_error
from ..server.sse import sse_data
from .asgi_bridge import ForwardedRequest, ResponseStart
from .metrics_merge import merge_replica_metrics
from .prefix_key import prefix_hashes

log = logging.getLogger("engine.replicas")

# A replica that died, or that Ray no longer reaches: the request can be sent again.
_REPLICA_GONE = (ray_errors.RayActorError, ray_errors.WorkerCrashedError, ray_errors.NodeDiedError,
                 ray_errors.ObjectLostError, serve_errors.ReplicaUnavailableError,
                 serve_errors.DeploymentUnavailableError)
BROADCAST_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class IngressConfig:
    max_body_bytes: int
    retry_after_s: int
    max_in_flight: int       # requests forwarded and not yet answered in full: the replicas' capacity, then 429


class Ingress:
    def __init__(self, replicas, config: IngressConfig):
        self.replicas, self.config = replicas, config      # replicas: the DeploymentHandle of LLMReplica
        self.in_flight = 0

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path == "/metrics":
            return await self._metrics()
        if request.method == "GET" and path == "/health":
            return await self._health()
        if self.in_flight >= self.config.max_in_flight:
            return self._error_response(self._overloaded())
        self.in_flight += 1
        release = _once(self._release)
        try:
            response = await self._forward(request)
        except BaseException:
            release()
            raise
        if not isinstance(response, _ReplicaResponse):
            release()
            return response
        response.on_end = release
        weakref.finalize(response, release)    # a response Ray never sends (its client left first) frees its place
        return response

    def _release(self) -> None:
        self.in_flight -= 1

    async def _forward(self, request: Request) -> Response:
        """The request, forwarded whole to the replica the router picks; its response, or the error that ended it
        before the response began."""
        path = request.url.path
        body = await _read_body(request, self.config.max_body_bytes)
        forwarded = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                                     list(request.headers.raw), body, request.scope.get("client"),
                                     request.scope.get("http_version", "1.1"))
        stream = None
        try:    # a dead replica shows at the first message
            stream = self.replicas.options(stream=True).handle_http.remote(forwarded,
                                                                           prefix=prefix_hashes(path, body))
            start = await stream.__anext__()
        except BaseException as e:  # noqa: BLE001 - cancellation and failures alike end the call on the replica
            if stream is not None:
                _cancel(stream)
            if not isinstance(e, Exception):
                raise
            return self._error_response(self._api_error(e))
        assert isinstance(start, ResponseStart), start
        return _ReplicaResponse(start, stream, self._api_error)

    @staticmethod
    def _error_response(error: APIError) -> Response:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    def _overloaded(self) -> APIError:
        return APIError(f"the server is overloaded: every replica is at its capacity ({self.in_flight} requests in "
                        f"flight, limit {self.config.max_in_flight}); retry later", status=429,
                        type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(self.config.retry_after_s)})

    def _api_error(self, e: Exception) -> APIError:
        retry = {"Retry-After": str(self.config.retry_after_s)}
        if isinstance(e, serve_errors.BackPressureError):       # a max_queued_requests set in a Serve config
            return self._overloaded()
        if isinstance(e, _REPLICA_GONE):
            log.warning("a replica failed while serving a request: %s", e)
            return APIError("the replica serving this request stopped; send the request again", status=503,
                            type="service_unavailable", code="replica_failed", headers=retry)
        ref = f"err-{uuid.uuid4().hex}"
        log.error("internal error %s: %r", ref, e)
        return internal_error(ref)

    async def _metrics(self) -> Response:
        texts = {r[0]: r[1].decode() for r in await self._broadcast("metrics") if isinstance(r, tuple)}
        return Response(merge_replica_metrics(texts), media_type=CONTENT_TYPE)

    async def _health(self) -> Response:
        if any(isinstance(r, str) for r in await self._broadcast("ready")):
            return Response(status_code=200)
        return self._error_response(APIError("no replica is ready to serve", status=503,
                                             type="service_unavailable",
                                             headers={"Retry-After": str(self.config.retry_after_s)}))

    async def _broadcast(self, method: str) -> list:
        """`method`'s result from every replica, an exception in place of each that failed; [] on a timeout or
        while Ray knows of no replica yet."""
        try:
            return await self.replicas.broadcast(method).results_async(timeout_s=BROADCAST_TIMEOUT_S,
                                                                      return_exceptions=True)
        except (TimeoutError, serve_errors.RayServeException):
            return []


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or its first limit + 1 bytes when longer: the replica's app answers that 413 as it would to a client
    of its own, and the ingress never holds more than that of it."""
    chunks, size = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            break
    return b"".join(chunks)[:limit + 1]


def _once(fn):
    done = False

    def call():
        nonlocal done
        if not done:
            done = True
            fn()
    return call


def _cancel(stream) -> None:
    """End the call on its replica (a no-op once it finished). Ray's cancel() raises again the error of a call it
    never assigned to a replica (a full queue), which the caller has answered already."""
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001 - see above
        pass


class _ReplicaResponse(Response):
    """The replica's response, relayed as it arrives. Not a StreamingResponse: that one also listens for the client's
    disconnect on `receive`, where Ray's proxy raises once a finished request's messages are closed; Ray cancels
    this task itself when the client goes away, and the finally cancels the replica's call with it."""

    def __init__(self, start: ResponseStart, stream, api_error):
        self.start, self.stream, self.api_error = start, stream, api_error
        self.on_end = lambda: None
        self.status_code = start.status
        # The response id is the request's X-Request-Id (the client's, or the one Ray's proxy made and passed on) with
        # cmpl-/chatcmpl- before it; Ray's proxy adds its own X-Request-Id header, so the replica's is left out.
        self.raw_headers = [(k, v) for k, v in start.headers if k.lower() != b"x-request-id"]
        self.sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)

    async def __call__(self, scope, receive, send):
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception as e:  # noqa: BLE001 - the client gets an error in the stream, the cause is logged
            if not self.sse:    # a JSON body cannot be mended: it is cut, and the client sees the broken response
                raise
            error = self.api_error(e)
            await send({"type": "http.response.body", "body": (sse_data(error.body()) + "data: [DONE]\n\n").encode(),
                        "more_body": True})
        finally:
            _cancel(self.stream)
            self.on_end()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
