"""The engines one server serves, by model name: looking a request's `model` up, loading an engine on first use,
and unloading the least recently used idle one beyond models_max, or one idle for unload_idle_s.

    route = registry.resolve(body.model)      Route(model, adapter): the one place a `model` is looked up (404)
    serving = await registry.serving(route)   its OpenAIServing, the engine loaded first if it is not
    registry.cards()                          /v1/models: every model, loaded or not, and the adapters' entries

A model's life:  unloaded -> loading -> loaded -> unloading -> unloaded. Loading (LLM + warm-up) runs in a worker
thread, so requests to loaded models go on meanwhile (but for the parts of a load that hold Python's GIL, such
as parsing tokenizer.json); requests to the model being loaded wait for it. A model
with requests in flight (ServedModel.in_flight, counted by admission.py) or pinned is never unloaded; when
models_max engines are loaded and none of them may go, the request that needs another gets 503 with Retry-After.

LoRA adapters plug in through `adapters` (an Adapters): resolve() maps an adapter's name to its base model's
Route with the adapter set, and cards() lists it with the base as parent. This module knows nothing of HTTP
routes or of the app's lifecycle (app.py); the engine core knows nothing of it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol

from starlette.concurrency import run_in_threadpool

from engine.core.errors import EngineError

from ..engine_dir import load_engine_config
from ..sampling_params import SamplingParams
from .completions import OpenAIServing
from .config import ModelSpec, ServerConfig
from .metrics import ServerMetrics
from .protocol import APIError

log = logging.getLogger("engine.server")


class Adapters(Protocol):
    """What the registry asks of a LoRA adapter table."""

    def base_of(self, name: str) -> str | None:
        """The base model serving adapter `name`, or None when there is no such adapter."""

    def names(self) -> Iterable[tuple[str, str]]:
        """(adapter name, base model name) of every adapter /v1/models lists."""


class ServedModel:
    """One engine of the server: its limits (read from its engine directory at start) and its loaded state."""

    def __init__(self, spec: ModelSpec, load: Callable[[], object], *, max_queue: int, pinned: bool):
        build = load_engine_config(spec.engine_dir).build   # a bad engine dir fails here, before serving
        self.name, self.engine_dir, self.load, self.pinned = spec.name, spec.engine_dir, load, pinned
        self.max_model_len = build.max_seq_len
        self.capacity = build.max_batch_size + max_queue     # sequences admitted at once (429 beyond)
        self.llm = None
        self.serving: OpenAIServing | None = None
        self.loading: asyncio.Task | None = None
        self.unloading: asyncio.Task | None = None
        self.load_error: str | None = None                   # the last load's failure, until one succeeds
        self.in_flight = 0                                   # sequences admitted and not yet done
        self.last_used = 0.0                                 # time.monotonic() of its last request

    @property
    def status(self) -> str:
        if self.unloading is not None:
            return "unloading"
        if self.serving is not None:
            return "loaded"
        return "loading" if self.loading is not None else "unloaded"


@dataclass(frozen=True)
class Route:
    """Where a request's `model` goes: a served model, and the LoRA adapter of it when the name is an adapter's."""
    model: ServedModel
    adapter: str | None = None

    @property
    def name(self) -> str:
        return self.adapter or self.model.name


class ModelRegistry:
    def __init__(self, config: ServerConfig, loaders: Mapping[str, Callable[[], object]], metrics: ServerMetrics,
                 clock: Callable[[], float] = time.monotonic):
        self.config, self.metrics, self.clock = config, metrics, clock
        self.models = {s.name: ServedModel(s, loaders[s.name], max_queue=config.max_queue,
                                           pinned=s.name in config.pinned) for s in config.models}
        self.default = self.models[config.served_model_name]   # what a request without `model` gets
        self.adapters: Adapters | None = None                  # LoRA: see the module docstring
        self._room = asyncio.Lock()                            # one load decision (and its evictions) at a time
        for name in self.models:
            metrics.model(name)                                # every model's series exist from the start

    def startup_models(self) -> list[ServedModel]:
        """Loaded before the server says it is healthy: the pinned ones, else the default one."""
        pinned = [m for m in self.models.values() if m.pinned]
        return pinned or [self.default]

    # ---- routing -----------------------------------------------------------------------------------------

    def resolve(self, name: str | None) -> Route:
        """The model (and adapter) a request's `model` names; None is the default model; 404 naming the served
        ones when unknown."""
        if name is None or name == self.default.name:
            return Route(self.default)
        if name in self.models:
            return Route(self.models[name])
        base = self.adapters.base_of(name) if self.adapters is not None else None
        if base is not None:
            return Route(self.models[base], adapter=name)
        served = ", ".join(f"`{n}`" for n in self.names())
        raise APIError(f"The model `{name}` does not exist; this server serves {served}.", status=404,
                       param="model", code="model_not_found")    # OpenAI's type for it: invalid_request_error

    def names(self) -> list[str]:
        return list(self.models) + [a for a, _ in (self.adapters.names() if self.adapters is not None else ())]

    def cards(self) -> list[dict]:
        """/v1/models' entries: every served model with its status, then each adapter with its base as parent."""
        cards = [_card(m.name, None, m.max_model_len, status=m.status) for m in self.models.values()]
        for name, base in self.adapters.names() if self.adapters is not None else ():
            m = self.models[base]
            cards.append(_card(name, base, m.max_model_len, status=m.status))
        return cards

    # ---- loading and unloading ---------------------------------------------------------------------------

    async def serving(self, route: Route) -> OpenAIServing:
        """The model's OpenAIServing, loading its engine first (making room under models_max) if needed."""
        m = route.model
        while True:
            if m.serving is not None and m.unloading is None:
                if not m.llm.is_running():
                    raise APIError(f"the engine loop of model `{m.name}` stopped; the server must be restarted",
                                   status=503, type="service_unavailable")
                m.last_used = self.clock()
                return m.serving
            if m.unloading is not None:
                await asyncio.shield(m.unloading)
            elif m.loading is not None:
                await asyncio.shield(m.loading)
            else:
                async with self._room:
                    if m.serving is None and m.loading is None and m.unloading is None:
                        await self._make_room(m)
                        m.loading = asyncio.create_task(self._load(m))
                        # its waiters may all have gone (clients that disconnected): the failure is logged already
                        m.loading.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def load(self, m: ServedModel) -> None:
        """Load `m` now and warm it (start-up, before /health says 200); raises its load error. A load on first use
        only starts the engine: its waiting request pays the first-call costs, and the grammars' tokenizer is built
        by the first constrained request (building it holds the GIL for a second or two, stalling every stream)."""
        await self.serving(Route(m))
        await run_in_threadpool(warm, m.llm)

    async def _load(self, m: ServedModel) -> None:
        start = self.clock()
        llm = None
        try:
            llm = await run_in_threadpool(m.load)
            if llm.scheduling_policy != self.config.scheduling_policy:
                raise EngineError(f"the server runs --scheduling-policy {self.config.scheduling_policy} but `load` "
                                  f"made an LLM with scheduling_policy={llm.scheduling_policy!r}; pass the same to "
                                  "both")
            await run_in_threadpool(llm.start)
        except Exception as e:  # noqa: BLE001 - answered 503 to whoever waits; the next request tries again
            m.load_error = str(e)
            log.error("model %s failed to load: %s", m.name, e)
            if llm is not None:
                await run_in_threadpool(llm.close)
            raise APIError(f"model `{m.name}` failed to load: {e}", status=503, type="service_unavailable") from None
        finally:
            m.loading = None
        m.llm, m.load_error, m.last_used = llm, None, self.clock()
        m.serving = OpenAIServing(llm, m.name, self.metrics.model(m.name), keepalive_s=self.config.keepalive_s,
                                  engine_alive=llm.is_running)
        self.metrics.loads.labels(m.name).inc()
        log.info("model %s loaded in %.1f s", m.name, self.clock() - start)

    async def _make_room(self, m: ServedModel) -> None:
        """Unload least recently used idle models until `m` fits under models_max; 503 when none may go."""
        cap = self.config.models_max
        while cap is not None and sum(x.status != "unloaded" for x in self.models.values() if x is not m) >= cap:
            idle = [x for x in self.models.values() if x.status == "loaded" and not x.pinned and not x.in_flight]
            leaving = [x.unloading for x in self.models.values() if x.unloading is not None]
            if idle:
                await self.unload(min(idle, key=lambda x: x.last_used), "least recently used")
                continue
            if leaving:                      # an idle unload under way frees a slot
                await asyncio.gather(*map(asyncio.shield, leaving), return_exceptions=True)
                continue
            busy = ", ".join(f"`{x.name}`" for x in self.models.values() if x.status != "unloaded")
            raise APIError(f"model `{m.name}` is not loaded and --models-max {cap} models are, each pinned or with "
                           f"requests in flight ({busy}); retry shortly", status=503, type="service_unavailable",
                           code="models_busy", headers={"Retry-After": str(self.config.retry_after_s)})

    async def unload(self, m: ServedModel, why: str) -> None:
        """Close `m`'s engine (in a worker thread); requests to it meanwhile wait, then load it again."""
        llm, m.llm, m.serving = m.llm, None, None
        m.unloading = asyncio.ensure_future(run_in_threadpool(llm.close))
        try:
            await asyncio.shield(m.unloading)
        finally:
            m.unloading = None
        self.metrics.unloads.labels(m.name).inc()
        log.info("model %s unloaded (%s)", m.name, why)

    async def unload_idle(self) -> None:
        """Forever: unload each unpinned model without requests for unload_idle_s (from app.py's lifespan)."""
        idle_s = self.config.unload_idle_s
        while True:
            await asyncio.sleep(min(idle_s / 4, 1.0))
            now = self.clock()
            for m in list(self.models.values()):
                if m.status == "loaded" and not m.pinned and not m.in_flight and now - m.last_used >= idle_s:
                    try:
                        await self.unload(m, f"idle {idle_s:g} s")
                    except Exception:  # noqa: BLE001 - one engine failing to close must not stop the others'
                        log.exception("unloading model %s failed", m.name)

    async def close(self) -> None:
        """Shutdown: wait for loads under way, then close every engine."""
        for m in self.models.values():
            for task in (m.loading, m.unloading):
                if task is not None:
                    await asyncio.gather(asyncio.shield(task), return_exceptions=True)
            if m.llm is not None:
                llm, m.llm, m.serving = m.llm, None, None
                await run_in_threadpool(llm.close)


def warm(llm) -> None:
    """Run one short greedy generation through the started engine (first-call costs paid now), and build the
    grammars' tokenizer."""
    ids = llm.tokenizer.encode("Hello") or [0]
    for _ in llm.stream([ids], SamplingParams(temperature=0, max_tokens=2)):
        pass
    try:   # the tokenizer's llguidance form, else built by the first constrained request (1 s for Qwen2.5's)
        llm.grammars.tokenizer()
    except EngineError as e:   # llguidance is not installed: constrained requests will get a 400 saying so
        log.warning("%s", e)


def _card(name: str, parent: str | None, max_model_len: int, status: str) -> dict:
    # root is the name, never the engine's path on this host
    return {"id": name, "object": "model", "created": 0, "owned_by": "engine", "root": parent or name,
            "parent": parent, "max_model_len": max_model_len, "status": status}
