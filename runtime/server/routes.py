"""The server's HTTP routes, registered one endpoint group at a time on the app that create_app (app.py) made:

    generation   POST /v1/completions, POST /v1/chat/completions       the work is completions.py's
    resume       GET /v1/requests/{id}/stream, GET /v1/requests/{id}   responses resumed after a restart (resume.py)
    info         GET /v1/models, GET /health, GET /metrics       /v1/models lists every model, loaded or not
    tokens       POST /tokenize, POST /detokenize
    lora         POST /v1/load_lora_adapter, /v1/unload_lora_adapter   --allow-runtime-lora-updating (lora_adapters.py)

Every route but /health and /metrics asks for the API key when the server has one (Authorization: Bearer KEY).
A route first checks that the server is ready, finds the model its `model` names (models.py, 404 when unknown;
left out, the first model) and admits the request (admission.py), then loads that model if need be; a client that
disconnects, streaming or not, cancels its request, and its sequences are aborted and their KV blocks freed. It
owns the translation between HTTP (headers, status codes, SSE responses) and the serving layer, and knows nothing
of the app's lifecycle, middleware or error handlers (app.py).
"""
from __future__ import annotations

import asyncio
import hmac
import re
from pathlib import Path
from typing import Callable, Optional

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from engine.core.errors import EngineError

from .admission import ServerState
from .completions import OpenAIServing, response_id_for
from .config import ServerConfig
from .lora_adapters import LoraModule
from .metrics import CONTENT_TYPE
from .models import Route
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoraAdapterRequest,
                       TokenizeRequest, UnloadLoraAdapterRequest)
from .resume import Tracked
from .sse import parse_event_id

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Every endpoint of the server, on `app`, serving through `state`."""
    auth = [Depends(_authorizer(state.config.api_key))]
    _add_generation_routes(app, state, auth)
    _add_resume_routes(app, state, auth)
    _add_info_routes(app, state, auth)
    _add_token_routes(app, state, auth)
    if state.registry.adapters is not None and state.registry.adapters.options.allow_updates:
        _add_lora_routes(app, state, auth)


# ---- generation ------------------------------------------------------------------------------------------------

def _add_generation_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        return await _generate(state, request, body, chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _generate(state, request, body, chat=True)


async def _generate(state: ServerState, request: Request, body, chat: bool):
    """One completion or chat completion: checked, admitted, then streamed (SSE) or answered whole (JSON)."""
    state.ready()
    route = state.registry.resolve(body.model)
    _check_priority(state.config, body.priority)
    client_id = _client_request_id(request)
    release = state.admit(route.model, (1 if chat else len(body.prompts)) * body.n,
                          response_id_for(chat, client_id) if client_id is not None else None)
    streaming = False
    try:
        serving = await state.registry.serving(route)     # loads the model's engine on first use (models.py)
        prep = await (serving.prepare_chat(body, client_id, route.adapter) if chat
                      else serving.prepare_completion(body, client_id, route.adapter))
        keeper = state.keeper
        if keeper is not None:        # journaled before any byte, then saved in checkpoints until its client is done
            await keeper.track(prep, "chat" if chat else "completion", include_usage=body.include_usage,
                               echo=not chat and body.echo, priority=body.priority)
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


def _client_request_id(request: Request) -> str | None:
    """The client's X-Request-Id (the response id becomes cmpl-ID / chatcmpl-ID), checked; None when not sent."""
    client_id = request.headers.get("x-request-id")
    if client_id is not None and not _REQUEST_ID.fullmatch(client_id):
        raise APIError(f"X-Request-Id {client_id!r} must be 1-128 letters, digits, '.', '_', ':' or '-'",
                       param="X-Request-Id", code="invalid_value")
    return client_id


# ---- responses resumed after a restart (--state-dir) ----------------------------------------------------------

