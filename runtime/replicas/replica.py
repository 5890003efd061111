"""One replica of the server on Ray Serve: the server's own app (runtime/server/app.py create_app) and its LLM,
answering the requests the ingress (ingress.py) forwards. Every route and behaviour of `engine serve` (errors,
admission 429/503, the API key, streaming, cancellation, metrics) is that app's; this class only feeds it.

    __init__       builds the app and runs its start-up: the engine loads and warms before Ray routes here
    handle_http    one forwarded request through the app (asgi_bridge.py), its response streamed back
    metrics        this replica's Prometheus text, for the ingress's /metrics (broadcast to every replica)
    ready          raises like the app's /health when it cannot serve
    check_health   Ray's periodic probe: a replica whose engine loop died is restarted
    __del__        Ray's graceful stop: the app drains its requests and closes the engine

It is the deployment's class, wrapped by app.py with serve.deployment; it imports Ray only for its replica id.
"""
from __future__ import annotations

import asyncio
import logging

from ray import serve

from engine.core.errors import EngineError

from ..server.app import create_app
from .asgi_bridge import ForwardedRequest, call_asgi
from .config import ReplicaConfig

log = logging.getLogger("engine.replicas")
REPLICA_HEADER = b"x-engine-replica"      # each response names the replica that served it (logs, tests)


class LLMReplica:
    async def __init__(self, config: ReplicaConfig):
        self.id = serve.get_replica_context().replica_id.unique_id
        self.app = create_app(config.server, load=lambda: _load_llm(config))
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        await _until_loaded(self.app.state.server)

    async def handle_http(self, request: ForwardedRequest, prefix: tuple[int, ...] = ()):
        """The app's response to `request` (`prefix` is the router's, router.py)."""
        async for message in call_asgi(self.app, request, [(REPLICA_HEADER, self.id.encode())]):
            yield message

    def metrics(self) -> tuple[str, bytes]:
        return self.id, self.app.state.server.metrics.render()

    def ready(self) -> str:
        self.app.state.server.ready()
        return self.id

    def check_health(self) -> None:
        self.app.state.server.ready()

    async def __del__(self):
        lifespan = getattr(self, "_lifespan", None)      # absent when __init__ failed before the app started
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)


def _load_llm(config: ReplicaConfig):
    from ..llm import LLM      # onnxruntime, in the replica's process only
    e = config.engine
    return LLM(config.server.engine_dir, kv_cache_mem_fraction=e.kv_cache_mem_fraction,
               max_kv_tokens=e.max_kv_tokens, threads=e.threads, scheduling_policy=config.server.scheduling_policy,
               stream_interval=e.stream_interval, speculative_config=e.speculative_config)


async def _until_loaded(state) -> None:
    """Wait for the app's background load (app.py _load_engine); a failure fails the replica's start, which Ray
    retries and then reports."""
    while state.starting:
        if state.load_error is not None:
            raise EngineError(f"the replica's engine failed to load: {state.load_error}")
        await asyncio.sleep(0.05)
