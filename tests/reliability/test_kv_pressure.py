"""100 concurrent long requests against a KV pool that holds three max-length sequences, through the HTTP server.

Every request needs ~27 blocks of the pool's 96 and eight run at once, so the scheduler must preempt (by
recompute) over and over. Nothing may be lost: every request completes with 200, with exactly the greedy text
the same prompt gives when it runs alone on a roomy pool, whether streamed or not. Preemptions happen (counted),
every KV block is back in the pool afterwards, and the process's memory stays flat: a second identical round may
not grow the resident set by more than RSS_SLACK (the first round pays the one-time allocations).
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.runtime import LLM, SamplingParams
from tests.reliability.conftest import rss_bytes
from tests.server.conftest import RunningServer

REQUESTS = 100
PROMPTS = [f"Request {i}: the quick brown fox {'jumps over ' * (i % 4)}the lazy dog number {i}" for i in range(10)]
MAX_TOKENS = 200
POOL_TOKENS = 3 * 256            # three sequences of max_seq_len 256
RSS_SLACK = 64 * 2**20


@pytest.fixture(scope="module")
def alone(artifacts) -> dict[str, str]:
    """The greedy completion of each prompt run by itself on a pool with room for everything."""
    llm = LLM(artifacts.engine, max_kv_tokens=8 * 256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {p: llm.generate([p], params)[0].text for p in PROMPTS}
    llm.close()
    return out


async def _one(client: httpx.AsyncClient, i: int) -> tuple[int, str, int]:
    """(status, text, completion tokens) of request i; odd requests stream."""
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if i % 2 == 0:
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return r.status_code, r.text, 0
        data = r.json()
        return 200, data["choices"][0]["text"], data["usage"]["completion_tokens"]
    text, tokens = [], 0
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode(), 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return 500, json.dumps(event), 0
            text += [c["text"] for c in event["choices"]]
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return 200, "".join(text), tokens


async def _round(url: str) -> list[tuple[int, str, int]]:
    limits = httpx.Limits(max_connections=REQUESTS, max_keepalive_connections=REQUESTS)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        return await asyncio.gather(*(_one(client, i) for i in range(REQUESTS)))


@pytest.mark.slow
def test_100_concurrent_long_requests_on_a_small_pool(artifacts, alone):
    server = RunningServer(artifacts.engine, load=lambda: LLM(artifacts.engine, max_kv_tokens=POOL_TOKENS))
    try:
        server.wait_ready()
        llm = server.state.llm
        assert llm.stats().num_blocks * llm.config.build.tokens_per_block == POOL_TOKENS
        rss = []
        lost = []
        for round_ in range(2):
            results = asyncio.run(_round(server.url))
            server.wait_all_free(timeout=30)
            rss.append(rss_bytes())
            for i, (status, text, tokens) in enumerate(results):
                expected = alone[PROMPTS[i % len(PROMPTS)]]
                if status != 200 or text != expected or tokens != MAX_TOKENS:
                    lost.append((round_, i, status, text[:80], tokens))
        preemptions = llm.stats().preemptions
        print(f"\n{2 * REQUESTS} requests ({REQUESTS} concurrent, {MAX_TOKENS} tokens each) on a {POOL_TOKENS}-token "
              f"pool: {len(lost)} lost, {preemptions} preemptions, RSS after round 1 {rss[0] / 2**20:.1f} MiB, "
              f"after round 2 {rss[1] / 2**20:.1f} MiB ({(rss[1] - rss[0]) / 2**20:+.1f} MiB)")
        assert lost == []
        assert preemptions > 0
        assert rss[1] - rss[0] < RSS_SLACK
        llm.check_all_free()
    finally:
        server.stop()
