"""What the server must not tell a client (its engine's path, the text of its exceptions), and two requests that
must not share one X-Request-Id: the second is a 409 before any byte of its stream."""
from __future__ import annotations

import logging

import httpx

from tests.server.conftest import MODEL, first_data_event, slow_steps

SECRET = "secret-detail-/home/operator/engines"


def test_models_does_not_show_the_engine_path(server, client):
    card = client.get("/v1/models").json()["data"][0]
    assert card["root"] == MODEL
    assert str(server.config.engine_dir) not in client.get("/v1/models").text


def test_a_second_stream_with_the_same_request_id_is_409(server, client):
    req = {"prompt": "x", "max_tokens": 100, "ignore_eos": True, "stream": True}
    with slow_steps(server, 0.01):
        with client.stream("POST", "/v1/completions", json=req, headers={"X-Request-Id": "dup"}) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            first_data_event(lines)
            for stream in (True, False):
                r = client.post("/v1/completions", json={**req, "stream": stream}, headers={"X-Request-Id": "dup"})
                assert r.status_code == 409, r.text
                err = r.json()["error"]
                assert err["param"] == "X-Request-Id" and err["code"] == "request_id_in_use" and "cmpl-dup" in \
                    err["message"]
            # another kind of response has another id (chatcmpl-dup)
            chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 2}, headers={"X-Request-Id": "dup"})
            assert chat.status_code == 200 and chat.json()["id"] == "chatcmpl-dup"
    server.wait_all_free()
    again = client.post("/v1/completions", json={**req, "stream": False, "max_tokens": 2},
                        headers={"X-Request-Id": "dup"})
    assert again.status_code == 200 and again.json()["id"] == "cmpl-dup"      # free once the first is done


def test_a_500_names_the_request_not_the_exception(server, client, caplog):
    serving = server.state.serving

    async def broken(*a, **k):
        raise RuntimeError(SECRET)

    async def broken_engine(*a, **k):
        raise RuntimeError(SECRET)
        yield

    with caplog.at_level(logging.ERROR, logger="engine.server"):
        real = serving.prepare_completion
        serving.prepare_completion = broken
        try:
            r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        finally:
            serving.prepare_completion = real
        assert r.status_code == 500 and SECRET not in r.text
        ref = r.headers["X-Request-Id"]
        assert ref in r.json()["error"]["message"] and r.json()["error"]["type"] == "internal_server_error"

        real_generate = serving.llm.generate_async
        serving.llm.generate_async = broken_engine
        try:
            plain = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            stream = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        finally:
            serving.llm.generate_async = real_generate
    assert plain.status_code == 500 and SECRET not in plain.text
    assert "in request cmpl-" in plain.json()["error"]["message"]
    assert stream.status_code == 200 and SECRET not in stream.text
    assert stream.headers["X-Request-Id"] in stream.text and '"internal_server_error"' in stream.text
    assert caplog.text.count(SECRET) >= 3 and ref in caplog.text             # the operator still sees the cause
    server.wait_all_free()
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
