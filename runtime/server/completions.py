"""OpenAI completions and chat completions on the LLM's async API: request -> choices -> JSON or SSE chunks.

Owns the meaning of a request once it is parsed (protocol.py): tokenizing (in a worker thread, so a long
prompt never stalls the event loop), the context-length checks with OpenAI's wording, one engine sequence per
choice (prompt i, sample j -> choice index i * n + j), and the response shapes. Streams follow OpenAI exactly:

    chat:        role delta {"role": "assistant", "content": ""} per choice, content deltas, a chunk with an empty
                 delta and finish_reason per choice, [usage chunk with "choices": []], data: [DONE]
    completions: text chunks, the last one of a choice carrying finish_reason, [usage chunk], data: [DONE]

A failure after the stream began is sent as `data: {"error": {...}}` before [DONE]; `: keep-alive` comments go
out when no token came for keepalive_s (long prefills, a long queue). It knows nothing of HTTP status codes
beyond APIError, nor of the app's lifecycle (app.py) or its routes (routes.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import sys
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from starlette.concurrency import run_in_threadpool

from engine.core.errors import EngineError

from ..engine_thread import EngineLoopStopped
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .metrics import ModelMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, internal_error
from .sse import event_id, sse_data
from .tools import OPEN, ToolStream, parse_tool_calls, with_tools_in_system

log = logging.getLogger("engine.server")
KEEPALIVE = object()           # an event of `events`: nothing new for keepalive_s
LOGPROB_FLOOR = -9999.0        # JSON has no -inf (vLLM clamps the same way)


@dataclass(frozen=True)
class Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Prepared:
    """A checked request: its choices, its prompts (ids, and text for echo) and the id of the response."""
    id: str
    created: int
    choices: list[Choice]
    prompts: list[tuple[list[int], str | None]]
    n: int
    parse_tools: bool = False          # tool calls are parsed out of the output (a chat request with tools)
    lora: str | None = None            # the LoRA adapter its `model` named (models.py's Route), else the base

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.prompts)


if sys.version_info >= (3, 11):
    async def _get_within(q: asyncio.Queue, timeout: float):
        """q.get() in the calling task, asyncio.TimeoutError after `timeout` s (no task of its own)."""
        async with asyncio.timeout(timeout):
            return await q.get()
else:  # Python 3.10 has no asyncio.timeout
    def _get_within(q: asyncio.Queue, timeout: float):
        return asyncio.wait_for(q.get(), timeout)


def response_id_for(chat: bool, client_id: str | None) -> str:
    """The id of a response: cmpl-ID / chatcmpl-ID for a client's X-Request-Id ID, else a random one."""
    return f"{'chatcmpl' if chat else 'cmpl'}-{client_id or uuid.uuid4().hex}"


