"""The OpenAI-compatible HTTP server: the FastAPI app, its lifecycle, admission and errors.

    app = create_app(ServerConfig(engine_dir, served_model_name="smollm2"), load=lambda: LLM(engine_dir))
    run_server(app, config)            # uvicorn; SIGTERM drains

Lifecycle: the app starts listening at once and loads the engine in a worker thread, then warms it with one
short generation; until then /health is 503 (and so are the generation endpoints, with Retry-After). /health is
also 503 when the engine loop died. The engine runs in the LLM's own thread (its async API), never on the
event loop; the event loop only parses, tokenizes in worker threads and relays outputs. On SIGTERM the server
stops admitting (the listening socket closes; requests on open connections get 503), lets requests in flight
finish for up to shutdown_timeout seconds, then aborts what is left, stops the engine thread and exits. With
state_dir (resume.py) the requests in flight are checkpointed every state_checkpoint_interval seconds, and SIGTERM
writes the state and exits at once; a server restarted on that directory resumes them, and clients reconnect to
GET /v1/requests/{id}/stream (SSE, from their Last-Event-ID) or GET /v1/requests/{id} (JSON). A client may name
its response with an X-Request-Id header (the id becomes cmpl-ID / chatcmpl-ID); every response carries its id
in the X-Request-Id response header.

Admission: at most max_batch_size + max_queue sequences (a request with n choices over k prompts is n * k) are
in flight; beyond that a request is answered 429 with Retry-After at once rather than queued without bound.
A client that disconnects, streaming or not, cancels its request: its sequences are aborted and their KV blocks
freed. Every error is OpenAI's {"error": {"message", "type", "param", "code"}}; what a client sent never
causes a 500. Requests themselves are served by serving.py; metrics by metrics.py.
"""
from __future__ import annotations

import asyncio
import hmac
import importlib.util
import logging
import re
import signal
import threading
from contextlib import asynccontextmanager
from typing import Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core.errors import EngineError

from .engine_dir import load_engine_config
from .http_limits import BodySizeLimit
from .metrics import CONTENT_TYPE, ServerMetrics
from .openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                              TokenizeRequest, validation_error)
from .resume import StateKeeper, parse_event_id
from .sampling_params import SamplingParams
from .server_config import ServerConfig
from .serving import OpenAIServing

log = logging.getLogger("engine.server")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class ServerState:
    """What the routes share: the engine once loaded, admission counts, and the lifecycle flags."""

    def __init__(self, config: ServerConfig, max_batch_size: int):
        self.config = config
        self.capacity = max_batch_size + config.max_queue
        self.llm = None
        self.serving: OpenAIServing | None = None
        self.load_error: str | None = None
        self.draining = False
        self.in_flight = 0                   # sequences admitted and not yet done

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

    def admit(self, n: int) -> Callable[[], None]:
        """Reserve n sequences, or APIError 429 when the bounded queue is full; returns the (idempotent) release."""
        if n > self.capacity:
            raise APIError(f"this request needs {n} sequences (prompts x n), more than this server runs at once "
                           f"({self.capacity}); send fewer prompts or a smaller n", param="n", code="invalid_value")
        if self.in_flight + n > self.capacity:
            raise APIError(f"the server is overloaded: its queue is full ({self.in_flight} sequences in flight, "
                           f"limit {self.capacity}); retry later", status=429, type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(self.config.retry_after_s)})
        self.in_flight += n
        done = False

        def release():
            nonlocal done
            if not done:
                done = True
                self.in_flight -= n
        return release


def _warm(llm) -> None:
    """Start the engine thread and run one short greedy generation through it (first-call costs paid now)."""
    llm.start()
    ids = llm.tokenizer.encode("Hello") or [0]
    for _ in llm.stream([ids], SamplingParams(temperature=0, max_tokens=2)):
        pass


