"""Every endpoint of the shared server over HTTP, checked against the LLM API it serves (same engine, greedy)."""
from __future__ import annotations

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from engine.runtime import SamplingParams
from tests.server.conftest import MODEL

PROMPT = "the quick brown fox"


def reference(server, prompt, **params):
    """The LLM's own answer (submitted to the same engine thread the server uses)."""
    return server.state.llm.generate([prompt], SamplingParams(**params))[0]


def test_health_and_models(server, client):
    assert client.get("/health").status_code == 200
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    (card,) = models["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == 256 and card["root"] == MODEL      # never the engine's path


def test_completion_greedy_matches_the_llm_api(server, client):
    ref = reference(server, PROMPT, temperature=0, max_tokens=12)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["text"] == ref.text and choice["finish_reason"] == ref.finish_reason
    assert body["usage"] == {"prompt_tokens": ref.num_prompt_tokens, "completion_tokens": ref.num_generated_tokens,
                             "total_tokens": ref.num_prompt_tokens + ref.num_generated_tokens}
    server.wait_all_free()


def test_completion_prompt_forms_echo_and_batch(server, client):
    ids = server.state.llm.tokenizer.encode(PROMPT)
    ref = reference(server, ids, temperature=0, max_tokens=6)
    for prompt in (ids, [PROMPT, PROMPT], [ids, ids]):
        body = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                    "temperature": 0, "echo": True}).json()
        texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
        k = 1 if prompt is ids else 2
        assert texts == [PROMPT + ref.text] * k
        assert body["usage"]["prompt_tokens"] == k * len(ids)


def test_n_choices_with_seed_differ_and_reproduce(client):
    req = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "n": 3, "seed": 7}
    a = client.post("/v1/completions", json=req).json()
    b = client.post("/v1/completions", json=req).json()
    ta, tb = ([c["text"] for c in sorted(x["choices"], key=lambda c: c["index"])] for x in (a, b))
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert ta == tb, "a seeded request must reproduce"
    assert len(set(ta)) > 1, "choices of one seeded request must not all be equal"
    assert 3 <= a["usage"]["completion_tokens"] <= 48


def test_sampling_fields_reach_the_sampler(server, client):
    """stop, stop_token_ids, ignore_eos, min_tokens, penalties and top-k/p/min-p give what the LLM API gives."""
    params = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=3, presence_penalty=0.5,
                  frequency_penalty=0.3, repetition_penalty=1.2, max_tokens=20, ignore_eos=True, min_tokens=2)
    ref = reference(server, PROMPT, **params)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **params}).json()
    assert r["choices"][0]["text"] == ref.text
    stop_at = ref.token_ids[5]
    ref_stop = reference(server, PROMPT, **params, stop_token_ids=[stop_at])
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **params,
                                             "stop_token_ids": [stop_at]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == stop_at
    assert r["choices"][0]["text"] == ref_stop.text
    assert len(ref.text) >= 7
    stop_str = ref.text[4:7]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, **params, "stop": [stop_str]})
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop_str
    assert stop_str not in c["text"] and ref.text.startswith(c["text"])


def test_completion_logprobs(server, client):
    ref = reference(server, PROMPT, temperature=0, max_tokens=5, logprobs=3)
    c = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                             "logprobs": 3}).json()["choices"][0]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    np.testing.assert_allclose(lp["token_logprobs"], [x.logprob for x in ref.logprobs], atol=1e-6)
    assert all(len(t) <= 3 for t in lp["top_logprobs"])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


def test_chat_completion_and_logprobs(server, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    ids = server.state.llm.chat_prompt(messages)
    ref = reference(server, ids, temperature=0, max_tokens=10, logprobs=2)
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_completion_tokens": 10,
                                                  "temperature": 0, "logprobs": True, "top_logprobs": 2})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == ref.text
    content = choice["logprobs"]["content"]
    assert len(content) == len(ref.token_ids)
    for entry, want in zip(content, ref.logprobs):
        assert abs(entry["logprob"] - want.logprob) < 1e-6 and len(entry["top_logprobs"]) == 2
        assert bytes(entry["bytes"]).decode("utf-8") == entry["token"]
    assert body["usage"]["prompt_tokens"] == len(ids)
    # text content parts are joined, as OpenAI's content arrays are
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages[:1] + parts,
                                                  "max_tokens": 10, "temperature": 0}).json()
    assert r["choices"][0]["message"]["content"] == ref.text


def test_chat_without_max_tokens_fills_the_context(server, client):
    messages = [{"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "ignore_eos": True}).json()
    prompt = r["usage"]["prompt_tokens"]
    assert r["usage"]["completion_tokens"] == 256 - prompt and r["choices"][0]["finish_reason"] == "length"


def test_tokenize_and_detokenize(server, client):
    tok = server.state.llm.tokenizer
    r = client.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert "".join(r["token_strs"]) == PROMPT
    messages = [{"role": "user", "content": "hello"}]
    r = client.post("/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == server.state.llm.chat_prompt(messages)
    assert client.post("/detokenize", json={"tokens": tok.encode(PROMPT)}).json() == {"prompt": PROMPT}


def _samples(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                           if k != "model_name") + "}" if len(s.labels) > 1 else "")
            out[key] = s.value
    return out


def test_metrics_use_vllm_names_and_count_requests(server, client):
    before = _samples(client.get("/metrics").text)
    for _ in range(3):
        client.post("/v1/completions", json={"prompt": PROMPT * 3, "max_tokens": 4, "temperature": 0,
                                             "ignore_eos": True})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    after = _samples(r.text)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "process_resident_memory_bytes"):
        assert name in after, name
    assert after["process_resident_memory_bytes"] > 1e6
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    grew = {k: after[k] - before.get(k, 0) for k in after}
    assert grew["vllm:e2e_request_latency_seconds_count"] == 3
    assert grew["vllm:time_to_first_token_seconds_count"] == 3
    assert grew["vllm:inter_token_latency_seconds_count"] == 3 * 3      # 4 tokens: 3 gaps each
    assert grew["vllm:generation_tokens_total"] == 12
    assert grew["vllm:request_success_total{finished_reason=length}"] == 3
    # the same prompt three times: the prefix cache was queried and hit
    assert grew["vllm:prefix_cache_queries_total"] > 0 and grew["vllm:prefix_cache_hits_total"] > 0
    plan = server.state.llm.kv_plan
    assert after["engine:kv_cache_pool_bytes"] == plan.num_bytes
    # every request's blocks were freed, but the pool's memory they touched stays resident: at least one
    # request's blocks (the prompt three times is one request's worth; the others hit its prefix), at most the
    # pool (the server is shared with earlier tests)
    one_request = -(-len(server.state.llm.tokenizer.encode(PROMPT * 3)) // plan.tokens_per_block)
    touched = after["engine:kv_cache_touched_bytes"]
    assert plan.bytes_per_block * one_request <= touched <= plan.num_bytes
    assert touched == server.state.llm.core.blocks.pool.num_touched * plan.bytes_per_block
