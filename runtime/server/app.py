"""The OpenAI-compatible HTTP server's app: create_app assembles it (middleware, error handlers, routes), its
lifespan loads and closes the engine, and run_server serves it on uvicorn.

    app = create_app(ServerConfig(engine_dir, served_model_name="smollm2"), load=lambda: LLM(engine_dir))
    run_server(app, config)            # uvicorn; SIGTERM drains

Lifecycle: the app starts listening at once and loads the engine in a worker thread, then warms it with one
short generation; until then /health is 503 (and so are the generation endpoints, with Retry-After). /health is
also 503 when the engine loop died. With several engines (models.py) the start-up models are the pinned ones, else
the default (first) one; the others load on first use. The engine runs in the LLM's own thread (its async API),
never on the event loop; the event loop only parses, tokenizes in worker threads and relays outputs. On SIGTERM the
server stops admitting (the listening socket closes; requests on open connections get 503), lets requests in flight
finish for up to shutdown_timeout seconds, then aborts what is left, stops the engine thread and exits. With
state_dir (resume.py) the requests in flight are journaled when admitted (journal.py) and checkpointed every
state_checkpoint_interval seconds, and SIGTERM writes the state and exits at once; a server restarted on that
directory resumes them, and clients reconnect to GET /v1/requests/{id}/stream (SSE, from their Last-Event-ID)
or GET /v1/requests/{id} (JSON). A client may name its response with an X-Request-Id header (the id becomes
cmpl-ID / chatcmpl-ID); every response carries its id in the X-Request-Id response header.

Every error is OpenAI's {"error": {"message", "type", "param", "code"}}; what a client sent never causes a 500.
Admission (429 beyond max_batch_size + max_queue sequences) is admission.py's, the served engines (routing by
`model`, loading and unloading) models.py's, the endpoints routes.py's, the requests' meaning completions.py's, the
metrics metrics.py's. The engine core (runtime/) knows nothing of this
package.
"""
from __future__ import annotations

import asyncio
import importlib.util
import logging
import signal
import threading
from contextlib import asynccontextmanager
from typing import Callable, Mapping

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.errors import EngineError

from .admission import ServerState
from .body_limit import BodySizeLimit
from .config import ServerConfig
from .http_limits import HTTPLimits, limited_protocol
from .metrics import ServerMetrics
from .internal_errors import InternalErrors
from .lora_adapters import AdapterTable
from .models import ModelRegistry
from .protocol import APIError, validation_error
from .resume import StateKeeper
from .routes import add_routes

log = logging.getLogger("engine.server")


def create_app(config: ServerConfig, load: Callable[[], object] | Mapping[str, Callable[[], object]],
               adapters: AdapterTable | None = None) -> FastAPI:
    """The app; `load` builds the LLM (called in a worker thread) with config's scheduling_policy: one callable
    for a server of one engine, else a mapping from each model name (config.models) to its own. If a start-up
    model fails to load, /health stays 503 and a server started by run_server exits with status 1. `adapters`:
    the LoRA adapters served by name (lora_adapters.py; `load` gives each base its lora_config)."""
    loaders = load if isinstance(load, Mapping) else {config.served_model_name: load}
    missing = [m.name for m in config.models if m.name not in loaders]
    if missing:
        raise EngineError(f"create_app has no `load` for model {missing[0]!r}; give one per model in config.models")
    keeper = None if config.state_dir is None else StateKeeper(
        config.state_dir, config.served_model_name, interval=config.state_checkpoint_interval,
        result_ttl=config.state_result_ttl)
    metrics = ServerMetrics(lambda: [(m.name, m.llm) for m in registry.models.values()])
    registry = ModelRegistry(config, loaders, metrics)    # a bad engine dir fails here, before serving
    registry.adapters = adapters
    state = ServerState(config, registry=registry, metrics=metrics, keeper=keeper)
    app = FastAPI(title="engine", lifespan=_lifespan(state))
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(InternalErrors)          # last: the outermost, it sees every other layer's exceptions
    app.state.server = state
    _add_error_handlers(app)
    add_routes(app, state)
    return app


