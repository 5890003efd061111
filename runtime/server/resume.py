"""Surviving a server restart: checkpoints of the responses in flight, and resuming them on the next server.

With `--state-dir`, every `--state-checkpoint-interval` seconds and on SIGTERM the server snapshots the engine
between two steps (LLM.snapshot) and writes the responses in flight to the state file (state_file.py).
A server started on the same directory resumes each saved choice at once (LLM.resume_async: prompt + generated
tokens are prefilled again, sampling continues from the saved generator state) and keeps each resumed
response, finished or not, for `result_ttl` seconds after it finished.

Clients reconnect by response id (the `id` of every chunk, also sent as the X-Request-Id response header;
a client may choose it by sending X-Request-Id: KEY, making the id cmpl-KEY / chatcmpl-KEY):

    GET /v1/requests/{id}/stream     SSE, the same chunks as the original stream, from where the client was:
                                     the Last-Event-ID header (or ?last_event_id=) carries the `id:` of the
                                     last event it received; without one, the whole response is sent again.
    GET /v1/requests/{id}            the whole response as JSON (completion or chat.completion), once finished;
                                     what a non-streaming client gets by polling after a restart.

Event ids: every content or finish event of a stream on a server with --state-dir carries
`id: 0:57,1:12f` = per choice index, the characters (code points) of completion text sent so far, and `f` once
its finish event was sent. The text is deterministic from the checkpoint (greedy, or sampled from the saved
generator), so text the client got after the last checkpoint is generated again and skipped, never sent twice.
Requests admitted after the last checkpoint are in the request journal (journal.py), written before their first
byte goes out: a restart runs them again from their prompt with the seed they started with (the server gives
unseeded requests a random one), so a reconnecting client finds them too, whenever the crash came.
What is not saved: requests asking for logprobs, and responses that finished on the old server (their clients
got them).
A client that disconnects from a live server still cancels its request, as without --state-dir.

It owns StateKeeper: which responses are saved, when checkpoints are written, resuming saved responses, and
what reconnecting clients get. The file's format is state_file.py, one sequence's state runtime/sequence_state.py,
the event ids sse.py.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

from starlette.concurrency import run_in_threadpool

from engine.core.errors import EngineError

from ..outputs import RequestOutput
from ..sequence_state import SequenceState, resumable
from .journal import Journal
from .protocol import APIError, internal_error
from .sse import event_id, parse_event_id, sse_data
from .state_file import ChoiceState, FinishedChoice, ResponseState, read_state, write_state

log = logging.getLogger("engine.server")


@dataclass
class _Choice:
    index: int
    request_id: str
    echo: str | None
    text: str = ""                        # text so far (resumed responses)
    result: FinishedChoice | None = None


@dataclass
class Tracked:
    """A response the state file holds: a live one (until its client is done) or a resumed one."""
    id: str
    kind: str
    created: int
    include_usage: bool
    prompt_tokens: int
    choices: dict[int, _Choice]
    resumed: bool = False
    finished_at: float | None = None
    error: APIError | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return all(c.result is not None for c in self.choices.values())

    def update(self, index: int, out: RequestOutput) -> None:
        c = self.choices[index]
        if out.finish_reason == "abort":        # the engine closed (shutdown): it stays resumable
            self.error = APIError("the server is shutting down; its state was saved: resume this response on "
                                  f"the restarted server (GET /v1/requests/{self.id}/stream)", status=503,
                                  type="service_unavailable")
        else:
            c.text = out.text
            if out.finished:
                c.result = FinishedChoice(out.text, list(out.token_ids), out.finish_reason, out.stop_reason)
                if self.finished:
                    self.finished_at = time.time()
        self._notify()

    def _notify(self) -> None:
        # A fresh event per change: every reader holding the old one wakes, none can clear it for the others.
        changed, self.changed = self.changed, asyncio.Event()
        changed.set()

    def fail(self, e: BaseException) -> None:
        log.error("resumed response %s failed: %r", self.id, e)
        self.error = internal_error(self.id)
        self._notify()

    def state(self, sequences: dict[str, SequenceState]) -> ResponseState | None:
        choices = []
        for c in self.choices.values():
            seq = sequences.get(c.request_id)
            if c.result is None and seq is None:
                return None                     # a choice not yet in the engine: the next checkpoint has it
            choices.append(ChoiceState(c.index, c.request_id, c.echo, None if c.result else seq, c.result))
        return ResponseState(self.id, self.kind, self.created, self.include_usage, self.prompt_tokens, choices,
                             self.finished_at)


class StateKeeper:
    """The state directory of one server: tracks responses, writes checkpoints, resumes saved responses."""

    def __init__(self, state_dir: Path, model: str, *, interval: float, result_ttl: float):
        self.state_dir, self.model, self.interval, self.result_ttl = Path(state_dir), model, interval, result_ttl
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise EngineError(f"--state-dir {state_dir} cannot be created ({e}); give a writable directory") from None
        if not os.access(self.state_dir, os.W_OK | os.X_OK):
            raise EngineError(f"--state-dir {state_dir} is not writable; give a directory this server may write")
        self.journal = Journal(self.state_dir, model)
        self.saved = self._recover()                       # a bad file stops the server before it serves
        self.tracked: dict[str, Tracked] = {}
        self._by_request: dict[str, tuple[str, int]] = {}  # engine request id -> (response id, choice index)
        self._sequences: dict[str, SequenceState] = {}     # the latest captured state of each tracked choice
        self._tasks: set[asyncio.Task] = set()
        self._lock: asyncio.Lock | None = None
        self._wrote_empty = False
        self.llm = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopped = False
        self.num_checkpoints = 0

    # ---- live responses (routes.py, completions.py) ------------------------------------------------------

    async def track(self, prep, kind: str, *, include_usage: bool, echo: bool, priority: int) -> None:
        """Save this response in the journal (returning once it is on disk) and in checkpoints until untrack();
        requests with logprobs or tools are not resumable (a resumed stream replays text, not tool calls)."""
        if self.stopped or prep.parse_tools or not all(resumable(c.params) for c in prep.choices):
            return
        choices = {c.index: _Choice(c.index, c.request_id, prep.prompts[c.index // prep.n][1] if echo else None)
                   for c in prep.choices}
        t = Tracked(prep.id, kind, prep.created, include_usage, prep.num_prompt_tokens, choices)
        self._add(t)
        for c in prep.choices:          # until a snapshot has it, a choice is saved as it starts
            self._sequences[c.request_id] = SequenceState.at_start(c.request_id, c.prompt_ids, c.params, priority,
                                                                   lora_name=prep.lora)
        try:
            await self.journal.admit(t.state(self._sequences))
        except EngineError as e:
            self._remove(t)
            log.error("%s", e)
            raise APIError("the server cannot record this request for resuming (its --state-dir cannot be "
                           "written); retry later", status=503, type="service_unavailable") from None

    def untrack(self, response_id: str) -> None:
        t = self.tracked.get(response_id)
        if t is not None and not t.resumed and not self.stopped:
            self._remove(t)
            self.journal.done(response_id)

    def _recover(self) -> list[ResponseState]:
        """What the last server left to resume: the state file's responses, and those the journal admitted after
        it, less those whose clients were done with them."""
        saved = read_state(self.state_dir, self.model)
        admitted, done = self.journal.read()
        kept = {r.id for r in saved}
        return [r for r in saved if r.id not in done] + [r for r in admitted if r.id not in kept | done]

    def on_finished(self, request_id: str, out: RequestOutput) -> None:
        """A choice of a live response finished (completions.py): its result is saved until the response is done."""
        key = self._by_request.get(request_id)
        if key is not None and out.finish_reason != "abort":
            self.tracked[key[0]].update(key[1], out)

    def _add(self, t: Tracked) -> None:
        if t.id in self.tracked:
            raise APIError(f"a response with id {t.id!r} is already kept by this server; send another "
                           "X-Request-Id", status=409, param="X-Request-Id", code="request_id_in_use")
        self.tracked[t.id] = t
        for c in t.choices.values():
            self._by_request[c.request_id] = (t.id, c.index)

    def _remove(self, t: Tracked) -> None:
        self.tracked.pop(t.id, None)
        for c in t.choices.values():
            self._by_request.pop(c.request_id, None)
            self._sequences.pop(c.request_id, None)

    # ---- the lifecycle (app.py) --------------------------------------------------------------------------

    async def start(self, llm) -> None:
        """Once the engine is warm: resume every saved response, then checkpoint every `interval` seconds."""
        self.llm, self.loop, self._lock = llm, asyncio.get_running_loop(), asyncio.Lock()
        for r in self.saved:
            self._resume(r)
        if self.saved:
            log.info("resumed %d responses from %s", len(self.saved), self.state_dir)
        self.saved = []
        self._spawn(self._periodic())

    def shutdown_soon(self) -> None:
        """SIGTERM (from the signal handler): write the state, then stop the engine, which ends every stream
        with an event telling its client to resume on the restarted server."""
        if self.loop is not None and not self.stopped:
            self.loop.call_soon_threadsafe(lambda: self._spawn(self._shutdown()))

    async def _shutdown(self) -> None:
        try:
            await self.checkpoint()
        finally:
            self.stopped = True
            await run_in_threadpool(self.llm.close)

    def stop(self) -> None:
        self.stopped = True
        for t in list(self._tasks):
            t.cancel()
        self.journal.close()

    def get(self, response_id: str) -> Tracked:
        t = self.tracked.get(response_id)
        if t is None or not t.resumed:
            raise APIError(f"no resumable response {response_id!r} on this server: it was not in the last "
                           f"checkpoint, or it finished more than {self.result_ttl:g} s ago; send the request "
                           "again", status=404, type="not_found_error", code="response_not_found")
        return t

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _resume(self, r: ResponseState) -> None:
        choices = {c.index: _Choice(c.index, c.request_id, c.echo, c.result.text if c.result else "", c.result)
                   for c in r.choices}
        t = Tracked(r.id, r.kind, r.created, r.include_usage, r.prompt_tokens, choices, resumed=True,
                    finished_at=r.finished_at)
        self._add(t)
        for c in r.choices:
            if c.sequence is not None:
                self._sequences[c.request_id] = c.sequence
                self._spawn(self._pump(t, c.index, c.sequence))

    async def _pump(self, t: Tracked, index: int, seq: SequenceState) -> None:
        try:
            async for out in self.llm.resume_async(seq):
                t.update(index, out)
        except Exception as e:  # noqa: BLE001 - reported to whoever reads the response
            t.fail(e)

    # ---- checkpoints -------------------------------------------------------------------------------------

    async def _periodic(self) -> None:
        while not self.stopped:
            await asyncio.sleep(self.interval)
            try:
                await self.checkpoint()
            except Exception:  # noqa: BLE001 - a full disk must not stop serving; the next tick retries
                log.exception("writing the inference state to %s failed", self.state_dir)

    async def checkpoint(self) -> int | None:
        """Snapshot the engine and replace the state file; the number of responses saved (None: nothing done)."""
        if self.llm is None or self._lock is None:
            return None
        async with self._lock:
            if self.stopped:
                return None
            segment = self.journal.rotate()      # older segments hold only responses this checkpoint will hold
            snapshot = await run_in_threadpool(self.llm.snapshot)
            self._sequences.update((s.request_id, s) for s in snapshot if s.request_id in self._by_request)
            now = time.time()
            for t in list(self.tracked.values()):
                if t.resumed and t.finished_at is not None and now - t.finished_at > self.result_ttl:
                    self._remove(t)
            responses = [r for t in self.tracked.values() if (r := t.state(self._sequences)) is not None]
            if responses or not self._wrote_empty:
                await run_in_threadpool(write_state, self.state_dir, self.model, responses)
                self._wrote_empty = not responses
                self.num_checkpoints += 1
            await run_in_threadpool(self.journal.drop_before, segment)
            return len(responses)

    # ---- what a reconnecting client gets ------------------------------------------------------------------

    async def stream(self, t: Tracked, last_event_id: str | None, keepalive_s: float) -> AsyncIterator[str]:
        """The SSE remainder of a resumed response after `last_event_id` (all of it when None)."""
        chars, done = parse_event_id(last_event_id) if last_event_id else ({}, set())
        chat = t.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices, **extra) -> str:
            d = {"id": t.id, "object": obj, "created": t.created, "model": self.model, "choices": choices, **extra}
            if t.include_usage and "usage" not in d:
                d["usage"] = None
            return sse_data(d)

        if last_event_id is None:
            for c in t.choices.values():
                if chat:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                elif c.echo is not None:
                    yield chunk([{"index": c.index, "text": c.echo, "logprobs": None, "finish_reason": None}])
        for c in t.choices.values():
            chars.setdefault(c.index, 0)
        while True:
            changed = t.changed
            for c in t.choices.values():
                delta = c.text[chars[c.index]:] if c.index not in done else ""
                chars[c.index] += len(delta)
                end = c.result if c.index not in done else None
                if end is not None:
                    done.add(c.index)
                tag = f"id: {event_id(chars, done)}\n"
                if chat:
                    if delta:
                        yield tag + chunk([{"index": c.index, "delta": {"content": delta}, "logprobs": None,
                                            "finish_reason": None}])
                    if end is not None:
                        yield tag + chunk([{"index": c.index, "delta": {}, "logprobs": None,
                                            "finish_reason": end.finish_reason, "stop_reason": end.stop_reason}])
                elif delta or end is not None:
                    yield tag + chunk([{"index": c.index, "text": delta, "logprobs": None,
                                        "finish_reason": end.finish_reason if end else None,
                                        "stop_reason": end.stop_reason if end else None}])
            if len(done) == len(t.choices):
                break
            if t.error is not None:
                yield sse_data(t.error.body())
                break
            if not await _wait(changed, keepalive_s):
                yield ": keep-alive\n\n"
        if t.include_usage and len(done) == len(t.choices):
            yield chunk([], usage=_usage(t))
        yield "data: [DONE]\n\n"

    async def final(self, t: Tracked) -> dict:
        """The whole resumed response as OpenAI's JSON, once every choice finished."""
        while not t.finished:
            changed = t.changed
            if t.error is not None:
                raise t.error
            await _wait(changed, 60.0)
        choices = []
        for c in sorted(t.choices.values(), key=lambda c: c.index):
            r = c.result
            if t.kind == "chat":
                choices.append({"index": c.index, "message": {"role": "assistant", "content": r.text,
                                                              "refusal": None, "tool_calls": []},
                                "logprobs": None, "finish_reason": r.finish_reason, "stop_reason": r.stop_reason})
            else:
                choices.append({"index": c.index, "text": (c.echo or "") + r.text, "logprobs": None,
                                "finish_reason": r.finish_reason, "stop_reason": r.stop_reason})
        return {"id": t.id, "object": "chat.completion" if t.kind == "chat" else "text_completion",
                "created": t.created, "model": self.model, "choices": choices, "usage": _usage(t)}


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    """Until `event` is set (True) or `timeout` passed (False)."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


def _usage(t: Tracked) -> dict:
    completion = sum(len(c.result.token_ids) for c in t.choices.values() if c.result)
    return {"prompt_tokens": t.prompt_tokens, "completion_tokens": completion,
            "total_tokens": t.prompt_tokens + completion}
