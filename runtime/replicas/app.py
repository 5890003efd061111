"""The Ray Serve application: N LLMReplica replicas, each the HTTP ingress (front.py) of its own server app.

    build_application(replica, cluster)   from the configs (`engine serve --ray` uses it, run.py)
    build_app(args)                       the builder for Ray's own tools, with the same settings as arguments:

    serve run engine.runtime.replicas.app:build_app engine_dir=/models/eng replicas=2 threads=8
    # or in a Serve config file / a KubeRay RayService:  import_path: engine.runtime.replicas.app:build_app

Each replica reserves `threads` CPUs from Ray and admits its server's capacity (max batch size + max queue) of
requests; Ray's proxy sends each request to the least-loaded replica, and a replica that is full passes it once to
another (front.py), which answers 429 itself if full too (at once, as `engine serve` does). Ray sends a replica up to
HEADROOM more than its capacity, the requests it refuses and those of /metrics and /health.
The engine directory must be readable at the same path here and on every node that runs a replica (a shared volume,
or a copy on each).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..engine_dir import load_engine_config
from ..server.config import ServerConfig
from ..speculative.config import SpeculativeConfig
from .affinity import AffinityConfig
from .config import ClusterConfig, EngineOptions, ReplicaConfig
from .replica import LLMReplica, RoutingConfig
from .router import PrefixAwareRouter

APP_NAME = "engine"
# Ray logs a line per request and deployment hop (two for each request here), which its log monitor then ships
# to the driver: CPU on every request that `engine serve` does not spend (it runs uvicorn without an access log).
NO_ACCESS_LOG = {"enable_access_log": False}
HEADROOM = 64


def build_application(replica: ReplicaConfig, cluster: ClusterConfig):
    """The bound application (serve.run takes it): the replicas, each its own ingress."""
    server = replica.server
    build = load_engine_config(server.engine_dir).build         # a bad engine dir fails here, before any replica
    capacity = build.max_batch_size + server.max_queue
    replicas = serve.deployment(LLMReplica, name="LLMReplica").options(
        **_scaling(cluster, build.max_batch_size),
        max_ongoing_requests=capacity + HEADROOM,
        ray_actor_options={"num_cpus": replica.engine.threads},
        graceful_shutdown_timeout_s=server.shutdown_timeout,
        request_router_config=_router(cluster), logging_config=NO_ACCESS_LOG)
    several = (cluster.max_replicas or cluster.replicas) > 1
    return replicas.bind(replica, RoutingConfig(cluster.routing == "prefix" and several, several, cluster.affinity))


def _scaling(cluster: ClusterConfig, max_batch_size: int) -> dict:
    if not cluster.autoscaling:
        return {"num_replicas": cluster.replicas}
    return {"autoscaling_config": {"min_replicas": cluster.min_replicas, "max_replicas": cluster.max_replicas,
                                   "initial_replicas": max(cluster.min_replicas, min(cluster.replicas,
                                                                                     cluster.max_replicas)),
                                   "target_ongoing_requests": cluster.target_ongoing_requests or max_batch_size}}


def _router(cluster: ClusterConfig) -> RequestRouterConfig:
    if cluster.routing == "power-of-two":
        return RequestRouterConfig()
    a = cluster.affinity
    return RequestRouterConfig(request_router_class=PrefixAwareRouter,
                               request_router_kwargs={"balance_factor": a.balance_factor, "slack": a.slack,
                                                      "min_match": a.min_match, "max_entries": a.max_entries})


class BuildArgs(BaseModel):
    """build_app's arguments: `engine serve --ray`'s flags, with underscores."""
    model_config = ConfigDict(extra="forbid")

    engine_dir: Path
    served_model_name: Optional[str] = None
    api_key: Optional[str] = None
    max_queue: int = 256
    scheduling_policy: str = "fcfs"
    shutdown_timeout: float = 30.0
    max_body_bytes: int = 4 * 2**20
    replicas: int = 1
    min_replicas: Optional[int] = None
    max_replicas: Optional[int] = None
    target_ongoing_requests: Optional[int] = None
    routing: str = "prefix"
    threads: int = 1
    kv_cache_mem_fraction: float = 0.5
    max_kv_tokens: Optional[int] = None
    stream_interval: int = 1
    speculative_config: Optional[dict] = None

    def configs(self) -> tuple[ReplicaConfig, ClusterConfig]:
        # Ray's tools call this builder as the CLI calls serve_command, so it reads the same variable: a key in a
        # RayService's config would be in plain text in the cluster's resources, one from a Secret is not.
        api_key = self.api_key or os.environ.get("ENGINE_API_KEY")
        server = ServerConfig(engine_dir=self.engine_dir,
                              served_model_name=self.served_model_name or self.engine_dir.resolve().name,
                              api_key=api_key, max_queue=self.max_queue, scheduling_policy=self.scheduling_policy,
                              shutdown_timeout=self.shutdown_timeout, max_body_bytes=self.max_body_bytes)
        engine = EngineOptions(kv_cache_mem_fraction=self.kv_cache_mem_fraction, max_kv_tokens=self.max_kv_tokens,
                               threads=self.threads, stream_interval=self.stream_interval,
                               speculative_config=SpeculativeConfig.of(self.speculative_config))
        cluster = ClusterConfig(replicas=self.replicas, min_replicas=self.min_replicas,
                                max_replicas=self.max_replicas, target_ongoing_requests=self.target_ongoing_requests,
                                routing=self.routing, affinity=AffinityConfig())
        return ReplicaConfig(server, engine), cluster


def build_app(args: dict):
    """The application builder for `serve run` and Serve config files: `args` as Ray gives them (strings from the
    command line, or a config file's values), checked here as BuildArgs."""
    return build_application(*BuildArgs.model_validate(args).configs())
