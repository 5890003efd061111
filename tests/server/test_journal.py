"""The request journal (journal.py): kill -9 of a --state-dir server at a random instant loses no admitted request,
also one that arrived after the last checkpoint. Every client that got its response headers reconnects to the
restarted server and gets the rest; joined, greedy and seeded texts equal an uninterrupted run, and an unseeded
one equals its own whole rerun (it restarts from the seed the server gave it). Real `engine serve` processes.

ENGINE_KILL9_TRIALS=50 runs more trials (docs/reliability.md gives that figure)."""
from __future__ import annotations

import json
import os
import random
import threading
import time

import httpx
import pytest

from engine.runtime.server.journal import Journal
from engine.runtime.server.state_file import ResponseState
from tests.server.test_resume import (PROMPTS, CliServer, free_port, let_clients_finish, resume_stream,
                                      stream_until_cut)
from tests.server.test_resume import read_sse as apply_events

TRIALS = int(os.environ.get("ENGINE_KILL9_TRIALS", "3"))
MAX_TOKENS = 200


def body(i: int) -> dict:
    """Request i: greedy, seeded sampling (i % 4 == 3) or unseeded sampling (i % 4 == 1)."""
    sampling = ({"temperature": 0.9, "top_p": 0.95, "seed": 100 + i} if i % 4 == 3 else
                {"temperature": 0.9} if i % 4 == 1 else {"temperature": 0})
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "ignore_eos": True, **sampling}


def read_sse(response, into: dict) -> None:
    """test_resume.read_sse, but an event counts only once its blank line arrived: kill -9 can cut the last
    line of a stream anywhere, and a client must drop such a torn event (as SSE clients do)."""
    event: list[str] = []
    for line in response.iter_lines():
        if line:
            event.append(line)
        elif event:
            apply_events(_Lines(event), into)
            event = []


class _Lines:
    def __init__(self, lines: list[str]):
        self.lines = lines

    def iter_lines(self):
        return iter(self.lines)


def fresh() -> dict:
    return {"text": "", "last": None, "finish": [], "done": False, "errors": [], "admitted": False}


def kill_9_trial(engine_dir, state_dir, seed: int) -> dict:
    """One trial: 16 streams, kill -9 after a random delay, restart, every client reconnects. Returns counts."""
    rng = random.Random(seed)
    port = free_port()
    interval = rng.choice([30.0, 0.3])          # 30 s: no checkpoint before the kill, only the journal
    first = CliServer(engine_dir, state_dir, port, interval=interval)
    results = [fresh() for _ in PROMPTS]
    restarted = threading.Event()

    def client(i: int):
        r = results[i]
        resp = stream_until_cut(first.url, {**body(i), "stream": True}, f"t{seed}r{i}", r, read_sse)
        r["admitted"] = resp is not None and resp.status_code == 200
        if r["done"]:
            return
        restarted.wait(120)
        status = resume_stream(first.url, f"cmpl-t{seed}r{i}", r, read_sse)
        if status == 404 and not r["admitted"]:        # never admitted: the client sends it again
            r.update(resent=True, text="", last=None)
            with httpx.stream("POST", first.url + "/v1/completions", json={**body(i), "stream": True},
                              timeout=120) as again:
                read_sse(again, r)
        else:
            assert status == 200, (i, status)

    threads = [threading.Thread(target=lambda i=i: _report(client, i, results), daemon=True)
               for i in range(len(PROMPTS))]
    try:
        for t in threads:
            t.start()
        time.sleep(rng.uniform(0.05, 1.0))
        first.proc.kill()
        first.proc.wait(timeout=30)
        cut = sum(r["admitted"] and not r["done"] for r in results)
        second = CliServer(engine_dir, state_dir, port, interval=interval)
        try:
            let_clients_finish(restarted, threads)
            expected = _uninterrupted(second.url)
            reruns = {i: _whole(second.url, f"cmpl-t{seed}r{i}") for i, r in enumerate(results)
                      if i % 4 == 1 and not r.get("resent")}
        finally:
            second.close()
    finally:
        restarted.set()
        first.close()
    for i, r in enumerate(results):
        assert r["errors"] == [] and r["done"] and r["finish"] == ["length"], (seed, i, r)
        want = reruns.get(i) if i % 4 == 1 else expected[i]
        if want is not None:
            assert r["text"] == want, (seed, i, len(r["text"]), len(want))
    return {"admitted": sum(r["admitted"] for r in results), "cut": cut,
            "resent": sum(bool(r.get("resent")) for r in results)}


