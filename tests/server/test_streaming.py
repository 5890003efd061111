"""The exact shape of streamed responses (SSE), as OpenAI sends them, and errors after a stream began."""
from __future__ import annotations

import threading

import httpx
import openai

from engine.runtime import LLM
from tests.server.conftest import MODEL, RunningServer, slow_steps, sse_events

MESSAGES = [{"role": "user", "content": "tell me a story"}]


def stream(client, path, body) -> list:
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def test_chat_stream_shape(client):
    full = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 12,
                                                     "temperature": 0}).json()
    events = stream(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 12, "temperature": 0})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(isinstance(c, dict) and "usage" not in c for c in chunks), "no usage without include_usage"
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and all(c["object"] == "chat.completion.chunk"
                                                                  for c in chunks)
    first, *middle, last = [c["choices"] for c in chunks]
    assert first == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}]
    assert all(len(ch) == 1 and set(ch[0]["delta"]) == {"content"} and ch[0]["finish_reason"] is None
               for ch in middle)
    assert last[0]["delta"] == {} and last[0]["finish_reason"] == full["choices"][0]["finish_reason"]
    assert "".join(ch[0]["delta"]["content"] for ch in middle) == full["choices"][0]["message"]["content"]


def test_chat_stream_usage_chunk_only_with_include_usage(client):
    events = stream(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, "temperature": 0,
                                                     "ignore_eos": True,
                                                     "stream_options": {"include_usage": True}})
    *chunks, usage, done = events
    assert done == "[DONE]"
    assert all(c["usage"] is None for c in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5


def test_completion_stream_n2_and_logprobs(client):
    body = {"prompt": "once upon", "max_tokens": 8, "temperature": 0, "n": 2, "logprobs": 1}
    full = client.post("/v1/completions", json=body).json()
    events = stream(client, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    for i in (0, 1):
        mine = [c["choices"][0] for c in events[:-1] if c["choices"][0]["index"] == i]
        assert all(c["object"] == "text_completion" for c in events[:-1])
        assert "".join(c["text"] for c in mine) == full["choices"][i]["text"]
        assert [c["finish_reason"] for c in mine][-1] == full["choices"][i]["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert tokens == full["choices"][i]["logprobs"]["tokens"]


def test_chat_stream_logprobs_cover_every_token(client):
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "ignore_eos": True}
    events = stream(client, "/v1/chat/completions", body)
    lps = [e for c in events[:-1] for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert len(lps) == 6 and all(len(e["top_logprobs"]) == 2 for e in lps)


def test_openai_client_stream(server):
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    chunks = list(oc.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                             stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    full = oc.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert text == full.choices[0].message.content
    comp = list(oc.completions.create(model=MODEL, prompt="once upon", max_tokens=4, temperature=0, stream=True))
    assert comp[-1].choices[0].finish_reason in ("stop", "length")


def test_keepalive_comments_while_waiting(strict_server):
    """A step slower than keepalive_s (a long prefill, stood in for by a sleep in the engine thread): comments
    keep the connection alive, and the tokens still come."""
    with slow_steps(strict_server, 0.1):
        with httpx.Client(base_url=strict_server.url, headers={"Authorization": "Bearer sekret"}, timeout=30) as c:
            events = stream(c, "/v1/completions", {"prompt": "once upon", "max_tokens": 3, "ignore_eos": True})
    comments = [e for e in events if isinstance(e, str) and e.startswith(":")]
    assert len(comments) >= 3 and all(e == ": keep-alive" for e in comments)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


def test_mid_stream_engine_failure_is_sent_in_band(server, client):
    """An engine step that fails after the stream began: `data: {"error": ...}` then [DONE]; the server lives."""
    core = server.state.llm.core
    real_step, armed = core.step, threading.Event()

    def failing_step():
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected engine failure")
        return real_step()
    core.step = failing_step
    try:
        with client.stream("POST", "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 200,
                                                                 "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            events = []
            for line in lines:
                if line:
                    events += sse_events([line])
                    if len(events) == 2:        # the role chunk and one content chunk: the stream began
                        armed.set()
    finally:
        core.step = real_step
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    # the request's id, not the exception's text (the server's log has that)
    assert "in request chatcmpl-" in err["message"] and err["type"] == "internal_server_error"
    assert "injected engine failure" not in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    server.wait_all_free()
    ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_stream_interval_sends_chunks_of_n_tokens_with_the_same_text(server_engine, client):
    """engine serve --stream-interval 4: a completion of 10 tokens streams as chunks of 1, 4, 4 and 1 tokens
    (the first at once, the last with finish_reason), their text and logprob tokens those of the default server."""
    body = {"prompt": "once upon", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    want = stream(client, "/v1/completions", body)
    s = RunningServer(server_engine, load=lambda: LLM(server_engine, max_kv_tokens=8 * 256, stream_interval=4))
    try:
        s.wait_ready()
        with httpx.Client(base_url=s.url, timeout=30) as c:
            got = stream(c, "/v1/completions", body)
    finally:
        s.stop()
    chunks, reference = [e["choices"][0] for e in got[:-1]], [e["choices"][0] for e in want[:-1]]
    assert [len(c["logprobs"]["tokens"]) for c in chunks] == [1, 4, 4, 1] and len(reference) == 10
    assert [c["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert "".join(c["text"] for c in chunks) == "".join(c["text"] for c in reference)
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == \
        [t for c in reference for t in c["logprobs"]["tokens"]]
