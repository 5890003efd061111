"""`engine serve --ray` on a local Ray cluster of 2 CPUs: 2 replicas of the tiny engine, each its own ingress, through
Ray's HTTP proxy and the official openai client.

    concurrent streams give the greedy text a single server gives, and use both replicas
    the API key, errors, and 429 from the replicas themselves once each is at its capacity
    requests that share a prompt prefix land on one replica (forwarded there by the one Ray's proxy chose), whose
    metrics count the prefix-cache hits
    a small body reaches the replica inside the request's scope (read by the proxy's middleware); a large or chunked
    one, and one over the server's limit (413), through Ray's callback to the proxy
    a client that goes away frees its request on the replica
    a replica killed (SIGKILL) mid-stream fails only its own streams, at once; the rest finish; Ray restarts it
The cluster is made once for the module (~15 s) and the kill test runs last.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'engine[ray]'")
openai = pytest.importorskip("openai")

import ray  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402

from engine.runtime import LLM  # noqa: E402
from engine.runtime.replicas.app import APP_NAME, build_application  # noqa: E402
from engine.runtime.replicas.config import ClusterConfig, EngineOptions, ReplicaConfig  # noqa: E402
from engine.runtime.replicas.proxy_guard import PROXY_CALLBACK, PROXY_CALLBACK_ENV  # noqa: E402
from engine.runtime.server.config import ServerConfig  # noqa: E402
from tests.runtime.tiny_engine import build_tiny_engine  # noqa: E402
from tests.server.conftest import RunningServer  # noqa: E402

MODEL = "tiny"
# Prompts of a few 64-character chunks (the router's unit) fit: the tiny tokenizer spends ~1.5 characters a token.
BUILD = dict(max_batch_size=8, max_input_len=192, max_seq_len=256, max_num_tokens=64, tokens_per_block=8)
KV_TOKENS = 8 * 256
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = 200             # tokens of the streams a test interrupts (~0.2-1 s on the tiny engine)
SYSTEM = ("You are the help desk of a small hardware store. Answer in one short line and name the aisle. "
          "Never invent a product.")


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return build_tiny_engine(tmp_path_factory.mktemp("ray_engine"), **BUILD)[1]


@pytest.fixture(scope="module")
def cluster(engine_dir):
    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)       # as run.py does: Ray's proxy inherits it
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}   # ray.init replaces them
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=128 * 2**20, log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # no queue in a replica beyond its batch of 8: 16 streams at once, the rest 429
        server = ServerConfig(engine_dir=engine_dir, served_model_name=MODEL, api_key=KEY, max_queue=0)
        replica = ReplicaConfig(server, EngineOptions(max_kv_tokens=KV_TOKENS, threads=1))
        serve.run(build_application(replica, ClusterConfig(replicas=2)), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for s, handler in handlers.items():
            signal.signal(s, handler)


@pytest.fixture(scope="module")
def single_server(engine_dir):
    s = RunningServer(engine_dir, load=lambda: LLM(engine_dir, max_kv_tokens=KV_TOKENS, threads=1))
    s.wait_ready()
    yield s
    s.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def stream_completion(c: openai.OpenAI, prompt: str, max_tokens: int = 24, **extra) -> tuple[str | None, str]:
    """(the replica that served it, the streamed text)."""
    raw = c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                 stream=True, **extra)
    text = "".join(chunk.choices[0].text for chunk in raw.parse() if chunk.choices)
    return raw.headers.get("x-engine-replica"), text


def replica_metric(url: str, name: str) -> dict[str, float]:
    """replica -> the value of sample `name` in the ingress's merged /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["replica"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def request_bodies(url: str) -> dict[str, float]:
    """via ("scope" or "proxy") -> POST bodies the replicas received that way, over all replicas."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name == "engine:replica_request_bodies_total":
                out[s.labels["via"]] = out.get(s.labels["via"], 0) + s.value
    return out


def bodies_since(url: str, before: dict[str, float]) -> dict[str, float]:
    return {via: n - before.get(via, 0) for via, n in request_bodies(url).items() if n - before.get(via, 0)}


def test_concurrent_streams_match_a_single_server_and_use_both_replicas(cluster, single_server):
    prompts = [f"Request {i}: " + "tell me about bolts and nuts, " * (i % 4) for i in range(12)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        on_ray = list(pool.map(lambda p: stream_completion(client(cluster), p), prompts))
        alone = list(pool.map(lambda p: stream_completion(client(single_server.url), p)[1], prompts))
    assert [text for _, text in on_ray] == alone
    assert all(text for text in alone)
    assert len({replica for replica, _ in on_ray}) == 2


def test_chat_models_health_and_errors_are_the_servers(cluster):
    c = client(cluster)
    reply = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                      temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 5
    assert [m.id for m in c.models.list()] == [MODEL]
    assert httpx.get(cluster + "/health").status_code == 200
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=cluster + "/v1", api_key="wrong", max_retries=0).models.list()


def test_beyond_every_replicas_capacity_requests_get_429(cluster):
    def stream(i: int):
        with httpx.stream("POST", cluster + "/v1/completions", headers=AUTH, timeout=60,
                          json={"model": MODEL, "prompt": f"Count {i}:", "max_tokens": LONG,
                                            "ignore_eos": True, "stream": True}) as r:
            r.read()
            return r.status_code, r.headers.get("retry-after"), r.text
    with ThreadPoolExecutor(28) as pool:
        results = list(pool.map(stream, range(28)))
    refused = [(retry, body) for status, retry, body in results if status == 429]
    assert refused and all(retry == "1" and '"code":"queue_full"' in body for retry, body in refused)
    assert all(status in (200, 429) for status, _, _ in results)


def test_requests_sharing_a_prefix_land_on_one_replica_and_hit_its_prefix_cache(cluster):
    before = replica_metric(cluster, "vllm:prefix_cache_hits_total")
    c = client(cluster)
    served = [stream_completion(c, f"{SYSTEM} Question 0: where are the hinges?", max_tokens=4)[0]]
    time.sleep(0.5)     # the replica that took the prefix tells the others (peers.py), in well under this
    served += [stream_completion(c, f"{SYSTEM} Question {i}: where are the hinges?", max_tokens=4)[0]
               for i in range(1, 6)]
    assert len(set(served)) == 1, served
    after = replica_metric(cluster, "vllm:prefix_cache_hits_total")
    owner = served[0]
    other = next(r for r in after if r != owner)
    # ~75 shared prompt tokens: 9 full blocks of 8 hit on each of the 5 repeats
    assert after[owner] - before.get(owner, 0) >= 5 * 64
    assert after[other] == before.get(other, 0)


def test_small_bodies_come_in_the_scope_large_chunked_and_refused_ones_through_the_proxy(cluster):
    before = request_bodies(cluster)
    reply = client(cluster).completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2
    assert bodies_since(cluster, before) == {"scope": 1}
    before = request_bodies(cluster)
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}).encode()
    headers = {**AUTH, "content-type": "application/json"}

    def post(content) -> httpx.Response:
        return httpx.post(cluster + "/v1/completions", content=content, headers=headers, timeout=60)
    padded = post(body[:-1] + b" " * (65 * 2**10) + b"}")         # JSON's whitespace: over the scope's 64 KiB
    chunked = post(iter([body[:10], body[10:]]))                  # no Content-Length
    too_large = post(b" " * (4 * 2**20 + 1))                      # the server's --max-body-bytes
    assert padded.json()["choices"][0]["text"] == chunked.json()["choices"][0]["text"] == reply.choices[0].text
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "request_too_large"
    assert bodies_since(cluster, before) == {"proxy": 3}


def test_clients_that_go_away_free_their_requests_on_the_replicas(cluster):
    """Streams abandoned after their first event are aborted (not run to their end) and their sequences freed; their
    bodies came in the scope, so the app's later receive() (the disconnect) still reaches the proxy."""
    done_before = sum(replica_metric(cluster, "vllm:request_success_total").values())
    bodies_before = request_bodies(cluster)
    with httpx.Client(timeout=30) as http:
        responses = [http.send(http.build_request("POST", cluster + "/v1/completions", headers=AUTH, json={
            "model": MODEL, "prompt": f"Count {i}:", "max_tokens": LONG, "ignore_eos": True, "stream": True}),
            stream=True) for i in range(8)]
        for r in responses:
            next(r.iter_lines())
            r.close()
    deadline = time.monotonic() + 10
    while any(replica_metric(cluster, "vllm:num_requests_running").values()):
        assert time.monotonic() < deadline, "abandoned requests still run on their replicas"
        time.sleep(0.1)
    assert sum(replica_metric(cluster, "vllm:request_success_total").values()) - done_before < 8
    assert bodies_since(cluster, bodies_before) == {"scope": 8}


