"""The server's server-sent events: how one JSON payload becomes a `data:` event, and the event ids of resumable
streams (--state-dir) that tell a reconnecting client's position in a response.

    id: 0:57,1:12f                  per choice index, the characters (code points) of completion text sent so
    data: {"id": "cmpl-...", ...}   far, and `f` once its finish event was sent (resume.py explains the rest)

Both the live streams (completions.py) and the resumed ones (resume.py) write through here, so the two cannot
drift apart. It knows nothing of the engine, the routes or the state file.
"""
from __future__ import annotations

import json
import re

from .protocol import APIError

_EVENT_ITEM = re.compile(r"(\d+):(\d+)(f?)")


def sse_data(obj: dict) -> str:
    """One `data:` event carrying `obj` as compact JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event_id(chars: dict[int, int], finished: set[int]) -> str:
    """The SSE id of a stream's event: per choice, characters of text sent and whether its finish was sent."""
    return ",".join(f"{i}:{n}{'f' if i in finished else ''}" for i, n in sorted(chars.items()))


def parse_event_id(value: str) -> tuple[dict[int, int], set[int]]:
    """The inverse of event_id; APIError 400 for a Last-Event-ID this server did not write."""
    chars, finished = {}, set()
    for item in filter(None, value.strip().split(",")):
        m = _EVENT_ITEM.fullmatch(item.strip())
        if m is None:
            raise APIError(f"Last-Event-ID {value!r} is not an event id of this server (like '0:57,1:12f'); "
                           "send the `id:` of the last event received, or none to get the whole response",
                           param="Last-Event-ID", code="invalid_value")
        chars[int(m[1])] = int(m[2])
        if m[3]:
            finished.add(int(m[1]))
    return chars, finished