def _add_resume_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    def resumed(response_id: str) -> Tracked:
        state.ready()
        if state.keeper is None:
            raise APIError(f"no resumable response {response_id!r}: this server runs without --state-dir",
                           status=404, type="not_found_error", code="response_not_found")
        return state.keeper.get(response_id)

    @app.get("/v1/requests/{response_id}/stream", dependencies=auth)
    async def resume_stream(response_id: str, request: Request, last_event_id: Optional[str] = None):
        """The rest of a resumed response's stream after the event id the client last received (resume.py)."""
        tracked = resumed(response_id)
        last = request.headers.get("last-event-id", last_event_id)
        if last:                          # a 400 now rather than an error inside the stream
            unknown = sorted(set(parse_event_id(last)[0]) - set(tracked.choices))
            if unknown:
                raise APIError(f"Last-Event-ID {last!r} names choice {unknown[0]}, which response {tracked.id} does "
                               f"not have (choices {', '.join(map(str, sorted(tracked.choices)))}); send the `id:` "
                               "of the last event received", param="Last-Event-ID", code="invalid_value")
        response = _SSEResponse(state.keeper.stream(tracked, last, state.config.keepalive_s), lambda: None)
        response.headers["X-Request-Id"] = tracked.id
        return response

    @app.get("/v1/requests/{response_id}", dependencies=auth)
    async def resume_result(response_id: str, request: Request):
        """A resumed response as JSON, once finished (resume.py); the client leaving does not cancel it."""
        tracked = resumed(response_id)
        body = await _until_disconnect(request, state.keeper.final(tracked))
        if body is None:
            return Response(status_code=499)
        return JSONResponse(body, headers={"X-Request-Id": tracked.id})


# ---- models, health, metrics -----------------------------------------------------------------------------------

def _add_info_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": state.registry.cards()}

    @app.get("/health")
    async def health():
        state.ready()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)


# ---- LoRA adapters at run time (--allow-runtime-lora-updating) -------------------------------------------------

def _add_lora_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    table = state.registry.adapters

    @app.post("/v1/load_lora_adapter", dependencies=auth)
    async def load_lora_adapter(body: LoadLoraAdapterRequest):
        module = LoraModule(body.lora_name, Path(body.lora_path), body.base_model_name)
        try:
            module = await run_in_threadpool(table.add, module)
            base = state.registry.models[module.base]
            if base.loading is not None:    # its lora_config may have been read before the adapter was added
                await asyncio.gather(asyncio.shield(base.loading), return_exceptions=True)
            if base.llm is not None and module.name not in base.llm.loras.names():
                await run_in_threadpool(base.llm.loras.add, module.name, module.path)
        except EngineError as e:
            raise APIError(str(e), param="lora_path", code="invalid_lora_adapter") from None
        return Response(f"Success: LoRA adapter '{module.name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", dependencies=auth)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest):
        try:
            module = table.remove(body.lora_name)
        except EngineError as e:
            raise APIError(str(e), status=404, type="not_found_error", param="lora_name",
                           code="lora_adapter_not_found") from None
        llm = state.registry.models[module.base].llm
        if llm is not None:           # requests in flight finish with it
            llm.loras.remove(module.name)
        return Response(f"Success: LoRA adapter '{module.name}' removed successfully.", media_type="text/plain")


# ---- tokenize, detokenize --------------------------------------------------------------------------------------

def _add_token_routes(app: FastAPI, state: ServerState, auth: list) -> None:
    @app.post("/tokenize", dependencies=auth)
    async def tokenize(body: TokenizeRequest):
        route, serving = await _serving(state, body.model)
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
        out = {"count": len(ids), "max_model_len": route.model.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return out

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(body: DetokenizeRequest):
        _, serving = await _serving(state, body.model)
        serving.check_vocab(body.tokens, "tokens")
        return {"prompt": await run_in_threadpool(serving.tokenizer.decode, body.tokens)}


# ---- checks and helpers shared by the groups -------------------------------------------------------------------

def _authorizer(api_key: str | None) -> Callable[[Request], None]:
    """The dependency that refuses a request without the server's API key (401 in OpenAI's words)."""
    def authorized(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError("You didn't provide an API key. Send it in the Authorization header as "
                           "'Bearer KEY'.", status=401, code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError("Incorrect API key provided.", status=401, code="invalid_api_key")
    return authorized


async def _serving(state: ServerState, model: str | None) -> tuple[Route, OpenAIServing]:
    """The route of a request that is not admitted (tokenize, detokenize) and its serving, loaded if need be."""
    state.ready()
    route = state.registry.resolve(model)
    return route, await state.registry.serving(route)


def _check_priority(config: ServerConfig, priority: int) -> None:
    if priority and config.scheduling_policy != "priority":
        raise APIError(f"priority {priority} is only honoured when the server runs with --scheduling-policy "
                       "priority; leave it out or 0", param="priority", code="invalid_value")


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
