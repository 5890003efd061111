"""The settings of `engine serve` (app.py), checked when made: bad values are usage errors.

The first model (engine_dir, served_model_name) is the default: the one a request without `model` gets. More
engines behind the same server are extra_models; models_max, pinned and unload_idle_s say which stay loaded
(models.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from engine.core.errors import EngineError

from .http_limits import HTTPLimits

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class ModelSpec:
    """One engine the server serves, under the name clients send as `model`."""
    name: str
    engine_dir: Path


@dataclass(frozen=True)
class ServerConfig:
    engine_dir: Path
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    max_queue: int = 256                 # sequences waiting beyond one full batch
    scheduling_policy: str = "fcfs"      # "priority": requests' `priority` field orders the queue
    shutdown_timeout: float = 30.0       # seconds in-flight requests get to finish after SIGTERM
    keepalive_s: float = 5.0             # SSE comment after this long without a token
    retry_after_s: int = 1
    max_body_bytes: int = 4 * 2**20      # larger request bodies are answered 413 (body_limit.py)
    http: HTTPLimits = HTTPLimits()      # header size and time, idle connections (http_limits.py)
    state_dir: Optional[Path] = None     # checkpoints of the requests in flight, resumed on restart (resume.py)
    state_checkpoint_interval: float = 30.0
    state_result_ttl: float = 600.0      # seconds a resumed response is kept after it finished
    extra_models: tuple[ModelSpec, ...] = ()   # engines served besides the first one (models.py)
    models_max: Optional[int] = None     # engines loaded at once (LRU unload of idle ones); None: no cap
    pinned: tuple[str, ...] = ()         # loaded at start and never unloaded
    unload_idle_s: Optional[float] = None  # an unpinned engine idle this long is unloaded

    @property
    def models(self) -> tuple[ModelSpec, ...]:
        return (ModelSpec(self.served_model_name, self.engine_dir),) + self.extra_models

    def __post_init__(self):
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise EngineError(f"--scheduling-policy {self.scheduling_policy!r} is not one of "
                              f"{', '.join(SCHEDULING_POLICIES)}", usage=True)
        if self.max_queue < 0:
            raise EngineError(f"--max-queue {self.max_queue} must be >= 0", usage=True)
        if self.shutdown_timeout < 0:
            raise EngineError(f"--shutdown-timeout {self.shutdown_timeout} must be >= 0", usage=True)
        if self.keepalive_s <= 0:
            raise EngineError(f"keepalive_s {self.keepalive_s} must be > 0", usage=True)
        if not self.served_model_name:
            raise EngineError("--served-model-name must not be empty", usage=True)
        if self.max_body_bytes < 1024:
            raise EngineError(f"--max-body-bytes {self.max_body_bytes} must be at least 1024", usage=True)
        if self.state_checkpoint_interval <= 0:
            raise EngineError(f"--state-checkpoint-interval {self.state_checkpoint_interval} must be > 0 seconds",
                              usage=True)
        if self.state_result_ttl < 0:
            raise EngineError(f"--state-result-ttl {self.state_result_ttl} must be >= 0 seconds", usage=True)
        self._check_models()

    def _check_models(self) -> None:
        names = [m.name for m in self.models]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise EngineError(f"model name {twice[0]!r} is given to two engines; name them apart with "
                              "--engine-dir NAME=PATH", usage=True)
        unknown = [p for p in self.pinned if p not in names]
        if unknown:
            raise EngineError(f"--pin {unknown[0]!r} is not a served model; served: {', '.join(names)}", usage=True)
        if self.models_max is not None and self.models_max < max(1, len(set(self.pinned))):
            raise EngineError(f"--models-max {self.models_max} must be >= 1 and >= the {len(set(self.pinned))} "
                              "pinned models", usage=True)
        if self.unload_idle_s is not None and not self.unload_idle_s > 0:
            raise EngineError(f"--unload-idle-seconds {self.unload_idle_s} must be > 0", usage=True)
        if self.state_dir is not None and (self.extra_models or self.unload_idle_s is not None):
            raise EngineError("--state-dir resumes the requests of one engine that stays loaded; serve each model "
                              "with its own `engine serve --state-dir`, without --unload-idle-seconds", usage=True)