class _SSEResponse(StreamingResponse):
    """text/event-stream that releases the request's admission however the stream ends (even unstarted)."""

    def __init__(self, content, release: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._release = release

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _also(release: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both():
        release()
        then()
    return both


async def _until_disconnect(request: Request, coro):
    """Await `coro`, cancelling it if the client disconnects first (then None is returned)."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    work, gone = asyncio.ensure_future(coro), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    return work.result() if work in done else None


def create_app(config: ServerConfig, load: Callable[[], object]) -> FastAPI:
    """The app; `load` builds the LLM (called in a worker thread at start-up) with config's scheduling_policy.
    If it fails, /health stays 503 and a server started by run_server exits with status 1."""
    engine_config = load_engine_config(config.engine_dir)   # a bad engine dir fails here, before serving
    max_model_len = engine_config.build.max_seq_len
    state = ServerState(config, engine_config.build.max_batch_size)
    metrics = ServerMetrics(config.served_model_name, lambda: state.llm)
    keeper = None if config.state_dir is None else StateKeeper(
        config.state_dir, config.served_model_name, interval=config.state_checkpoint_interval,
        result_ttl=config.state_result_ttl)

    async def load_engine():
        try:
            llm = await run_in_threadpool(load)
            if llm.scheduling_policy != config.scheduling_policy:
                raise EngineError(f"the server runs --scheduling-policy {config.scheduling_policy} but `load` made "
                                  f"an LLM with scheduling_policy={llm.scheduling_policy!r}; pass the same to both")
            await run_in_threadpool(_warm, llm)
        except Exception as e:  # noqa: BLE001 - reported by /health; run_server exits 1
            state.load_error = str(e)
            log.error("the engine failed to load: %s", e)
            server = getattr(app.state, "uvicorn_server", None)
            if server is not None:
                server.should_exit = True
            return
        state.llm = llm
        state.serving = OpenAIServing(llm, config.served_model_name, metrics, keepalive_s=config.keepalive_s,
                                      engine_alive=llm.is_running)
        if keeper is not None:
            state.serving.resumable, state.serving.on_finished = True, keeper.on_finished
            await keeper.start(llm)
        log.info("engine loaded and warmed; serving %s", config.served_model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(load_engine())
        yield
        state.draining = True
        await task
        if keeper is not None:
            keeper.stop()
        if state.llm is not None:
            await run_in_threadpool(state.llm.close)

    app = FastAPI(title="engine", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.state.server = state
    app.state.metrics = metrics
    app.state.keeper = keeper

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

    def authorized(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError("You didn't provide an API key. Send it in the Authorization header as "
                           "'Bearer KEY'.", status=401, code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError("Incorrect API key provided.", status=401, code="invalid_api_key")

    def check_model(model: str | None) -> None:
        if model is not None and model != config.served_model_name:
            raise APIError(f"The model `{model}` does not exist; this server serves `{config.served_model_name}`.",
                           status=404, param="model", code="model_not_found")

    def check_priority(priority: int) -> None:
        if priority and config.scheduling_policy != "priority":
            raise APIError(f"priority {priority} is only honoured when the server runs with --scheduling-policy "
                           "priority; leave it out or 0", param="priority", code="invalid_value")

    async def generate(request: Request, body, chat: bool):
        serving = state.ready()
        check_model(body.model)
        check_priority(body.priority)
        n_prompts = 1 if chat else len(body.prompts)
        client_id = request.headers.get("x-request-id")
        if client_id is not None and not _REQUEST_ID.fullmatch(client_id):
            raise APIError(f"X-Request-Id {client_id!r} must be 1-128 letters, digits, '.', '_', ':' or '-'",
                           param="X-Request-Id", code="invalid_value")
        release = state.admit(n_prompts * body.n)
        streaming = False
        try:
            prep = await (serving.prepare_chat(body, client_id) if chat
                          else serving.prepare_completion(body, client_id))
            if keeper is not None:        # saved in checkpoints until its client is done with it
                keeper.track(prep, "chat" if chat else "completion", include_usage=body.include_usage,
                             echo=not chat and body.echo)
                release = _also(release, lambda: keeper.untrack(prep.id))
            headers = {"X-Request-Id": prep.id}
            if body.stream:
                streaming = True
                response = _SSEResponse(serving.stream(body, prep, body.priority, chat), release)
                response.headers.update(headers)
                return response
            finals = await _until_disconnect(request, serving.final_outputs(prep, body.priority))
            if finals is None:            # the client went away; nobody reads this
                return Response(status_code=499)
            return JSONResponse(serving.chat_response(prep, finals) if chat
                                else serving.completion_response(body, prep, finals), headers=headers)
        finally:
            if not streaming:
                release()

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        return await generate(request, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(request, body, chat=True)

    def resumed(response_id: str):
        state.ready()
        if keeper is None:
            raise APIError(f"no resumable response {response_id!r}: this server runs without --state-dir",
                           status=404, type="not_found_error", code="response_not_found")
        return keeper.get(response_id)

    @app.get("/v1/requests/{response_id}/stream", dependencies=[Depends(authorized)])
    async def resume_stream(response_id: str, request: Request, last_event_id: Optional[str] = None):
        """The rest of a resumed response's stream after the event id the client last received (resume.py)."""
        tracked = resumed(response_id)
        last = request.headers.get("last-event-id", last_event_id)
        if last:
            parse_event_id(last)          # a 400 now rather than an error inside the stream
        response = _SSEResponse(keeper.stream(tracked, last, config.keepalive_s), lambda: None)
        response.headers["X-Request-Id"] = tracked.id
        return response

    @app.get("/v1/requests/{response_id}", dependencies=[Depends(authorized)])
    async def resume_result(response_id: str, request: Request):
        """A resumed response as JSON, once finished (resume.py); the client leaving does not cancel it."""
        tracked = resumed(response_id)
        body = await _until_disconnect(request, keeper.final(tracked))
        if body is None:
            return Response(status_code=499)
        return JSONResponse(body, headers={"X-Request-Id": tracked.id})

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        card = {"id": config.served_model_name, "object": "model", "created": 0, "owned_by": "engine",
                "root": str(config.engine_dir), "parent": None, "max_model_len": max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        state.ready()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize", dependencies=[Depends(authorized)])
    async def tokenize(body: TokenizeRequest):
        serving = state.ready()
        check_model(body.model)
        tok = serving.tokenizer

        def run():
            if body.messages is not None:
                msgs = [m.as_template_dict(i) for i, m in enumerate(body.messages)]
                try:
                    return tok.encode_chat(msgs, add_generation_prompt=body.add_generation_prompt)
                except EngineError as e:
                    raise APIError(str(e), param="messages") from None
            return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        ids = await run_in_threadpool(run)
        out = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return out

    @app.post("/detokenize", dependencies=[Depends(authorized)])
    async def detokenize(body: DetokenizeRequest):
        serving = state.ready()
        check_model(body.model)
        serving.check_vocab(body.tokens, "tokens")
        return {"prompt": await run_in_threadpool(serving.tokenizer.decode, body.tokens)}

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(APIError(f"internal server error: {e}", status=500, type="internal_server_error")
                            .body(), status_code=500)

    return app


def uvicorn_config(app: FastAPI, **kwargs):
    """uvicorn.Config for `app` on httptools' HTTP parser and uvloop's event loop, as vLLM serves; the serve extra
    installs both. Every streamed token is an SSE chunk through the event loop, and on two cores that loop shares
    the CPUs with the engine: 32 streams ran 4-9% more tokens/s than on uvicorn's pure-Python h11 and asyncio's
    loop, httptools most of it (bench/NOTES.md entry 48). Without them the server warns and runs on those."""
    import uvicorn
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    if (http, loop) != ("httptools", "uvloop"):
        log.warning("httptools or uvloop is not installed: serving on %s and %s, which costs CPU per streamed "
                    "token; install them with pip install 'engine[serve]'", http, loop)
    return uvicorn.Config(app, http=http, loop=loop, **kwargs)


def run_server(app: FastAPI, config: ServerConfig, log_level: str = "info") -> int:
    """Serve until SIGINT / SIGTERM (graceful, see the module docstring); 1 if the engine failed to load."""
    import uvicorn

    state: ServerState = app.state.server

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            state.draining = True                  # requests on open keep-alive connections now get 503
            if app.state.keeper is not None:       # --state-dir: save the state, then end streams (no drain)
                app.state.keeper.shutdown_soon()
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
