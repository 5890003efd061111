"""Who gets in: the server's lifecycle flags (starting, failed, draining) and each model's bounded count of
sequences in flight, shared by the lifespan (app.py) and the routes (routes.py) as one ServerState.

The server is open once its start-up models are loaded and warm (models.py) and while it is not draining (else
503). A request is admitted only when its sequences (prompts x n) fit its model's capacity, that engine's
max_batch_size + max_queue (else 429 with Retry-After, at once, rather than an unbounded queue; each engine has
its own scheduler, so each model its own limit), and the id its client chose is not in use on the server (else
409, before any byte of a stream). It knows nothing of routes or of the requests' bodies.
"""
from __future__ import annotations

from typing import Callable

from .completions import OpenAIServing
from .config import ServerConfig
from .metrics import ServerMetrics
from .models import ModelRegistry, ServedModel
from .protocol import APIError
from .resume import StateKeeper


class ServerState:
    """What the routes share: the models, admission counts, and the lifecycle flags."""

    def __init__(self, config: ServerConfig, *, registry: ModelRegistry, metrics: ServerMetrics,
                 keeper: StateKeeper | None):
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.keeper = keeper                 # --state-dir: checkpoints and resumed responses (resume.py)
        self.starting = True                 # until the start-up models are loaded and warm
        self.load_error: str | None = None   # a start-up model's failure: the server stops
        self.draining = False
        self.live_ids: set[str] = set()      # ids of the responses admitted and not yet done

    # The default model's engine, as with one engine (the Ray replicas and the tests read these).
    @property
    def llm(self):
        return self.registry.default.llm

    @property
    def serving(self) -> OpenAIServing | None:
        return self.registry.default.serving

    @property
    def in_flight(self) -> int:
        return sum(m.in_flight for m in self.registry.models.values())

    def ready(self) -> None:
        """/health: APIError 503 unless the start-up models are loaded and every loaded engine runs."""
        if self.draining:
            raise APIError("the server is shutting down; send the request to another replica", status=503,
                           type="service_unavailable")
        if self.load_error is not None:
            raise APIError(f"the engine failed to load: {self.load_error}", status=503, type="service_unavailable")
        if self.starting:
            raise APIError("the engine is still loading; retry shortly", status=503, type="service_unavailable",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        for m in self.registry.models.values():
            if m.llm is not None and not m.llm.is_running():
                raise APIError("the engine loop stopped; the server must be restarted", status=503,
                               type="service_unavailable")

    def admit(self, model: ServedModel, n: int, response_id: str | None = None) -> Callable[[], None]:
        """Reserve n sequences of `model` (and the client's response id), or APIError 409 when that id is in use,
        429 when the model's bounded queue is full; returns the (idempotent) release. An admitted model is never
        unloaded until released (models.py)."""
        if response_id is not None and (response_id in self.live_ids or
                                        self.keeper is not None and response_id in self.keeper.tracked):
            raise APIError(f"a response with id {response_id!r} is in progress on this server (or kept for "
                           "resuming); wait for it to finish or send another X-Request-Id", status=409,
                           param="X-Request-Id", code="request_id_in_use")
        if n > model.capacity:
            raise APIError(f"this request needs {n} sequences (prompts x n), more than this server runs at once "
                           f"({model.capacity}); send fewer prompts or a smaller n", param="n", code="invalid_value")
        if model.in_flight + n > model.capacity:
            raise APIError(f"the server is overloaded: the queue of model `{model.name}` is full ({model.in_flight} "
                           f"sequences in flight, limit {model.capacity}); retry later", status=429,
                           type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        model.in_flight += n
        if response_id is not None:
            self.live_ids.add(response_id)
        done = False

        def release():
            nonlocal done
            if not done:
                done = True
                model.in_flight -= n
                model.last_used = self.registry.clock()
                self.live_ids.discard(response_id)
        return release
