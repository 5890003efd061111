"""Clients that go away: their requests are aborted and their KV blocks freed, streaming or not."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.server.conftest import slow_steps

BODY = {"prompt": "once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


def test_non_streaming_disconnect_aborts_the_request(server):
    llm = server.state.llm
    steps_before = llm.stats().num_steps
    errors = []

    def call():
        try:
            httpx.post(server.url + "/v1/completions", json=BODY, timeout=1.0)
        except httpx.TimeoutException as e:
            errors.append(e)
    t = threading.Thread(target=call)
    with slow_steps(server, 0.01):           # 200 tokens take > 2 s: the client's 1 s runs out first
        t.start()
        deadline = time.monotonic() + 1.0
        seen_running = False
        while time.monotonic() < deadline and not seen_running:
            seen_running = llm.stats().running > 0
            time.sleep(0.01)
        t.join(timeout=10)
    assert seen_running, "the request never reached the engine"
    assert errors, "the request finished before the client gave up; nothing was cancelled"
    server.wait_all_free(timeout=2.0)
    assert llm.stats().num_steps - steps_before < 200, "the request ran to the end instead of being aborted"


async def _storm(url: str, count: int, timeout: float) -> list:
    """`count` clients that each give up after `timeout` s: halfway through a stream, waiting for a completion, or
    still in the queue (httpx's timeout alone bounds only each read, which a running stream keeps renewing)."""
    limits = httpx.Limits(max_connections=count + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as c:
        async def one(i: int):
            if i % 2:
                async with c.stream("POST", "/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": f"story {i}"}], **{k: v for k, v in BODY.items()
                                                                                   if k != "prompt"},
                        "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass
            else:
                await c.post("/v1/completions", json={**BODY, "prompt": f"{BODY['prompt']} {i}"})
        return await asyncio.gather(*(asyncio.wait_for(one(i), timeout) for i in range(count)),
                                    return_exceptions=True)


def test_cancellation_storm_frees_every_block(server):
    llm = server.state.llm
    before = llm.stats()
    t0 = time.monotonic()
    with slow_steps(server, 0.005):          # 200 tokens take > 1 s even on a fast machine
        results = asyncio.run(_storm(server.url, 200, 0.5))
    assert time.monotonic() - t0 < 30
    gave_up = (httpx.TimeoutException, asyncio.TimeoutError)
    timed_out = sum(isinstance(r, gave_up) for r in results)
    others = [r for r in results if isinstance(r, BaseException) and not isinstance(r, gave_up)]
    assert not others, others[:3]
    assert timed_out >= 150, f"only {timed_out} of 200 requests were cut off; the storm tested little"
    t1 = time.monotonic()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "fresh", "max_tokens": 8}, timeout=5)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert time.monotonic() - t1 < 5
    server.wait_all_free(timeout=5)
    after = llm.stats()
    assert after.num_steps > before.num_steps
    assert after.running == after.waiting == 0 and after.kv_usage == 0


@pytest.mark.parametrize("stream", [False, True])
def test_server_side_state_is_clean_after_normal_requests(server, stream):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": stream})
        assert r.status_code == 200
    server.wait_all_free(timeout=2.0)
