"""Every error a client can cause, in OpenAI's shape and with its status; none of them is a 500."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, first_data_event, slow_steps

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
LONG_PROMPT = "word " * 300          # over max_input_len 64


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "guided_json": "{"}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a(b"}, "guided_regex"),
    ("/v1/completions", {"prompt": "x", "guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ("/v1/completions", {"prompt": "x", "guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "x", "guided_json": {}, "guided_decoding_backend": "xgrammar"},
     "guided_decoding_backend"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [5, 10**9]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 20, "max_tokens": 5}, None),
    ("/v1/completions", {"prompt": "x", "priority": 3}, "priority"),
    ("/v1/completions", {"max_tokens": 5}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "string", "format": "no-such-format"}}}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
     "response_format"),
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                              "stream": True}, "stream_options.continuous_usage_stats"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content[0].type"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "x", "messages": CHAT["messages"]}, "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
])
def test_bad_parameters_are_400_naming_the_field(client, path, body, param):
    err = error_of(client.post(path, json=body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if param:
        assert param.split(".")[-1].split("[")[0] in err["message"]


def test_over_long_prompts_and_requests_say_the_context_length(client):
    for path, body in (("/v1/completions", {"prompt": LONG_PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}]}),
                       ("/v1/completions", {"prompt": "x", "max_tokens": 1000})):
        err = error_of(client.post(path, json=body), 400)
        assert err["message"].startswith("This model's maximum context length is 256 tokens.")
        assert err["code"] == "context_length_exceeded"


def test_malformed_bodies_are_400_never_500(client):
    assert error_of(client.post("/v1/completions", content=b"{not json",
                                headers={"content-type": "application/json"}), 400)
    bodies = [None, [], "x", 5, {"prompt": None}, {"prompt": {"a": 1}}, {"prompt": [[1, "a"]]},
              {"prompt": "x", "n": "many"}, {"prompt": "x", "stop": [1, 2]}, {"prompt": "x", "seed": 1.5},
              {"prompt": "x", "stream": "perhaps"}, {"messages": "hi"}, {"messages": [{"content": "no role"}]},
              {"prompt": "x", "max_tokens": 10**30}, {"prompt": "x", "temperature": "hot"}]
    for body in bodies:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
            r = client.post(path, json=body)
            assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_model_and_route_are_404(client):
    err = error_of(client.post("/v1/completions", json={"model": "gpt-7", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found" and "gpt-7" in err["message"]
    error_of(client.get("/v1/nothing"), 404)
    error_of(client.get("/v1/completions"), 405)


def test_api_key(strict_server):
    url = strict_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("POST", "/tokenize")):
            r = httpx.request(method, url + path, json={"prompt": "x"}, headers=headers)
            assert error_of(r, 401)["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").status_code == 200            # probes need no key
    assert httpx.get(url + "/metrics").status_code == 200
    ok = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                    headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert openai.OpenAI(base_url=url + "/v1", api_key="sekret").models.list().data[0].id == MODEL


def test_full_queue_is_429_with_retry_after(strict_server):
    """Capacity is one batch (8 sequences, max_queue 0): a stream holding all 8 makes the next request a 429."""
    auth = {"Authorization": "Bearer sekret"}
    # Slowed steps keep the holder generating while the test acts (a tiny model would otherwise finish its 200
    # tokens before the next request arrives on a fast machine).
    with slow_steps(strict_server, 0.02), httpx.Client(base_url=strict_server.url, headers=auth, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "x", "n": 8, "max_tokens": 200, "ignore_eos": True,
                                                       "stream": True}) as holder:
            assert holder.status_code == 200
            lines = holder.iter_lines()  # keep it: a collected line iterator closes the response
            assert first_data_event(lines)["choices"]                  # admitted and generating
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            err = error_of(r, 429)
            assert r.headers["Retry-After"] == "1" and err["code"] == "queue_full"
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=strict_server.url + "/v1", api_key="sekret", max_retries=0).completions.create(
                    model=MODEL, prompt="x", max_tokens=2)
            error_of(c.post("/v1/completions", json={"prompt": "x", "n": 9}), 400)   # could never fit
        strict_server.wait_all_free()                                  # closing the stream freed its 8
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_openai_client_error_types(server):
    oc = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}])
    assert "maximum context length" in str(e.value)


def test_odd_but_valid_values_are_served(client):
    """Values at the edges of what OpenAI allows reach the sampler without breaking it."""
    for extra in ({"seed": -5}, {"seed": 2**63 - 1, "n": 2}, {"top_k": 10**9}, {"stop_token_ids": [10**9]},
                  {"temperature": 1e6}, {"temperature": 1e-6}, {"top_p": 1e-9}, {"repetition_penalty": 1e6},
                  {"stop": ["a", "b", "c", "d", "e"]}, {"priority": 0}, {"user": "u1"}, {"best_of": 1},
                  {"logit_bias": {}}, {"service_tier": "auto"}):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, **extra})
        assert r.status_code == 200, (extra, r.text)


def test_non_finite_numbers_are_400(client):
    for raw in (b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}',
                b'{"prompt": "x", "repetition_penalty": Infinity}'):
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert error_of(r, 400)["param"] in ("temperature", "top_p", "repetition_penalty")
