"""Output constraints through the server (structured_fields.py): OpenAI's response_format, vLLM's
structured_outputs and guided_* aliases, on chat and completions, streamed or not. The tiny engine's model is
random, so only the constraint makes its output parse."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL, sse_events

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                           "status": {"enum": ["open", "closed"]},
                                           "labels": {"type": "array", "items": {"enum": ["bug", "docs"]},
                                                      "maxItems": 2}},
          "required": ["id", "status", "labels"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "an issue as JSON"}]


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_response_format_json_schema_through_the_openai_client(oai, server):
    rf = {"type": "json_schema", "json_schema": {"name": "issue", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        r = oai.chat.completions.create(model=MODEL, messages=CHAT, response_format=rf, max_tokens=120,
                                        temperature=1.0, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        streamed = oai.chat.completions.create(model=MODEL, messages=CHAT, response_format=rf, max_tokens=120,
                                               temperature=1.0, seed=seed, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            r.choices[0].message.content
    server.wait_all_free()


def test_json_object_mode(oai):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, response_format={"type": "json_object"},
                                    max_tokens=200, temperature=0)
    if r.choices[0].finish_reason == "stop":     # a random model may write past max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("field, value, check", [
    ("structured_outputs", {"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ("structured_outputs", {"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ("structured_outputs", {"grammar": 'start: "go " DIR\nDIR: "left" | "right"'},
     lambda t: t in ("go left", "go right")),
    ("structured_outputs", {"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ("guided_regex", r"[0-9]{3}-[a-z]{2}", lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
    ("guided_choice", ["red", "green"], lambda t: t in ("red", "green")),
    ("guided_grammar", 'root ::= "go " ("left" | "right")', lambda t: t in ("go left", "go right")),   # GBNF
    ("guided_json", SCHEMA, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
])
def test_completions_honour_every_spelling(client, field, value, check):
    body = {"prompt": "x", "max_tokens": 120, "temperature": 0.9, "seed": 5, "n": 2, field: value}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop" and check(choice["text"]), choice
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [e for e in sse_events(s.iter_lines()) if isinstance(e, dict)]
    texts = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert texts == {c["index"]: c["text"] for c in r.json()["choices"]}


def test_a_bad_schema_is_a_400_before_a_stream_begins(client):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "stream": True, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "string", "format": "no-such-format"}}}}}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "response_format" and "no-such-format" in err["message"]