def _lifespan(state: ServerState):
    """Load the start-up models in the background while the app already answers (503 until ready), unload idle
    ones meanwhile when asked to; on shutdown, drain, stop checkpointing and close the engines."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(_start(app, state))
        idle = None if state.config.unload_idle_s is None else asyncio.create_task(state.registry.unload_idle())
        yield
        state.draining = True
        await task
        if idle is not None:
            idle.cancel()
        if state.keeper is not None:
            state.keeper.stop()
        await state.registry.close()
    return lifespan


async def _start(app: FastAPI, state: ServerState) -> None:
    """Load and warm the start-up models (models.py), then open the routes (and resume saved responses); a
    failure is kept for /health and stops a server started by run_server."""
    registry = state.registry
    for m in registry.startup_models():
        try:
            await registry.load(m)
        except APIError as e:  # a load's failure, answered 503 by /health; run_server exits 1
            state.load_error = m.load_error or e.message
            break
    if state.load_error is not None:
        server = getattr(app.state, "uvicorn_server", None)
        if server is not None:
            server.should_exit = True
        return
    if state.keeper is not None:      # --state-dir serves one engine (config.py)
        state.serving.resumable, state.serving.on_finished = True, state.keeper.on_finished
        await state.keeper.start(state.llm)
    state.starting = False
    log.info("serving %s", ", ".join(m.name for m in registry.startup_models()))


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape; what a client sent never causes a 500."""
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if e.status_code == 413 else None
        return JSONResponse(APIError(str(e.detail), status=e.status_code, type=kind, code=code).body(),
                            status_code=e.status_code, headers=getattr(e, "headers", None))


def uvicorn_config(app: FastAPI, **kwargs):
    """uvicorn.Config for `app` on httptools' HTTP parser and uvloop's event loop, as vLLM serves; the serve extra
    installs both. Every streamed token is an SSE chunk through the event loop, and on two cores that loop shares
    the CPUs with the engine: 32 streams ran 4-9% more tokens/s than on uvicorn's pure-Python h11 and asyncio's
    loop, httptools most of it (bench/NOTES.md entry 48). Without them the server warns and runs on those.
    The connection limits (http_limits.py) are those of the app's ServerConfig, else the defaults."""
    import uvicorn
    server = getattr(app.state, "server", None)
    limits = server.config.http if server is not None else HTTPLimits()
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    if (http, loop) != ("httptools", "uvloop"):
        log.warning("httptools or uvloop is not installed: serving on %s and %s, which costs CPU per streamed "
                    "token; install them with pip install 'engine[serve]'", http, loop)
    protocol = limited_protocol(limits) if http == "httptools" else "h11"   # h11: no header timeout
    return uvicorn.Config(app, http=protocol, loop=loop, timeout_keep_alive=limits.keep_alive_timeout_s,
                          h11_max_incomplete_event_size=limits.max_header_bytes, **kwargs)


def run_server(app: FastAPI, config: ServerConfig, log_level: str = "info") -> int:
    """Serve until SIGINT / SIGTERM (graceful, see the module docstring); 1 if the engine failed to load."""
    import uvicorn

    state: ServerState = app.state.server

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.draining = True                  # requests on open keep-alive connections now get 503
            if state.keeper is not None:           # --state-dir: save the state, then end streams (no drain)
                state.keeper.shutdown_soon()
            super().handle_exit(sig, frame)

    server = _Server(uvicorn_config(app, host=config.host, port=config.port, log_level=log_level,
                                    timeout_graceful_shutdown=config.shutdown_timeout, access_log=False))
    app.state.uvicorn_server = server
    # uvicorn re-raises SIGTERM after its graceful shutdown, to die of it; the drain is done by then, so a
    # no-op handler (which uvicorn restores before re-raising) makes a SIGTERM'd server exit 0.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: None) if main else None
    try:
        server.run()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return 1 if state.load_error is not None else 0
