"""The OpenAI API's request bodies (pydantic), their checks, and their translation into SamplingParams.

Owns what a client may send and what it means; knows nothing of HTTP, the engine or responses (completions.py).
Every field is either honoured or refused: bodies forbid unknown fields (400 naming the field), and fields
OpenAI defines that this server cannot honour are accepted only at their harmless values:
  - user, metadata, safety_identifier, prompt_cache_key: accepted and ignored (bookkeeping for OpenAI's side;
    prefix caching needs no key), service_tier "auto" / "default", store false, best_of equal to n (vLLM's
    benchmark sends best_of=1), logit_bias {}.
Output constraints (response_format, structured_outputs, guided_*) are structured_fields.py's; tools and
tool_choice are tools.py's.
  - suffix, echo with logprobs (needs prompt logprobs, which the engine does not compute), non-text content
    parts, and anything else: 400.
Extensions in vLLM's spelling: top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, priority, add_generation_prompt, chat_template_kwargs; `model`
may be left out (the served model). With n > 1 and a seed, choice j samples with seed + j so choices differ
(seeds are taken modulo 2**64: OpenAI allows negative ones, numpy's generators do not).
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from ..sampling_params import MAX_LOGPROBS, SamplingParams
from .api_errors import APIError, bad_param, internal_error  # noqa: F401 - the server's modules import them here
from .structured_fields import ResponseFormat, StructuredOutputsBody, structured_spec
from .tools import NamedToolChoice, ToolDef, check_tools, tool_constraint


def lone_surrogate(value, path: str = "") -> tuple[str, tuple[int, int]] | None:
    """(field path like messages[0].content, (position, code point)) of the first lone surrogate in parsed JSON,
    in a string or a key; None when all of it is Unicode text."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, (e.start, ord(value[e.start]))
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and lone_surrogate(key) is not None:
                return path or "body", lone_surrogate(key)[1]
            if (found := lone_surrogate(item, inner)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := lone_surrogate(item, f"{path}[{i}]")) is not None:
                return found
    return None


