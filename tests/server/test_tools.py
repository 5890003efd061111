"""Tool calling (tools.py): Hermes calls parsed out of text, whole or in deltas cut anywhere; tool_choice required
and named functions constrain a random model to calls that validate, through the official openai client; tool
results render back through the template; and every impossible combination is a 400 naming the field."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from engine.runtime.server.tools import ToolStream, parse_tool_calls
from tests.runtime.tiny_engine import build_tiny_engine
from tests.server.conftest import MODEL, SERVER_BUILD, RunningServer
from tests.tiny_models import CHAT_TEMPLATE

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10},
                                           "top": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
CHAT = [{"role": "user", "content": "weather in Oslo?"}]

TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "<b>x</b>"}}\n</tool_call>')


def _names_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_calls_are_parsed_out_of_the_text():
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me look."
    assert _names_args(calls) == [("get_weather", {"city": "Oslo", "unit": "celsius"}),
                                  ("search", {"query": "<b>x</b>"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    broken = '<tool_call>\n{"name": "f", "arguments": {\n</tool_call>'
    assert parse_tool_calls(broken) == (broken, [])          # not a call: kept as content, never dropped
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>')[1][0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 11, 64])
def test_streamed_deltas_cut_anywhere_give_the_same_content_and_calls(cut):
    ts = ToolStream()
    pieces = [TEXT[i:i + cut] for i in range(0, len(TEXT), cut)]
    content, calls = "", []
    for k, piece in enumerate(pieces):
        text, new = ts.feed(piece, final=k == len(pieces) - 1)
        content += text
        calls += new
    assert content.strip() == "Let me look."
    assert [c["index"] for c in calls] == [0, 1]
    assert _names_args(calls) == _names_args(parse_tool_calls(TEXT)[1])


def test_a_partial_tag_is_held_back_and_released_when_it_is_not_a_call():
    ts = ToolStream()
    assert ts.feed("a <tool_") == ("a ", [])
    assert ts.feed("box> b") == ("<tool_box> b", [])
    assert ts.feed("<tool_call>{", final=True) == ("<tool_call>{", [])   # unterminated at the end: content


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny engine with a template that renders tools (names only: its tokenizer spends many tokens on the
    words a template without tools gets in a system message, over its 256-token context), and room for a
    conversation with a call and its result."""
    engine = build_tiny_engine(tmp_path_factory.mktemp("tools"), **{**SERVER_BUILD, "max_input_len": 192})[1]
    (engine / "chat_template.jinja").write_text(
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n"
        "{% endif %}" + CHAT_TEMPLATE)
    s = RunningServer(engine)
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_required_and_named_calls_always_validate(oai, server, choice):
    for seed in range(4):
        r = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=choice,
                                        temperature=1.0, seed=seed, max_tokens=200)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0]
        if isinstance(choice, dict):
            assert call.function.name == "search"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        stream = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=choice,
                                             temperature=1.0, seed=seed, max_tokens=200, stream=True)
        deltas = [ch.choices[0] for ch in stream if ch.choices]
        streamed = [t for d in deltas for t in (d.delta.tool_calls or [])]
        assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == \
            [(0, call.function.name, call.function.arguments)]
        assert deltas[-1].finish_reason == "tool_calls"
        assert "".join(d.delta.content or "" for d in deltas) == ""
    server.wait_all_free()


def test_parallel_calls_when_asked(oai):
    r = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=True, temperature=1.0, seed=1, max_tokens=200)
    c = r.choices[0]
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert c.message.tool_calls


def test_a_tool_result_renders_back_and_auto_without_a_call_is_content(oai):
    first = oai.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                        temperature=0, max_tokens=200).choices[0].message
    messages = CHAT + [first.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"temp": 3}'}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=8)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    if not c.message.tool_calls:
        assert c.message.content is not None


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
      "tool_choice": "required"}, "tools"),
    ({"messages": CHAT + [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}]}, "messages[1].tool_calls[0].function.arguments"),
])
def test_impossible_tool_requests_are_400_naming_the_field(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_tool_choice_none_and_auto_without_tools_are_plain_chat(client):
    for extra in ({"tool_choice": "none", "tools": TOOLS}, {"tool_choice": "auto"}, {"tools": []}):
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["tool_calls"] == []
