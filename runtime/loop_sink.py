"""Outputs from the engine thread to their readers: asyncio queues on event loops of other threads, or plain
callables (runtime/llm.py)."""
from __future__ import annotations


class LoopSink:
    """A sink into an asyncio queue read on an event loop of another thread. dispatch() hands all of a step's
    outputs for one loop over in a single call_soon_threadsafe, so a loop serving 32 streams wakes once a step."""
    __slots__ = ("loop", "queue")

    def __init__(self, loop, q) -> None:
        self.loop, self.queue = loop, q

    def __call__(self, item) -> bool:
        """Hands one item over; False when the loop has closed."""
        return hand_over(self.loop, [(self.queue, item)])


def hand_over(loop, items) -> bool:
    """Puts (queue, item) pairs on their queues in one callback on `loop`; False when the loop has closed: its
    reader is gone (asyncio.run returned while one of its streams was left early but not yet aborted)."""
    try:
        loop.call_soon_threadsafe(put_all, items)
    except RuntimeError:   # "Event loop is closed"
        return False
    return True


def put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)


def dispatch(pairs) -> list[str]:
    """Hands each (sink, output) over, one wake-up of each event loop for all its outputs; a None sink (the
    request was aborted meanwhile) drops its output. Returns the ids of unfinished requests whose loop has
    closed, for the caller to abort."""
    by_loop: dict = {}
    for sink, o in pairs:
        if isinstance(sink, LoopSink):
            by_loop.setdefault(sink.loop, []).append((sink.queue, o))
        elif sink is not None:
            sink(o)
    orphans = []
    for loop, items in by_loop.items():
        if not hand_over(loop, items):
            orphans += [o.request_id for _, o in items if not o.finished]
    return orphans