class _Body(BaseModel):
    # JSON parsed by Python accepts NaN and Infinity; no sampling parameter means anything with them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data):
        # JSON may escape a lone surrogate ("\ud800"): Python keeps it, but no tokenizer or response can encode it.
        where = lone_surrogate(data)
        if where is not None:
            path, at = where
            raise bad_param(path, f"{path}: the text holds a lone UTF-16 surrogate (\\u{at[1]:04x} at character "
                            f"{at[0]}), which is not Unicode; send a valid escape pair or the character itself")
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)           # 0 = greedy; OpenAI's default 1
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)                  # vLLM: -1 or 0 = off
    min_p: Optional[float] = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    priority: int = 0
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Harmless OpenAI fields (see the module docstring).
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    service_tier: Optional[Literal["auto", "default"]] = None
    store: Optional[Literal[False]] = None
    logit_bias: Optional[dict[str, float]] = None
    # Constraints on the output (structured_fields.py): OpenAI's, vLLM's, and vLLM's older names.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsBody] = None
    guided_json: Optional[Union[dict[str, Any], bool, str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    _structured: Any = PrivateAttr(None)
    _structured_field: Optional[str] = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise bad_param("stream_options", "stream_options is only allowed when stream is true")
        if self.logit_bias:
            raise bad_param("logit_bias", "logit_bias is not supported by this server; leave it out")
        if isinstance(self.stop, list) and any(s == "" for s in self.stop) or self.stop == "":
            raise bad_param("stop", "stop strings must be non-empty")
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise bad_param("stop_token_ids", "stop_token_ids must be >= 0")
        self._structured, self._structured_field = structured_spec(self)
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def structured(self):
        """(StructuredOutputs or None, the request field it came from)."""
        return self._structured, self._structured_field

    def sampling_params(self, max_tokens: int, *, logprobs: int | None, choice: int = 0) -> SamplingParams:
        """SamplingParams of choice `choice` (0-based) of this request; raises EngineError on bad combinations."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0), min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=None if self.seed is None else (self.seed + choice) % 2**64,   # numpy wants seeds >= 0
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop_list,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, structured_outputs=self._structured)


PromptInput = Union[str, list[int], list[str], list[list[int]]]


class CompletionRequest(_SamplingBody):
    prompt: PromptInput
    max_tokens: Optional[int] = Field(16, ge=1)              # OpenAI's default for completions
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.best_of is not None and self.best_of != self.n:
            raise bad_param("best_of", f"best_of {self.best_of} is not supported (only best_of == n); leave it out")
        if self.suffix:
            raise bad_param("suffix", "suffix (insertion) is not supported by this server; leave it out")
        if self.echo and self.logprobs is not None:
            raise bad_param("logprobs", "echo with logprobs needs prompt logprobs, which this server does not "
                            "compute")
        if isinstance(self.prompt, list) and (not self.prompt or any(len(p) == 0 for p in self.prompt
                                                                     if isinstance(p, (str, list)))):
            raise bad_param("prompt", "prompt must not be empty")
        return self

    @property
    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts of this request: one for a string or a token-id list, several for a list of those."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, tool_call_id) go to the chat template as they are.
    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[ContentPart]]] = None

    def as_template_dict(self, index: int) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    raise APIError(f"content part of type {part.type!r} is not supported; this model reads text "
                                   "only (type 'text')", param=f"messages[{index}].content[{j}].type",
                                   code="invalid_value")
            d["content"] = "\n".join(part.text for part in self.content)
        for j, call in enumerate(d.get("tool_calls") or []):
            # OpenAI sends arguments as a JSON string; templates (Qwen2.5's) write them with tojson, as an object
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except ValueError:
                    raise APIError("the arguments of a tool call must be a JSON object's text",
                                   param=f"messages[{index}].tool_calls[{j}].function.arguments",
                                   code="invalid_value") from None
        return d


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[ToolDef]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[bool] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_param("top_logprobs", "top_logprobs needs logprobs set to true")
        check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self.tool_mode != "none" and self._structured is not None:
            raise bad_param(self._structured_field, f"{self._structured_field} and tools each shape the output; "
                            "give only one (or tool_choice 'none')")
        return self

    @property
    def tool_mode(self) -> str:
        """none (no tools, or tool_choice none), auto (the default with tools), required, or named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def constrain_to_tool_calls(self, special_tags: bool) -> None:
        """With tool_choice required or a named function, constrain the output to calls (tools.py)."""
        if self.tool_mode in ("required", "named"):
            self._structured = tool_constraint(self.tools, self.tool_choice, self.parallel_tool_calls is True,
                                               special_tags)
            self._structured_field = "tools"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_dict(i) for i, m in enumerate(self.messages)]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template, None when it renders none (tool_choice none)."""
        if self.tool_mode == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise bad_param("prompt", "give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[int]


class LoadLoraAdapterRequest(_Body):      # vLLM's POST /v1/load_lora_adapter
    lora_name: str
    lora_path: str
    base_model_name: Optional[str] = None


class UnloadLoraAdapterRequest(_Body):    # vLLM's POST /v1/unload_lora_adapter
    lora_name: str


def validation_error(errors: list[dict]) -> APIError:
    """A 400 from pydantic's errors (FastAPI's RequestValidationError), naming the first bad field."""
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
    # Union members add their type name to the location (prompt.str, prompt.list[int]); keep the field path.
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")]
    param = ".".join(loc) or None
    kind = e.get("type", "")
    if kind == "extra_forbidden":
        msg = f"unsupported field {param!r}: this server cannot honour it; remove it"
    elif kind == "json_invalid":
        msg, param = f"the body is not valid JSON: {e.get('msg')}", None
    elif kind == "missing":
        msg = f"{param!r} is a required field" if param else "the request has no body; send a JSON object"
    else:
        msg = e.get("msg", "invalid value").removeprefix("Value error, ")
        if param:
            msg = f"{param}: {msg}"
    return APIError(msg, param=param, code="invalid_value" if kind != "extra_forbidden" else "unsupported_field")
