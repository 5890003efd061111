"""The request journal of a --state-dir server: every admitted response, written before its first byte goes out,
so that a crash at any instant loses none (checkpoints alone lose what arrived after the last one).

    <state-dir>/journal-<n>.jsonl      one JSON object a line, appended, n growing
    {"format": "engine.request_journal", "format_version": 1, "model": "smollm2"}      first line of a segment
    {"admit": <state_file ResponseState JSON, each choice's sequence at its start>}
    {"done": "cmpl-..."}                                                             its client is done with it

Group commit: admissions that arrive while a write is in flight wait for the next one, and each write is one
write() and one fsync() for all of them, in a worker thread (the event loop never waits on the disk). `admit`
returns once its line is on disk; `done` lines ride along with the next write and are waited for by nobody.

Segments: a checkpoint (resume.py) first starts a new segment, then writes the state file holding every response
tracked at that point, then deletes the older segments, whose responses that file now holds. A restart reads
every segment left: responses admitted and not done, and not in the state file, are re-run from their prompt
with the sampling state they started with (their seed), so they produce the same text again. A line torn by the
crash can only be the last of its segment and was never acknowledged (its client got nothing): it is skipped.

It owns the journal's files and their format; what a response is (state_file.py) and when to rotate (resume.py)
are not its business. It knows nothing of HTTP or the engine.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from engine.core.errors import EngineError

from .state_file import ResponseState, response_from_json, response_to_json

FORMAT = "engine.request_journal"
FORMAT_VERSION = 1
_SEGMENT = re.compile(r"journal-(\d+)\.jsonl")


class Journal:
    def __init__(self, state_dir: Path, model: str):
        self.state_dir, self.model = Path(state_dir), model
        self.segment = max(self.segments(), default=0) + 1     # never append to a crashed server's segment
        self._pending: list[bytes] = []
        self._waiters: list[asyncio.Future] = []
        self._writer: asyncio.Task | None = None
        self._file = None                                       # (segment number, open file) of the writer thread

    def segments(self) -> list[int]:
        return sorted(int(m[1]) for p in self.state_dir.iterdir() if (m := _SEGMENT.fullmatch(p.name)))

    def path(self, segment: int) -> Path:
        return self.state_dir / f"journal-{segment}.jsonl"

    # ---- writing (the event loop) -----------------------------------------------------------------------------

    async def admit(self, response: ResponseState) -> None:
        """Append `response` and return once it is on disk (fsynced with whatever else arrived meanwhile)."""
        done = asyncio.get_running_loop().create_future()
        self._append({"admit": response_to_json(response)}, done)
        await done

    def done(self, response_id: str) -> None:
        """Its client is done with it: a restart need not resume it (written with the next group, not awaited)."""
        self._append({"done": response_id}, None)

    def rotate(self) -> int:
        """Start a new segment for what is appended from now on; the segments before the returned one hold only
        responses admitted before this call."""
        self.segment += 1
        return self.segment

    def drop_before(self, segment: int) -> None:
        for n in self.segments():
            if n < segment:
                self.path(n).unlink(missing_ok=True)

    def _append(self, record: dict, waiter: asyncio.Future | None) -> None:
        self._pending.append(json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
        if waiter is not None:
            self._waiters.append(waiter)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.ensure_future(self._write_groups())

    async def _write_groups(self) -> None:
        while self._pending:
            lines, waiters, segment = self._pending, self._waiters, self.segment
            self._pending, self._waiters = [], []
            try:
                await run_in_threadpool(self._write, segment, lines)
            except Exception as e:  # noqa: BLE001 - a full disk: the requests waiting on it are refused
                for w in waiters:
                    if not w.done():
                        w.set_exception(EngineError(f"the request journal in {self.state_dir} cannot be written "
                                                    f"({e}); free disk space there"))
                continue
            for w in waiters:
                if not w.done():
                    w.set_result(None)

    def _write(self, segment: int, lines: list[bytes]) -> None:
        if self._file is None or self._file[0] != segment:
            if self._file is not None:
                self._file[1].close()
            f = open(self.path(segment), "ab")
            if f.tell() == 0:
                f.write(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "model": self.model})
                        .encode() + b"\n")
            self._file = (segment, f)
        f = self._file[1]
        f.write(b"".join(lines))
        f.flush()
        os.fsync(f.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file[1].close()
            self._file = None

    # ---- reading (at start) -----------------------------------------------------------------------------------

    def read(self) -> tuple[list[ResponseState], set[str]]:
        """(responses admitted, in order; ids of those done) over every segment left by earlier servers."""
        admitted: dict[str, ResponseState] = {}
        done: set[str] = set()
        for n in self.segments():
            path = self.path(n)
            lines = path.read_bytes().split(b"\n")
            fix = f"move {path} away to start without the requests it holds"
            for i, line in enumerate(lines):
                if not line:
                    continue
                try:
                    record = json.loads(line)
                    if i > 0 and "admit" in record:
                        r = response_from_json(record["admit"])
                        admitted[r.id] = r
                    elif i > 0:
                        done.add(str(record["done"]))
                except (EngineError, ValueError, KeyError, TypeError, AssertionError) as e:
                    if i == len(lines) - 1:       # torn by the crash, never acknowledged
                        continue
                    raise EngineError(f"{path} line {i + 1} is damaged ({e}); {fix}") from None
                if i == 0:
                    _check_header(record, path, self.model, fix)
        return list(admitted.values()), done


def _check_header(record: dict, path: Path, model: str, fix: str) -> None:
    if record.get("format") != FORMAT or record.get("format_version") != FORMAT_VERSION:
        raise EngineError(f"{path} is not a request journal of format_version {FORMAT_VERSION}; {fix}")
    if record.get("model") != model:
        raise EngineError(f"{path} holds requests for model {record.get('model')!r}, but this server serves "
                          f"{model!r}; {fix}")
