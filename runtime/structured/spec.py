"""What a constrained request asks for: one JSON schema, regex, choice list or grammar (vLLM's
StructuredOutputsParams), as plain hashable data that SamplingParams carries and the state file stores.

It only describes the constraint; compiling it against a tokenizer is backend.py's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.core.errors import EngineError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
# llguidance allows any run of whitespace between JSON tokens; a small model unsure what comes next writes newlines
# to the token limit (greedy SmolLM2 on 2 of the 66 schemas of tests/runtime/structured_schemas.py, Qwen2.5-Coder
# 0.5B on 8). A schema with its own "x-guidance" options gets none of these.
JSON_DEFAULTS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,20}"}


@dataclass(frozen=True)
class StructuredOutputs:
    json: str | None = None              # a JSON schema, as JSON text (a dict is accepted and serialised)
    json_object: bool = False            # any JSON object (OpenAI's response_format {"type": "json_object"})
    regex: str | None = None             # the whole output matches it
    choice: tuple[str, ...] | None = None   # the output is exactly one of these strings
    grammar: str | None = None           # a Lark grammar (llguidance's dialect) or llama.cpp's GBNF

    def __post_init__(self):
        if isinstance(self.json, (dict, bool)):
            object.__setattr__(self, "json", _dumps(self.json))
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                _fail(f"choice {self.choice!r:.80} must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice:
                _fail("choice is empty; give at least one string")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            _fail(f"give exactly one of {', '.join(KINDS)} (got {', '.join(given) or 'none'})")
        for k in ("json", "regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                _fail(f"{k} {v!r:.80} must be a non-empty string")
        if self.json is not None:
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                _fail(f"the JSON schema is not valid JSON ({e})")
            if not isinstance(schema, (dict, bool)):
                _fail(f"the JSON schema must be an object, got {type(schema).__name__}")

    @classmethod
    def of(cls, value: "StructuredOutputs | dict[str, Any] | None") -> "StructuredOutputs | None":
        """From a dict in vLLM's spelling (the state file's, a Python caller's) or as it is."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            _fail(f"structured outputs must be a dict or StructuredOutputs, got {type(value).__name__}")
        unknown = set(value) - set(KINDS)
        if unknown:
            _fail(f"unknown structured output fields {sorted(unknown)}; use {', '.join(KINDS)}")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint (its validity is checked when a matcher compiles it)."""
        llguidance = import_llguidance()
        try:
            if self.json is not None or self.json_object:
                schema = json.loads(self.json) if self.json is not None else {"type": "object"}
                own = isinstance(schema, dict) and "x-guidance" in schema   # its options, whitespace included
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=None if own else JSON_DEFAULTS)
            if self.regex is not None:
                return llguidance.grammar_from("regex", self.regex)
            if self.choice is not None:
                return llguidance.grammar_from("choice", _dumps(list(self.choice)))
            return llguidance.grammar_from("grammar", self.grammar)
        except ValueError as e:
            _fail(f"the {self.kind} constraint is not valid: {e}")


def import_llguidance():
    try:
        import llguidance
    except ImportError:
        raise EngineError("structured outputs need the llguidance package: pip install 'engine[structured]' (the "
                          "serve extra includes it)", usage=True) from None
    return llguidance


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _fail(message: str):
    raise EngineError(f"invalid structured output: {message}", usage=True)
