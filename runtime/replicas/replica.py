"""One replica of the server on Ray Serve: the server's own app (runtime/server/app.py create_app) and its LLM,
taking HTTP requests from Ray's proxy through its front (front.py) and requests that another replica forwards.
Every route and behaviour of `engine serve` (errors, admission 429/503, the API key, streaming, cancellation, /health)
is that app's; this class only feeds it.

    __init__                  builds the app and runs its start-up: the engine loads and warms before Ray routes here
    __serve_build_asgi_app__  the front, which Ray's proxy calls (Ray's late-bound ingress)
    handle_http               a request another replica forwarded (asgi_bridge.py), its response streamed back
    metrics, replica_id       for the other replicas' /metrics and live sets (peers.py's broadcasts)
    learn                     another replica took these prompt prefixes
    check_health              Ray's periodic probe: a replica whose engine loop died is restarted
    __del__                   Ray's graceful stop: the app drains its requests and closes the engine
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ray import serve

from engine.core.errors import EngineError

from ..server.app import create_app
from .affinity import AffinityConfig
from .asgi_bridge import ForwardedRequest, call_asgi
from .config import ReplicaConfig
from .front import ReplicaFront
from .peers import Peers

log = logging.getLogger("engine.replicas")


@dataclass(frozen=True)
class RoutingConfig:
    by_prefix: bool               # a request whose prompt prefix another replica owns goes there once
    spill: bool                   # a request this replica's full queue refuses goes once to another
    affinity: AffinityConfig


@serve.ingress()
class LLMReplica:
    async def __init__(self, config: ReplicaConfig, routing: RoutingConfig):
        context = serve.get_replica_context()
        self.id = context.replica_id.unique_id
        self.server_app = create_app(config.server, load=lambda: _load_llm(config))
        self._lifespan = self.server_app.router.lifespan_context(self.server_app)
        await self._lifespan.__aenter__()
        await _until_loaded(self.server_app.state.server)
        deployment = context.replica_id.deployment_id
        self.peers = Peers(self.id, serve.get_deployment_handle(deployment.name, deployment.app_name),
                           routing.affinity)
        self.front = ReplicaFront(self.server_app, self.peers, by_prefix=routing.by_prefix, spill=routing.spill,
                                  max_body_bytes=config.server.max_body_bytes,
                                  registry=self.server_app.state.server.metrics.registry)

    def __serve_build_asgi_app__(self):
        return self.front

    async def handle_http(self, request: ForwardedRequest, prefer: str | None = None, avoid: str | None = None):
        """The app's response to a forwarded request (`prefer` and `avoid` are the router's, router.py)."""
        async for message in call_asgi(self.server_app, request, [self.front.header]):
            yield message

    def metrics(self) -> tuple[str, bytes]:
        return self.id, self.server_app.state.server.metrics.render()

    def replica_id(self) -> str:
        return self.id

    def learn(self, claims: list[tuple[int, ...]], replica: str) -> None:
        self.peers.learn(claims, replica)

    def check_health(self) -> None:
        self.server_app.state.server.ready()

    async def __del__(self):
        peers = getattr(self, "peers", None)
        if peers is not None:
            peers.close()
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
