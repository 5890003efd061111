"""The real SmolLM2-135M-Instruct behind the server, driven by the official openai client."""
from __future__ import annotations

import openai
import pytest

from engine.builder.build import build_engine
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.runtime import LLM
from tests.server.conftest import MODEL, RunningServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_server(smollm2_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2_server")
    build = BuildConfig(max_batch_size=4, max_input_len=384, max_seq_len=512, max_num_tokens=256)
    build_engine(smollm2_checkpoint, root / "engine", build, PluginConfig())
    s = RunningServer(root / "engine", load=lambda: LLM(root / "engine", max_kv_tokens=4 * 512))
    s.wait_ready(timeout=120)
    yield s
    s.stop()


def test_openai_client_chat_answers_the_capital_of_france(smollm2_server):
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens < 24
    streamed = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        chat.choices[0].message.content
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert "Paris" in comp.choices[0].text
    smollm2_server.wait_all_free()


TOOL_SETS = [
    [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                       "parameters": {"type": "object", "properties": {
                                           "city": {"type": "string", "maxLength": 40},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                           "required": ["city", "unit"], "additionalProperties": False}}},
     {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount",
                                       "parameters": {"type": "object", "properties": {
                                           "amount": {"type": "number", "minimum": 0},
                                           "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                           "to": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                                           "required": ["amount", "from", "to"], "additionalProperties": False}}}],
    [{"type": "function", "function": {"name": "create_event", "description": "Add a calendar event",
                                       "parameters": {"type": "object", "properties": {
                                           "title": {"type": "string", "maxLength": 60},
                                           "date": {"type": "string", "format": "date"},
                                           "attendees": {"type": "array", "maxItems": 4, "items": {
                                               "type": "string", "format": "email", "maxLength": 40}}},
                                           "required": ["title", "date"], "additionalProperties": False}}}],
]
ASKS = ["What's the weather like in Lisbon, in celsius?", "How much is 250 US dollars in euros?",
        "Put a meeting with ana@example.com on 2025-03-14 titled Planning.", "Schedule lunch tomorrow."]


def test_required_tool_calls_always_parse_and_validate(smollm2_server):
    import json

    import jsonschema
    client = openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    checker = jsonschema.FormatChecker()
    for tools in TOOL_SETS:
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        for ask in ASKS:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ask}],
                                               tools=tools, tool_choice="required", temperature=0)
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c.message.content
            call = c.message.tool_calls[0].function
            jsonschema.validate(json.loads(call.arguments), schemas[call.name], format_checker=checker)
    smollm2_server.wait_all_free()