def test_a_killed_replica_fails_only_its_streams_and_comes_back(cluster):
    """Runs last: it kills a replica. Its streams (those it served or relayed) end with an error event within
    seconds (one that had already finished before the kill may complete); the other replica's streams finish
    whole."""
    c = client(cluster)

    def start(i: int):
        raw = c.completions.with_raw_response.create(model=MODEL, prompt=f"Stream {i}:", max_tokens=LONG,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
        it = iter(raw.parse())
        next(it)                                   # under way
        # a stream one replica passed to the other (its queue was full) depends on both
        return {raw.headers["x-engine-replica"], raw.headers.get("x-engine-via")} - {None}, it
    with ThreadPoolExecutor(16) as pool:
        on, iterators = zip(*pool.map(start, range(16)))
    victim = next(iter(on[0]))
    assert len(set().union(*on)) == 2
    killed_at = time.monotonic()
    os.kill(_replica_pid(victim), signal.SIGKILL)

    def finish(it):
        try:
            return sum(len(chunk.choices[0].text) > 0 for chunk in it if chunk.choices), None
        except openai.APIError as e:
            return None, (str(e), time.monotonic() - killed_at)
    with ThreadPoolExecutor(len(iterators)) as pool:
        results = list(pool.map(finish, iterators))
    failures = [failure for replicas, (_, failure) in zip(on, results) if victim in replicas and failure]
    assert failures and all("replica" in msg and after < 10 for msg, after in failures), failures
    assert all(failure is None for replicas, (_, failure) in zip(on, results) if victim not in replicas)
    _wait_for_replicas(cluster, 2, replaced=victim, timeout=90)
    assert stream_completion(c, "After the restart:")[1]


def _replica_pid(replica_id: str) -> int:
    actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#LLMReplica#{replica_id}", namespace="serve")
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def _wait_for_replicas(url: str, n: int, replaced: str, timeout: float) -> None:
    """Until n replicas answer the ingress's /metrics (it asks every replica), `replaced` not among them."""
    deadline = time.monotonic() + timeout
    while True:
        replicas = set(replica_metric(url, "vllm:num_requests_running"))
        if len(replicas) == n and replaced not in replicas:
            return
        assert time.monotonic() < deadline, f"after {timeout} s the replicas are {replicas}"
        time.sleep(0.5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
