"""Outputs from the engine thread to asyncio queues on event loops of other threads (runtime/llm.py)."""
from __future__ import annotations


class LoopSink:
    """A sink into an asyncio queue read on an event loop of another thread. LLM._dispatch hands all of a step's
    outputs for one loop over in a single call_soon_threadsafe, so a loop serving 32 streams wakes once a step."""
    __slots__ = ("loop", "queue")

    def __init__(self, loop, q) -> None:
        self.loop, self.queue = loop, q

    def __call__(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)