def _report(client, i: int, results: list) -> None:
    try:
        client(i)
    except Exception as e:  # noqa: BLE001 - shown by the trial's assertions
        results[i]["errors"].append(f"client: {e!r}")


def _uninterrupted(url: str) -> list[str | None]:
    with httpx.Client(base_url=url, timeout=120) as c:
        return [None if i % 4 == 1 else c.post("/v1/completions", json=body(i)).json()["choices"][0]["text"]
                for i in range(len(PROMPTS))]


def _whole(url: str, rid: str) -> str | None:
    """The whole text of a response the restarted server resumed (None when it was not: it finished before)."""
    r = {**fresh()}
    with httpx.stream("GET", f"{url}/v1/requests/{rid}/stream", timeout=120) as resp:
        if resp.status_code == 404:
            return None
        read_sse(resp, r)
    return r["text"]


@pytest.mark.parametrize("seed", range(TRIALS))
def test_kill_9_at_a_random_instant_loses_no_admitted_request(server_engine, tmp_path, seed):
    counts = kill_9_trial(server_engine, tmp_path / "state", seed)
    print(f"trial {seed}: {counts}")


# ---- the journal file itself ----------------------------------------------------------------------------------

def test_a_torn_last_line_is_skipped_and_a_damaged_one_refused(tmp_path):
    import asyncio

    from engine.core.errors import EngineError
    journal = Journal(tmp_path, "tiny")
    responses = [ResponseState(f"cmpl-{k}", "completion", 0, False, 1, []) for k in range(3)]

    async def write():
        await asyncio.gather(*(journal.admit(r) for r in responses))   # one group commit, or two
        journal.done("cmpl-1")
        await journal.admit(ResponseState("cmpl-3", "completion", 0, False, 1, []))
    asyncio.run(write())
    journal.close()
    path = journal.path(journal.segment)
    admitted, done = Journal(tmp_path, "tiny").read()
    assert [r.id for r in admitted] == ["cmpl-0", "cmpl-1", "cmpl-2", "cmpl-3"] and done == {"cmpl-1"}
    path.write_bytes(path.read_bytes() + b'{"admit": {"id": "cmpl-4", "ki')                    # torn by a crash
    assert len(Journal(tmp_path, "tiny").read()[0]) == 4
    lines = path.read_bytes().split(b"\n")
    lines[1] = b'{"admit": 5}'
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(EngineError, match="line 2 is damaged"):
        Journal(tmp_path, "tiny").read()
    with pytest.raises(EngineError, match="for model 'tiny'"):
        Journal(tmp_path, "other").read()
    assert json.loads(lines[0])["format"] == "engine.request_journal"


def test_a_restart_resumes_the_checkpoint_and_the_journal_less_what_was_done(tmp_path):
    """A in the state file and the journal; B, C, E, F only in the journal, C's and E's clients done; D done after
    the checkpoint that holds it: A, B and F are resumed."""
    import asyncio

    from engine.runtime.server.resume import StateKeeper
    from engine.runtime.server.state_file import write_state
    a, b, c, d = (ResponseState(f"cmpl-{k}", "completion", 0, False, 1, []) for k in "abcd")
    write_state(tmp_path, "tiny", [a, d])
    journal = Journal(tmp_path, "tiny")

    async def write():
        for r in (a, b, c):
            await journal.admit(r)
        journal.done("cmpl-c")
        journal.done("cmpl-d")
        await journal.admit(ResponseState("cmpl-e", "completion", 0, False, 1, []))
        journal.done("cmpl-e")
        await journal.admit(ResponseState("cmpl-f", "completion", 0, False, 1, []))   # flushes the done lines
    asyncio.run(write())
    journal.close()
    keeper = StateKeeper(tmp_path, "tiny", interval=30, result_ttl=600)
    assert [r.id for r in keeper.saved] == ["cmpl-a", "cmpl-b", "cmpl-f"]
