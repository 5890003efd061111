"""What Ray's HTTP proxy calls in each replica: an ASGI app before the server's own (runtime/server/app.py). Ray's
proxy sends every request straight to a replica, the least loaded (router.py): one hop, where an ingress deployment
before the replicas cost a second hop and a second read of the body.

    client -> Ray proxy -> replica A's front --(A owns the prompt's prefix, or nobody does)--> A's server app
                                            \\--(replica B owns it)--> handle_http(request, prefer=B) --> B's app

The front answers itself only what one replica's app cannot:
    /metrics     every replica's metrics, each series labelled with its replica (metrics_merge.py)
    a prefix     owned by another replica (peers.py): the request is forwarded there once, as a whole, and its
                 response relayed; if that replica has gone before answering, this one serves it
    a full queue here (the app's 429): the request is forwarded once to the least-loaded other replica, and the
                 429 sent only if that one refuses too. Ray's loads lag a burst of requests, so the proxy may send
                 a replica more than it holds while another has room
A small POST body comes inside the request's scope (read by the proxy's middleware, scope_body.py), sparing the
replica a callback into the proxy; engine:replica_request_bodies_total{via="scope"|"proxy"} counts which way each came.
Everything else (errors, the API key, admission 429, /health, streaming, cancellation) is the server app's, run here.
A forwarded stream whose replica dies ends with an error event and [DONE]; one served here is mended the same way by
the proxy's middleware (proxy_guard.py), as the replica that wrote it is gone.
"""
from __future__ import annotations

import logging
import uuid

from prometheus_client import Counter
from ray import exceptions as ray_errors
from ray.serve import exceptions as serve_errors

from ..server.api_errors import APIError, internal_error
from ..server.metrics import CONTENT_TYPE
from ..server.sse import sse_data
from .asgi_bridge import ForwardedRequest, ResponseStart
from .metrics_merge import merge_replica_metrics
from .prefix_key import GENERATION_PATHS, prefix_hashes
from .proxy_guard import replica_failed
from .scope_body import body_message, receive_with_scope_body, replayed

log = logging.getLogger("engine.replicas")
REPLICA_HEADER = b"x-engine-replica"      # each response names the replica that served it (logs, tests)
VIA_HEADER = b"x-engine-via"              # and the one that relayed it, when forwarded: it fails if either dies
# A replica that died, or that Ray no longer reaches.
REPLICA_GONE = (ray_errors.RayActorError, ray_errors.WorkerCrashedError, ray_errors.NodeDiedError,
                ray_errors.ObjectLostError, serve_errors.ReplicaUnavailableError,
                serve_errors.DeploymentUnavailableError)