class OpenAIServing:
    def __init__(self, llm, model_name: str, metrics: ModelMetrics, *, keepalive_s: float,
                 engine_alive: Callable[[], bool]):
        self.llm, self.model_name, self.metrics = llm, model_name, metrics
        self.keepalive_s, self.engine_alive = keepalive_s, engine_alive
        self.tokenizer = llm.tokenizer
        # With --state-dir (resume.py): streams tag events with resume offsets, finished choices are reported.
        self.resumable = False
        self.on_finished: Callable[[str, RequestOutput], None] | None = None

    # ---- preparing ---------------------------------------------------------------------------------------

    async def prepare_completion(self, req: CompletionRequest, request_id: str | None = None,
                                 lora: str | None = None) -> Prepared:
        def tokenize():
            out = []
            for p in req.prompts:
                if isinstance(p, str):
                    out.append((self.tokenizer.encode(p), p))
                else:
                    ids = [int(t) for t in p]
                    self.check_vocab(ids, "prompt")
                    out.append((ids, self.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else None))
            return out
        prompts = await run_in_threadpool(tokenize)
        await self.check_structured(req)
        prep = self._prepare(response_id_for(False, request_id), req, prompts, req.max_tokens, req.logprobs,
                             "prompt")
        return dataclasses.replace(prep, lora=lora)

    async def prepare_chat(self, req: ChatCompletionRequest, request_id: str | None = None,
                           lora: str | None = None) -> Prepared:
        messages, tools = req.template_messages(), req.template_tools()
        if tools and "tools" not in (self.tokenizer.chat_template or ""):
            messages, tools = with_tools_in_system(messages, req.tools), None
        req.constrain_to_tool_calls(special_tags=self.tokenizer.is_added_token(OPEN))

        def tokenize():
            try:
                return self.tokenizer.encode_chat(messages, add_generation_prompt=req.add_generation_prompt,
                                                  **({"tools": tools} if tools else {}),
                                                  **(req.chat_template_kwargs or {}))
            except EngineError as e:
                raise APIError(str(e), param="messages", code="invalid_value") from None
            except TypeError as e:   # chat_template_kwargs naming a parameter of the renderer
                raise APIError(f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
            except Exception as e:  # noqa: BLE001 - the template is data; what breaks it is in the messages
                raise APIError(f"the chat template failed on these messages: {e!r}", param="messages") from None
        ids = await run_in_threadpool(tokenize)
        await self.check_structured(req)
        prep = self._prepare(response_id_for(True, request_id), req, [(ids, None)], req.requested_max_tokens,
                             req.num_logprobs, "messages")
        return dataclasses.replace(prep, parse_tools=req.tool_mode != "none", lora=lora)

    async def check_structured(self, req) -> None:
        """A 400 naming the field when llguidance cannot enforce the request's constraint, before any response
        begins (compiled on a worker thread: the first one also builds the tokenizer's llguidance form)."""
        spec, field = req.structured
        if spec is not None:
            try:
                await run_in_threadpool(self.llm.grammars.matcher, spec)
            except EngineError as e:
                raise APIError(f"{field}: {str(e).removeprefix('invalid structured output: ')}", param=field,
                               code="invalid_value") from None

    def _prepare(self, rid, req, prompts, max_tokens, logprobs, what) -> Prepared:
        choices = []
        for i, (ids, _) in enumerate(prompts):
            budget = self._check_context(len(ids), max_tokens, what)
            for j in range(req.n):
                try:
                    params = req.sampling_params(budget, logprobs=logprobs, choice=j)
                except EngineError as e:
                    raise APIError(str(e).removeprefix("invalid sampling parameter: "), code="invalid_value")
                if self.resumable and params.seed is None:     # a restart runs it again from this seed
                    params = dataclasses.replace(params, seed=secrets.randbits(64))
                idx = i * req.n + j
                choices.append(Choice(idx, f"{rid}-{idx}", ids, params))
        return Prepared(rid, int(time.time()), choices, prompts, req.n)

    def _check_context(self, n_prompt: int, max_tokens: int | None, what: str) -> int:
        """max_tokens to generate (the room left when not given); APIError in OpenAI's words when it cannot fit."""
        b = self.llm.config.build
        ctx = b.max_seq_len
        if n_prompt == 0:
            raise APIError(f"the {what} is empty (0 tokens); give at least one token", param=what,
                           code="invalid_value")
        limit = min(b.max_input_len, ctx - 1)
        if n_prompt > limit:
            why = (f"your {what} has {n_prompt} tokens, over this engine's maximum input length of "
                   f"{b.max_input_len} tokens" if n_prompt < ctx else f"your {what} has {n_prompt} tokens")
            raise APIError(f"This model's maximum context length is {ctx} tokens. However, {why}. Please reduce "
                           f"the length of the {what}.", param=what, code="context_length_exceeded")
        if max_tokens is None:
            return ctx - n_prompt
        if n_prompt + max_tokens > ctx:
            raise APIError(f"This model's maximum context length is {ctx} tokens. However, you requested "
                           f"{n_prompt + max_tokens} tokens ({n_prompt} in the {what}, {max_tokens} in the "
                           f"completion). Please reduce the length of the {what} or completion.",
                           param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def model_of(self, prep: Prepared) -> str:
        """The `model` of a response: the adapter's name when its request named one (as vLLM answers)."""
        return prep.lora or self.model_name

    def check_vocab(self, ids: list[int], param: str) -> None:
        vocab = self.llm.config.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param,
                           code="invalid_value")

    # ---- running -----------------------------------------------------------------------------------------

    async def events(self, prep: Prepared, priority: int) -> AsyncIterator:
        """(choice index, RequestOutput) of every choice as produced, or KEEPALIVE. Closing it (a client that
        went away) cancels every choice, which aborts its sequence and frees its blocks."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice):
            rec = self.metrics.recorder()
            try:
                async for out in self.llm.generate_async(c.prompt_ids, c.params, request_id=c.request_id,
                                                         priority=priority, lora=prep.lora):
                    rec.observe(out)
                    if out.finished and self.on_finished is not None:
                        self.on_finished(c.request_id, out)
                    q.put_nowait((c.index, out))
            except Exception as e:
                q.put_nowait((c.index, e))

        tasks = [asyncio.create_task(pump(c)) for c in prep.choices]
        pending = len(tasks)
        try:
            while pending:
                if q.empty():
                    try:
                        idx, item = await _get_within(q, self.keepalive_s)
                    except asyncio.TimeoutError:
                        if not self.engine_alive():
                            raise APIError("the engine loop stopped; the server must be restarted", status=500,
                                           type="internal_server_error") from None
                        yield KEEPALIVE
                        continue
                else:
                    idx, item = q.get_nowait()
                    await asyncio.sleep(0)   # outputs already queued: still let other tasks (checkpoints) run
                if isinstance(item, EngineError):
                    raise APIError(str(item), code="invalid_value")
                if isinstance(item, BaseException):
                    log.error("request %s failed: %r", prep.id, item)
                    raise internal_error(prep.id, "the engine loop stopped (the server must be restarted)"
                                         if isinstance(item, EngineLoopStopped) else "internal server error")
                if item.finished:
                    pending -= 1
                    if item.finish_reason == "abort":
                        hint = (f"; its state was saved: resume it on the restarted server with GET /v1/requests/"
                                f"{prep.id}/stream (or /v1/requests/{prep.id})") if self.resumable else ""
                        raise APIError("the request was aborted: the server is shutting down" + hint, status=503,
                                       type="service_unavailable")
                yield idx, item
        finally:
            for t in tasks:
                t.cancel()

    async def final_outputs(self, prep: Prepared, priority: int) -> dict[int, RequestOutput]:
        finals = {}
        async with aclosing(self.events(prep, priority)) as ev:
            async for e in ev:
                if e is not KEEPALIVE and e[1].finished:
                    finals[e[0]] = e[1]
        return finals

    # ---- responses ---------------------------------------------------------------------------------------

    def usage(self, prep: Prepared, finals: dict[int, RequestOutput]) -> dict:
        completion = sum(o.num_generated_tokens for o in finals.values())
        return {"prompt_tokens": prep.num_prompt_tokens, "completion_tokens": completion,
                "total_tokens": prep.num_prompt_tokens + completion}

    def completion_response(self, req: CompletionRequest, prep: Prepared, finals) -> dict:
        choices = []
        for c in prep.choices:
            out = finals[c.index]
            echo = prep.prompts[c.index // prep.n][1] if req.echo else ""
            lps = self.completion_logprobs(out.token_ids, out.logprobs, 0)[0] if out.logprobs is not None else None
            choices.append({"index": c.index, "text": echo + out.text, "logprobs": lps,
                            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        return {"id": prep.id, "object": "text_completion", "created": prep.created, "model": self.model_of(prep),
                "choices": choices, "usage": self.usage(prep, finals)}

    def chat_response(self, prep: Prepared, finals) -> dict:
        choices = []
        for c in prep.choices:
            out = finals[c.index]
            lps = {"content": self.chat_logprobs(out.token_ids, out.logprobs), "refusal": None} \
                if out.logprobs is not None else None
            content, calls = parse_tool_calls(out.text) if prep.parse_tools else (out.text, [])
            choices.append({"index": c.index, "message": {"role": "assistant", "content": content,
                                                          "refusal": None, "tool_calls": calls},
                            "logprobs": lps, "finish_reason": _finish_reason(out, bool(calls)),
                            "stop_reason": out.stop_reason})
        return {"id": prep.id, "object": "chat.completion", "created": prep.created, "model": self.model_of(prep),
                "choices": choices, "usage": self.usage(prep, finals)}

    async def stream(self, req, prep: Prepared, priority: int, chat: bool) -> AsyncIterator[str]:
        """The SSE body of a streamed completion or chat completion (see the module docstring)."""
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, **extra) -> str:
            d = {"id": prep.id, "object": obj, "created": prep.created, "model": self.model_of(prep),
                 "choices": choices, **extra}
            if req.include_usage and "usage" not in d:
                d["usage"] = None
            return sse_data(d)

        finals: dict[int, RequestOutput] = {}
        chars: dict[int, int] = {c.index: 0 for c in prep.choices}   # text sent per choice (resume offsets)
        ended: set[int] = set()                                      # choices whose finish was sent

        def tagged(idx: int, num_chars: int, finished: bool, sse: str) -> str:
            chars[idx] += num_chars
            if finished:
                ended.add(idx)
            return f"id: {event_id(chars, ended)}\n{sse}" if self.resumable else sse
        sent: dict[int, int] = {}              # logprobs sent per choice
        tool_streams = {c.index: ToolStream() for c in prep.choices} if prep.parse_tools else {}
        offsets: dict[int, int] = {}           # text_offset of completion logprobs per choice
        try:
            for c in prep.choices:
                if chat:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                elif req.echo:
                    yield chunk([{"index": c.index, "text": prep.prompts[c.index // prep.n][1],
                                  "logprobs": None, "finish_reason": None}])
            async with aclosing(self.events(prep, priority)) as ev:
                async for e in ev:
                    if e is KEEPALIVE:
                        yield ": keep-alive\n\n"
                        continue
                    idx, out = e
                    new_lps, lp_ids = None, []
                    if out.logprobs is not None:
                        k = sent.get(idx, 0)
                        new_lps, lp_ids = out.logprobs[k:], out.token_ids[k:len(out.logprobs)]
                        sent[idx] = len(out.logprobs)
                    if chat:
                        text, calls, used = out.delta_text, [], len(out.delta_text)
                        if idx in tool_streams:   # calls go out whole; text that may begin one is held
                            text, calls = tool_streams[idx].feed(out.delta_text, final=out.finished)
                            used = tool_streams[idx].released    # resume offsets count the model's text
                        if text or new_lps or calls:
                            lps = {"content": self.chat_logprobs(lp_ids, new_lps), "refusal": None} \
                                if new_lps else None
                            delta = {"content": text, **({"tool_calls": calls} if calls else {})}
                            yield tagged(idx, used, False, chunk([{
                                "index": idx, "delta": delta, "logprobs": lps, "finish_reason": None}]))
                        else:
                            chars[idx] += used
                        if out.finished:
                            yield tagged(idx, 0, True, chunk([{
                                "index": idx, "delta": {}, "logprobs": None,
                                "finish_reason": _finish_reason(out, bool(idx in tool_streams
                                                                          and tool_streams[idx].num_calls)),
                                "stop_reason": out.stop_reason}]))
                    elif out.delta_text or new_lps or out.finished:
                        lps = None
                        if new_lps is not None:
                            lps, offsets[idx] = self.completion_logprobs(lp_ids, new_lps, offsets.get(idx, 0))
                        yield tagged(idx, len(out.delta_text), out.finished, chunk([{
                            "index": idx, "text": out.delta_text, "logprobs": lps,
                            "finish_reason": out.finish_reason if out.finished else None,
                            "stop_reason": out.stop_reason if out.finished else None}]))
                    if out.finished:
                        finals[idx] = out
            if req.include_usage:
                yield chunk([], usage=self.usage(prep, finals))
        except APIError as e:
            yield sse_data(e.body())
        except Exception:  # noqa: BLE001 - the stream has begun: report in-band, never drop silently
            log.exception("stream %s failed", prep.id)
            yield sse_data(internal_error(prep.id).body())
        yield "data: [DONE]\n\n"

    # ---- logprobs ----------------------------------------------------------------------------------------

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, token_ids, lps, offset: int) -> tuple[dict, int]:
        tokens, values, tops, offsets = [], [], [], []
        for tid, lp in zip(token_ids, lps):
            s = self._token_str(tid)
            tokens.append(s)
            values.append(max(lp.logprob, LOGPROB_FLOOR))
            tops.append({self._token_str(t): max(v, LOGPROB_FLOOR) for t, v in lp.top.items()})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset

    def chat_logprobs(self, token_ids, lps) -> list[dict]:
        def entry(tid, value):
            s = self._token_str(tid)
            return {"token": s, "logprob": max(value, LOGPROB_FLOOR), "bytes": list(s.encode("utf-8"))}
        return [{**entry(tid, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top.items()]}
                for tid, lp in zip(token_ids, lps)]


def _finish_reason(out: RequestOutput, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that ended by itself after calling tools."""
    return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason
