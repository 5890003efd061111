"""The request fields that constrain the output, in OpenAI's and vLLM's spellings, to one StructuredOutputs.

    response_format  {"type": "text"} (no constraint), {"type": "json_object"},
                     {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
    structured_outputs  vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older names, honoured as aliases

A request gives at most one of them; any key inside them this server does not honour is refused by the body
models (extra="forbid"), never dropped. Whether llguidance can enforce the constraint is checked later, against
the engine's tokenizer (completions.py), so that a bad schema is a 400 before any response begins.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from engine.core.errors import EngineError

from ..structured import StructuredOutputs
from .api_errors import bad_param

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    json_schema: Union[dict[str, Any], bool] = Field(alias="schema")
    strict: Optional[bool] = None        # the schema is enforced either way


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsBody(_Strict):
    json_: Optional[Union[dict[str, Any], bool, str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


def structured_spec(body) -> tuple[StructuredOutputs | None, str | None]:
    """(the constraint of a parsed request body, the field it came from); APIError naming the field when two
    are given or one is malformed."""
    given = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_schema" and rf.json_schema is None:
            raise bad_param("response_format", "response_format of type 'json_schema' needs a 'json_schema' "
                            "object with 'name' and 'schema'")
        if rf.type == "json_object" and rf.json_schema is not None:
            raise bad_param("response_format", "response_format of type 'json_object' takes no 'json_schema'; "
                            "use type 'json_schema'")
        given.append(("response_format", {"json": rf.json_schema.json_schema} if rf.type == "json_schema"
                      else {"json_object": True}))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", body.structured_outputs.model_dump(by_alias=True, exclude_none=True)))
    for name, kind in GUIDED.items():
        if getattr(body, name) is not None:
            given.append((name, {kind: getattr(body, name)}))
    if not given:
        return None, None
    if len(given) > 1:
        names = [n for n, _ in given]
        raise bad_param(names[1], f"{' and '.join(names)} each constrain the output; give only one")
    name, value = given[0]
    if value.get("json_object") is False:
        value.pop("json_object")
    try:
        return StructuredOutputs(**value), name
    except EngineError as e:
        raise bad_param(name, f"{name}: {str(e).removeprefix('invalid structured output: ')}") from None