class ReplicaFront:
    def __init__(self, app, peers, *, by_prefix: bool, spill: bool, max_body_bytes: int, registry=None):
        self.app, self.peers = app, peers          # peers: peers.Peers
        self.by_prefix, self.spill, self.max_body_bytes = by_prefix, spill, max_body_bytes
        self.header = (REPLICA_HEADER, peers.me.encode())
        self.bodies = Counter("engine:replica_request_bodies", "POST request bodies by how they reached this "
                              "replica: in the request's scope, or fetched from Ray's proxy.", ["via"],
                              registry=registry)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":           # the server app's lifespan is the replica's (replica.py)
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path = scope["method"], scope["path"]
        receive, in_scope = receive_with_scope_body(scope, receive)
        if method == "POST":
            self.bodies.labels("scope" if in_scope else "proxy").inc()
        if method == "GET" and path == "/metrics":
            return await self._metrics(send)
        if not ((self.by_prefix or self.spill) and method == "POST" and path in GENERATION_PATHS):
            return await self.app(scope, receive, self._send_here(send))
        body = await _read_body(receive, self.max_body_bytes)
        owner = self.peers.owner_of(prefix_hashes(path, body)) if self.by_prefix else None
        if owner is not None and await self._forwarded(scope, body, owner, send):
            return
        held = []       # the app's 429 for a full queue, kept while another replica is asked
        # the body already read, then the proxy's own receive (a disconnect, when the client leaves)
        await self.app(scope, replayed([body_message(body)], receive),
                       self._send_here(send, held if self.spill else None))
        if held and not await self._forwarded(scope, body, None, send):
            for message in held:
                await send(message)

    def _send_here(self, send, held: list | None = None):
        async def send_here(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": _without_request_id(message.get("headers", ())) + [self.header]}
                if held is not None and message["status"] == 429:
                    held.append(message)
                    return
            if held:
                held.append(message)
                return
            await send(message)
        return send_here

    async def _forwarded(self, scope, body: bytes, owner: str | None, send) -> bool:
        """The request served by `owner` (None: the least loaded other replica) and its response relayed; False
        when no response began (that replica went away), for this one to answer it."""
        request = ForwardedRequest(scope["method"], scope["path"], scope.get("query_string", b""),
                                   list(scope.get("headers", ())), body, scope.get("client"),
                                   scope.get("http_version", "1.1"))
        stream = self.peers.handle.options(stream=True).handle_http.remote(request, prefer=owner, avoid=self.peers.me)
        try:
            start = await stream.__anext__()
        except Exception as e:  # noqa: BLE001 - served here instead
            _cancel(stream)
            log.info("forwarding to replica %s failed (%r); answering it here", owner, e)
            return False
        except BaseException:
            _cancel(stream)
            raise
        assert isinstance(start, ResponseStart), start
        await _relay(ResponseStart(start.status, start.headers + [(VIA_HEADER, self.header[1])]), stream, send)
        return True

    async def _metrics(self, send) -> None:
        texts = {r[0]: r[1].decode() for r in await self.peers.broadcast("metrics") if isinstance(r, tuple)}
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", CONTENT_TYPE.encode())]})
        await send({"type": "http.response.body", "body": merge_replica_metrics(texts), "more_body": False})


async def _relay(start: ResponseStart, stream, send) -> None:
    """Another replica's response, as it arrives. A client that goes away cancels this task (Ray does), and the
    finally cancels the other replica's call with it."""
    sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)
    await send({"type": "http.response.start", "status": start.status, "headers": _without_request_id(start.headers)})
    try:
        async for chunk in stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except Exception as e:  # noqa: BLE001 - the client gets an error in the stream, the cause is logged
        if not sse:    # a JSON body cannot be mended: it is cut, and the client sees the broken response
            raise
        error = replica_error(e)
        await send({"type": "http.response.body", "body": (sse_data(error.body()) + "data: [DONE]\n\n").encode(),
                    "more_body": True})
    finally:
        _cancel(stream)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def replica_error(e: Exception) -> APIError:
    if isinstance(e, REPLICA_GONE):
        log.warning("a replica failed while serving a request: %r", e)
        return replica_failed()
    ref = f"err-{uuid.uuid4().hex}"
    log.error("internal error %s: %r", ref, e)
    return internal_error(ref)


def _without_request_id(headers) -> list:
    """Ray's proxy adds its X-Request-Id (the client's, or one it made, which the app was given and used in the
    response's id), so the app's copy is left out."""
    return [(k, v) for k, v in headers if k.lower() != b"x-request-id"]


async def _read_body(receive, limit: int) -> bytes:
    """The body, or its first limit + 1 bytes when longer: the app answers that 413 as it would to a client of its
    own, and the front never holds more than that of it."""
    chunks, size, more = [], 0, True
    while more and size <= limit:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
    return b"".join(chunks)[:limit + 1]


def _cancel(stream) -> None:
    """End the call on its replica (a no-op once it finished). Ray's cancel() raises again the error of a call it
    never assigned to a replica (a full queue), which the caller has dealt with already."""
    try:
        stream.cancel()
    except Exception:  # noqa: BLE001 - see above
        pass


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
