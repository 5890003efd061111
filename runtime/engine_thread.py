"""Who drives an LLM's single-threaded EngineCore: the calling thread (a sync call before any async one), or one
background engine thread from the first async call on, to which every call then submits its requests through a
locked inbox, so that requests from any thread batch together. Outputs go back through per-request sinks (an
asyncio queue, handed a step's outputs for its event loop in one call_soon_threadsafe; or a plain queue).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Callable, Iterator, Union

from engine.core.errors import EngineError

from .engine_core import EngineCore
from .loop_sink import dispatch
from .outputs import RequestOutput
from .sequence import Sequence
from .sequence_state import SequenceState

log = logging.getLogger("engine.runtime")

Sink = Callable[[Union[RequestOutput, BaseException]], None]


class EngineLoopStopped(RuntimeError):
    """The background engine thread died (a bug, not bad input): every request in flight gets it, and so does
    every later one; only a new LLM runs again. The server answers 500 for the requests in flight, 503 after."""


class EngineThread:
    def __init__(self, core: EngineCore):
        self.core = core
        self._cond = threading.Condition()
        self._inbox: list[tuple[str, object]] = []
        self._sinks: dict[str, Sink] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._failure: str | None = None   # EngineLoopStopped's message, once the engine loop has died
        self._drive_lock = threading.Lock()   # one inline driver at a time

    def started(self) -> bool:
        """Whether requests go to the background thread (start() was called and close() was not)."""
        with self._cond:
            return self._thread is not None

    def start(self) -> None:
        """Start the background engine thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()

    def is_running(self) -> bool:
        """Whether the background engine thread is alive (False before start() and after it died or closed)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def close(self) -> None:
        """Stop the background thread; requests still in flight end with finish_reason "abort"."""
        with self._cond:
            thread, self._stopping = self._thread, True
            self._cond.notify()
        if thread is not None:
            thread.join()
        self._thread = None

    def submit(self, seq: Sequence, text: str | None, sink: Sink) -> None:
        """Queue a request for the background thread; its outputs (or the error that ends it) go to `sink`."""
        with self._cond:
            if self._failure is not None:
                raise EngineLoopStopped(self._failure)
            if seq.request_id in self._sinks:
                raise EngineError(f"request id {seq.request_id!r} is already in flight; use a unique id")
            self._sinks[seq.request_id] = sink
            self._inbox.append(("add", (seq, text)))
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            if self._thread is not None:
                self._inbox.append(("abort", request_id))
                self._cond.notify()
                return
        self.core.abort(request_id)

    def snapshot(self, timeout: float) -> list[SequenceState]:
        """The requests in flight, taken between two engine steps."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            threaded = self._thread is not None
            if threaded:
                self._inbox.append(("snapshot", done))
                self._cond.notify()
        if not threaded:
            with self._drive_lock:
                return self.core.snapshot()
        try:
            return done.result(timeout)
        except concurrent.futures.TimeoutError:
            raise EngineError(f"the engine loop did not answer a snapshot within {timeout} s") from None

    def drive(self, seqs: list[tuple[Sequence, str | None]]) -> Iterator[RequestOutput]:
        """Run `seqs` to the end in the calling thread (no background thread), yielding every output."""
        with self._drive_lock:
            for seq, text in seqs:
                self.core.add_request(seq, text)
            try:
                while self.core.has_unfinished():
                    yield from self.core.step()
            finally:
                for rid in list(self.core.requests):  # the caller stopped early, or a step failed
                    self.core.abort(rid)

    def _loop(self) -> None:
        # The thread owns the core for its lifetime; it first waits for an inline driver (a sync call that
        # began before start()) to finish.
        with self._drive_lock:
            try:
                self._run_loop()
            except BaseException as e:  # a bug in a step's hand-over: fail every reader, rather than hang it
                log.exception("the engine loop stopped")
                with self._cond:
                    self._failure = f"the engine loop stopped ({e!r}); start a new LLM"
                    sinks, self._sinks = self._sinks, {}
                for sink in sinks.values():
                    sink(EngineLoopStopped(self._failure))

    def _run_loop(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self.core.has_unfinished() and not self._stopping:
                    self._cond.wait()
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            outputs = []
            for kind, arg in commands:
                if kind == "add":
                    try:
                        self.core.add_request(*arg)
                    except EngineError as e:
                        with self._cond:
                            sink = self._sinks.pop(arg[0].request_id, None)
                        if sink is not None:
                            sink(e)
                elif kind == "snapshot":
                    arg.set_result(self.core.snapshot())
                else:
                    out = self.core.abort(arg)
                    if out is not None:
                        outputs.append(out)
            try:
                if stopping:
                    outputs += [o for rid in list(self.core.requests) if (o := self.core.abort(rid))]
                elif self.core.has_unfinished():
                    outputs += self.core.step()
            except Exception as e:  # a failed step fails every request in flight, not the thread
                log.exception("engine step failed")
                for rid in list(self.core.requests):
                    self.core.abort(rid)
                with self._cond:
                    sinks, self._sinks = self._sinks, {}
                for sink in sinks.values():
                    sink(e)
                continue
            self._dispatch(outputs)
            if stopping:
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._cond:
            sinks = [(self._sinks.get(o.request_id), o) for o in outputs]
            for o in outputs:
                if o.finished:
                    self._sinks.pop(o.request_id, None)
        for rid in dispatch(sinks):   # nobody reads these any more: their event loop closed
            log.warning("request %s aborted: the event loop reading it has closed", rid)
            with self._cond:
                self._sinks.pop(rid, None)
            self.core.abort(rid)
