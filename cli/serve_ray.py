"""`engine serve --ray`: the server as data-parallel replicas on Ray Serve (runtime/replicas/), one LLM each, behind
Ray's HTTP proxy; requests sharing a prompt prefix are served by the same replica.

    engine serve --engine-dir ENGINE --ray --replicas 2 --threads 8                 # a Ray cluster of this machine
    engine serve --engine-dir ENGINE --ray --ray-address auto --min-replicas 1 --max-replicas 4   # autoscaled

This module holds the flags that only --ray takes and checks the combination; serve.py calls it with the rest.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional

import typer

from engine.core.errors import EngineError

RAY = typer.Option(False, "--ray", help="Serve as replicas on Ray Serve, one LLM each (needs the [ray] extra); "
                   "requests that share a prompt prefix go to the same replica while it is not overloaded.")
RAY_ADDRESS = typer.Option(None, "--ray-address", help="With --ray: the Ray cluster to join ('auto', or "
                           "HEAD:6379 of `ray start --head`); default: a cluster of this machine, for this command.")
REPLICAS = typer.Option(None, "--replicas", help="With --ray: replicas (default 1), each reserving --threads CPUs.")
MIN_REPLICAS = typer.Option(None, "--min-replicas", help="With --ray and --max-replicas: autoscale between these "
                            "bounds on ongoing requests (Ray Serve's autoscaler).")
MAX_REPLICAS = typer.Option(None, "--max-replicas", help="With --ray and --min-replicas: the most replicas.")
ROUTING = typer.Option(None, "--routing", help="With --ray: prefix (default: the replica that holds the prompt's "
                       "leading blocks while not overloaded, else the least loaded) or power-of-two (Ray's default).")


@dataclass(frozen=True)
class RayFlags:
    enabled: bool
    address: Optional[str]
    replicas: Optional[int]
    min_replicas: Optional[int]
    max_replicas: Optional[int]
    routing: Optional[str]

    def check_unused(self) -> None:
        """Without --ray, a flag of --ray is a mistake worth naming."""
        given = {"--ray-address": self.address, "--replicas": self.replicas, "--min-replicas": self.min_replicas,
                 "--max-replicas": self.max_replicas, "--routing": self.routing}
        for flag, value in given.items():
            if value is not None:
                raise EngineError(f"{flag} is a flag of --ray; add --ray or leave it out", usage=True)


def serve_with_ray(config, flags: RayFlags, *, kv_cache_mem_fraction: float, max_kv_tokens: Optional[int],
                   threads: Optional[int], stream_interval: int, speculation) -> int:
    """Deploy `config` (a ServerConfig) as replicas and serve until SIGINT / SIGTERM."""
    _check(config)
    from engine.runtime.replicas.affinity import AffinityConfig
    from engine.runtime.replicas.config import ClusterConfig, EngineOptions, ReplicaConfig
    from engine.runtime.replicas.run import serve_on_ray

    engine = EngineOptions(kv_cache_mem_fraction=kv_cache_mem_fraction, max_kv_tokens=max_kv_tokens,
                           threads=threads or 1, stream_interval=stream_interval, speculative_config=speculation)
    cluster = ClusterConfig(replicas=flags.replicas or 1, min_replicas=flags.min_replicas,
                            max_replicas=flags.max_replicas, routing=flags.routing or "prefix",
                            affinity=AffinityConfig(), ray_address=flags.address)
    return serve_on_ray(ReplicaConfig(config, engine), cluster)


def _check(config) -> None:
    if importlib.util.find_spec("ray") is None:
        raise EngineError("--ray needs Ray Serve: pip install 'engine[ray]'", usage=True)
    if config.state_dir is not None:
        raise EngineError("--state-dir is not supported with --ray: each replica would keep its own state, and a "
                          "client resuming must reach the replica that has it", usage=True)
    if config.port == 0:
        raise EngineError("--port 0 is not supported with --ray: Ray's proxy needs a port it can bind on every node",
                          usage=True)
    if "WORLD_SIZE" in os.environ:
        raise EngineError("--ray runs each replica's tensor-parallel ranks itself; unset WORLD_SIZE (torchrun's) "
                          "and start `engine serve --ray` once", usage=True)
