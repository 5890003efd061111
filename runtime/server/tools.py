"""OpenAI tool calling: the `tools` a chat request offers, the constraint `tool_choice` puts on the output, and the
tool calls parsed out of the model's text.

Calls are written in the Hermes format that Qwen2.5's chat template teaches its models (and many others use):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

  tool_choice "auto"      the template renders the tools; whatever calls the model writes are parsed out
  tool_choice "required"  the output is constrained (llguidance) to one such call (several with
                          parallel_tool_calls true), an object whose name is one of the tools and whose arguments
                          validate against that tool's parameters; one by default, as small models otherwise
                          repeat calls until max_tokens
  named function          the same, with that one tool and one call
  tool_choice "none"      the tools are not rendered and nothing is parsed
A template that does not render tools (SmolLM2's) gets them in a system message in the same words Qwen2.5's uses.
The parser works on the whole text (a response) or on deltas (a stream, ToolStream): text that may start a call
is held back until it is one, and each call goes out whole when its closing tag arrives.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..structured import StructuredOutputs
from .api_errors import bad_param

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None        # the schema is enforced either way when the call is constrained


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


def check_tools(tools: list[ToolDef] | None, choice, parallel: bool | None) -> None:
    """A 400 for a tool_choice that cannot be honoured with these tools."""
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise bad_param("tools", f"tool names must be unique; {sorted({n for n in names if names.count(n) > 1})} "
                        "repeat")
    if choice == "required" and not names:
        raise bad_param("tool_choice", "tool_choice 'required' needs at least one tool in 'tools'")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_param("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not among "
                        f"the tools ({', '.join(names) or 'none given'})")


def tool_constraint(tools: list[ToolDef], choice, parallel: bool, special_tags: bool) -> StructuredOutputs:
    """The grammar of the calls tool_choice `choice` ("required" or a NamedToolChoice) allows: Hermes calls
    whose JSON is one of the tools with valid arguments; several in a row when `parallel`. `special_tags`: the
    tokenizer has <tool_call> as a token of its own (Qwen2.5), which the grammar must name as such."""
    if isinstance(choice, NamedToolChoice):
        tools, parallel = [t for t in tools if t.function.name == choice.function.name], False
    schema = {"anyOf": [{"type": "object", "properties": {
        "name": {"const": t.function.name}, "arguments": t.function.parameters or EMPTY_PARAMETERS},
        "required": ["name", "arguments"], "additionalProperties": False} for t in tools],
        # compact, as the template writes calls (tojson): fewer tokens, and the text the model was trained on
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    open_tag, close_tag = (OPEN, CLOSE) if special_tags else (json.dumps(OPEN), json.dumps(CLOSE))
    newline = json.dumps("\n")
    start = f"start: call ({newline} call)*" if parallel else "start: call"
    call = f"call: {open_tag} {newline} %json {json.dumps(schema)} {newline} {close_tag}"
    return StructuredOutputs(grammar=f"{start}\n{call}\n")


def tools_system_prompt(tools: list[ToolDef]) -> str:
    """The tools in Qwen2.5's template's words, for a template that does not render them."""
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
            f"function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function "
            "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
            "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def with_tools_in_system(messages: list[dict], tools: list[ToolDef]) -> list[dict]:
    """`messages` with the tools described in their system message (one is added first when there is none)."""
    prompt = tools_system_prompt(tools)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _call_of(body: str) -> dict | None:
    """The OpenAI tool call of one Hermes call's JSON text, or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(the content left around the calls, or None when there is none; the tool calls) of a whole output. A call
    whose JSON does not parse stays in the content."""
    calls, content, pos = [], [], 0
    for m in _CALL.finditer(text):
        call = _call_of(m.group(1))
        if call is None:
            continue
        content.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    content.append(text[pos:])
    rest = "".join(content).strip() if calls else text
    return (rest or None), calls


class ToolStream:
    """Deltas of one streamed choice -> content deltas and whole tool calls, as they become certain."""

    def __init__(self):
        self.held = ""
        self.num_calls = 0
        self.released = 0    # characters of the model's text the last feed() sent on, as content or calls

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        """(content to send now, calls completed by this delta); `final` flushes what is held."""
        text, self.held = self.held + delta, ""
        before = len(text)
        out, calls = [], []
        while text:
            start = text.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(text, OPEN)
                out.append(text[:len(text) - keep])
                self.held = text[len(text) - keep:]
                break
            out.append(text[:start])
            end = text.find(CLOSE, start)
            if end < 0:
                if final:
                    out.append(text[start:])
                else:
                    self.held = text[start:]
                break
            call = _call_of(text[start + len(OPEN):end].strip())
            if call is None:
                out.append(text[start:end + len(CLOSE)])
            else:
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
            text = text[end + len(CLOSE):]
        self.released = before - len(self.held)
        content = "".join(out)
        if self.num_calls and not content.strip():
            content = ""
        return content, calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (it may become the tag with the next delta)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
