"""Who gets in: the server's lifecycle flags (loading, loaded, failed, draining) and its bounded count of sequences
in flight, shared by the lifespan (app.py) and the routes (routes.py) as one ServerState.

A request is served only when the engine is loaded, warm and running and the server is not draining (else 503),
and only when its sequences (prompts x n) fit the capacity max_batch_size + max_queue (else 429 with
Retry-After, at once, rather than an unbounded queue) and the id its client chose is not in use (else 409, before
any byte of a stream). It knows nothing of routes or of the requests' bodies.
"""
from __future__ import annotations

from typing import Callable

from .completions import OpenAIServing
from .config import ServerConfig
from .metrics import ServerMetrics
from .protocol import APIError
from .resume import StateKeeper


class ServerState:
    """What the routes share: the engine once loaded, admission counts, and the lifecycle flags."""

    def __init__(self, config: ServerConfig, *, max_batch_size: int, max_model_len: int, metrics: ServerMetrics,
                 keeper: StateKeeper | None):
        self.config = config
        self.capacity = max_batch_size + config.max_queue
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.keeper = keeper                 # --state-dir: checkpoints and resumed responses (resume.py)
        self.llm = None
        self.serving: OpenAIServing | None = None
        self.load_error: str | None = None
        self.draining = False
        self.in_flight = 0                   # sequences admitted and not yet done
        self.live_ids: set[str] = set()      # ids of the responses admitted and not yet done

    def ready(self) -> OpenAIServing:
        retry = {"Retry-After": str(self.config.retry_after_s)}
        if self.draining:
            raise APIError("the server is shutting down; send the request to another replica", status=503,
                           type="service_unavailable")
        if self.load_error is not None:
            raise APIError(f"the engine failed to load: {self.load_error}", status=503, type="service_unavailable")
        if self.serving is None:
            raise APIError("the engine is still loading; retry shortly", status=503, type="service_unavailable",
                           headers=retry)
        if not self.llm.is_running():
            raise APIError("the engine loop stopped; the server must be restarted", status=503,
                           type="service_unavailable")
        return self.serving

    def admit(self, n: int, response_id: str | None = None) -> Callable[[], None]:
        """Reserve n sequences (and the client's response id), or APIError 409 when that id is in use, 429 when the
        bounded queue is full; returns the (idempotent) release."""
        if response_id is not None and (response_id in self.live_ids or
                                        self.keeper is not None and response_id in self.keeper.tracked):
            raise APIError(f"a response with id {response_id!r} is in progress on this server (or kept for "
                           "resuming); wait for it to finish or send another X-Request-Id", status=409,
                           param="X-Request-Id", code="request_id_in_use")
        if n > self.capacity:
            raise APIError(f"this request needs {n} sequences (prompts x n), more than this server runs at once "
                           f"({self.capacity}); send fewer prompts or a smaller n", param="n", code="invalid_value")
        if self.in_flight + n > self.capacity:
            raise APIError(f"the server is overloaded: its queue is full ({self.in_flight} sequences in flight, "
                           f"limit {self.capacity}); retry later", status=429, type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(self.config.retry_after_s)})
        self.in_flight += n
        if response_id is not None:
            self.live_ids.add(response_id)
        done = False

        def release():
            nonlocal done
            if not done:
                done = True
                self.in_flight -= n
                self.live_ids.discard(response_id)
        return release
