"""The settings of the server on Ray Serve (`engine serve --ray`, or build_app's arguments), checked when made.

    ReplicaConfig   what one replica runs: the server's own ServerConfig and the LLM's options
    ClusterConfig   how many replicas (fixed, or autoscaled between bounds), how requests reach them, where Ray is
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from engine.core.errors import EngineError

from ..kv_budget import DEFAULT_KV_CACHE_MEM_FRACTION
from ..server.config import ServerConfig
from ..speculative.config import SpeculativeConfig
from .affinity import AffinityConfig

ROUTINGS = ("prefix", "power-of-two")      # ours (router.py), Ray Serve's default


@dataclass(frozen=True)
class EngineOptions:
    """The LLM's options besides its engine directory and scheduling policy (ServerConfig's)."""
    kv_cache_mem_fraction: float = DEFAULT_KV_CACHE_MEM_FRACTION
    max_kv_tokens: Optional[int] = None
    threads: int = 1                     # also the CPUs a replica reserves from Ray
    stream_interval: int = 1
    speculative_config: Optional[SpeculativeConfig] = None

    def __post_init__(self):
        if self.threads < 1:
            raise EngineError(f"--threads {self.threads} must be >= 1", usage=True)


@dataclass(frozen=True)
class ReplicaConfig:
    server: ServerConfig
    engine: EngineOptions = EngineOptions()


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 1
    min_replicas: Optional[int] = None          # both bounds given: Ray Serve autoscales on ongoing requests
    max_replicas: Optional[int] = None
    target_ongoing_requests: Optional[int] = None   # per replica, when autoscaling (default: its max batch size)
    routing: str = "prefix"
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    ray_address: Optional[str] = None           # None: a Ray cluster of this machine alone, started here

    def __post_init__(self):
        if self.replicas < 1:
            raise EngineError(f"--replicas {self.replicas} must be >= 1", usage=True)
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise EngineError("give both --min-replicas and --max-replicas to autoscale, or neither", usage=True)
        if self.autoscaling and not 1 <= self.min_replicas <= self.max_replicas:
            raise EngineError(f"--min-replicas {self.min_replicas} and --max-replicas {self.max_replicas} need "
                              "1 <= min <= max", usage=True)
        if self.target_ongoing_requests is not None and self.target_ongoing_requests < 1:
            raise EngineError(f"--target-ongoing-requests {self.target_ongoing_requests} must be >= 1", usage=True)
        if self.routing not in ROUTINGS:
            raise EngineError(f"--routing {self.routing!r} is not one of {', '.join(ROUTINGS)}", usage=True)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None
