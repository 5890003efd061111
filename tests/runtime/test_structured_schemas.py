"""Structured outputs on the real SmolLM2-135M-Instruct: the schema corpus of structured_schemas.py (66 JSON schemas
of real-world shape), greedy and sampled, every answer parsed and validated with jsonschema (formats included);
regex, choice and grammar constraints; and the errors of constraints llguidance cannot enforce.

Each pass is one `llm.chat` call with every conversation in it (continuous batching: the masks of a step's
constrained rows are filled together). The model sees only the prompt, not the schema: the grammar alone makes the
answer valid.
"""
from __future__ import annotations

import json
import re

import pytest

from engine.builder.build import build_engine
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.core.errors import EngineError
from engine.runtime import LLM, SamplingParams
from engine.runtime.structured import GrammarBackend, StructuredOutputs
from engine.runtime.tokenizer import Tokenizer
from tests.runtime.structured_schemas import CASES, REFUSED, problem

MAX_TOKENS = 768     # the corpus's greedy answers take 38-600 tokens on SmolLM2
SEED = 1000          # the sampled pass's seeds are SEED + the case's index


@pytest.fixture(scope="module")
def grammars(smollm2_hf_dir) -> GrammarBackend:
    """llguidance on SmolLM2's tokenizer, no engine."""
    tok = Tokenizer(smollm2_hf_dir)
    return GrammarBackend(tok, tok.vocab_size, [tok.eos_token_id])


@pytest.fixture(scope="module")
def llm(smollm2_checkpoint, tmp_path_factory):
    engine = tmp_path_factory.mktemp("smollm2_structured") / "engine"
    build = BuildConfig(max_batch_size=64, max_input_len=256, max_seq_len=1024, max_num_tokens=1024)
    build_engine(smollm2_checkpoint, engine, build, PluginConfig())
    llm = LLM(engine, max_kv_tokens=64 * 640)
    yield llm
    llm.close()


def test_the_corpus_is_valid_json_schema_that_llguidance_enforces(grammars):
    import jsonschema
    assert len(CASES) >= 55
    for case in CASES:
        jsonschema.Draft202012Validator.check_schema(case.schema)
        grammars.matcher(StructuredOutputs(json=case.schema))   # raises EngineError on a warning or error


@pytest.mark.parametrize("feature", sorted(REFUSED))
def test_features_llguidance_cannot_enforce_are_refused(grammars, feature):
    """The corpus leaves these out; when a llguidance upgrade starts enforcing one, this fails: add it to the
    corpus."""
    with pytest.raises(EngineError, match="cannot be enforced") as e:
        grammars.matcher(StructuredOutputs(json=REFUSED[feature]))
    assert e.value.usage


def test_json_whitespace_is_bounded(grammars, smollm2_hf_dir):
    """Between two JSON tokens a matcher allows a bounded run of whitespace. llguidance's default allows any run
    (r"[\x20\x0A\x0D\x09]+"), and a model that wants to end where the schema wants more, or is unsure what comes
    next, writes whitespace to the token limit: greedy SmolLM2 on 2 of the corpus's 66 schemas, Qwen2.5-Coder-0.5B
    on 8. A bounded default in spec.py's JSON grammars, e.g. LLMatcher.grammar_from_json_schema(schema,
    defaults={"whitespace_pattern": r"[\x20\x0A\x0D\x09]{1,20}"}) (a schema's own x-guidance still wins),
    makes both pass (SmolLM2 66/66, the 0.5B 65/66)."""
    tok = Tokenizer(smollm2_hf_dir)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    m = grammars.matcher(StructuredOutputs(json=schema))
    assert m.consume_tokens(tok.encode('{"a":', add_special_tokens=False))
    newline = tok.encode("\n", add_special_tokens=False)
    accepted = 0
    while accepted < 200 and m.consume_tokens(newline):
        accepted += 1
    assert accepted < 64, f"{accepted} newlines in a row were allowed after a key"


def _corpus_outputs(llm, temperature: float) -> list[tuple]:
    conversations = [[{"role": "user", "content": c.prompt}] for c in CASES]
    params = [SamplingParams(temperature=temperature, seed=SEED + i, max_tokens=MAX_TOKENS,
                             structured_outputs={"json": c.schema}) for i, c in enumerate(CASES)]
    return list(zip(CASES, llm.chat(conversations, params)))


def _report(failures: list[tuple]) -> str:
    lines = [f"{c.name}: {why} ({len(o.token_ids)} tokens): {o.text[:300]!r}" for c, o, why in failures]
    return f"{len(failures)} of {len(CASES)} answers failed:\n" + "\n".join(lines)


@pytest.mark.slow
def test_greedy_answers_to_every_schema_stop_and_validate(llm):
    failures = []
    for case, out in _corpus_outputs(llm, 0.0):
        why = f"finish_reason {out.finish_reason}" if out.finish_reason != "stop" else problem(case, out.text)
        if why:
            failures.append((case, out, why))
    if failures:
        pytest.fail(_report(failures), pytrace=False)


@pytest.mark.slow
def test_sampled_answers_validate(llm):
    """Temperature 0.8, seeded. Every answer that stopped is valid. The grammar cannot bound a number's digits,
    so a sampled answer may, rarely, run to max_tokens inside one (seed 0 did on geojson_point's longitude); at
    most two may end so, and what they wrote is still a prefix the grammar allowed."""
    failures, lengths = [], []
    for case, out in _corpus_outputs(llm, 0.8):
        if out.finish_reason == "length":
            lengths.append(case.name)
            m = llm.grammars.matcher(StructuredOutputs(json=case.schema))
            if not m.consume_tokens(out.token_ids):
                failures.append((case, out, "the grammar refuses the tokens"))
        elif out.finish_reason != "stop":
            failures.append((case, out, f"finish_reason {out.finish_reason}"))
        elif why := problem(case, out.text):
            failures.append((case, out, why))
    if failures:
        pytest.fail(_report(failures), pytrace=False)
    assert len(lengths) <= 2, f"ran to max_tokens: {lengths}"


DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
REGEXES = {
    "Give me a phone number in the format (555) 123-4567.": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "When did the Berlin Wall fall? Answer with a date.": DATE,
    "Pick a hex color for a sunset.": r"#[0-9a-f]{6}",
    "Is the sky blue? Answer and explain briefly.": r"(Yes|No), because [a-z ,]{5,60}\.",
}
CHOICES = {
    "What is the sentiment of 'I loved this movie'?": ["positive", "negative", "neutral"],
    "Which city is in India?": ["New York", "New Delhi", "Newcastle"],   # a shared prefix across tokens
    "Is 7 a prime number?": ["yes", "no"],
}
SQL = ('start: "SELECT " cols " FROM " NAME where ";"\n'
       'cols: NAME | NAME ", " NAME | NAME ", " NAME ", " NAME\n'
       'where: "" | " WHERE " NAME " = " NUMBER\n'
       'NAME: /[a-z_]{1,12}/\n'
       'NUMBER: /[0-9]{1,4}/\n')
SQL_RE = r"SELECT [a-z_]{1,12}(, [a-z_]{1,12}){0,2} FROM [a-z_]{1,12}( WHERE [a-z_]{1,12} = [0-9]{1,4})?;"
GBNF = 'root ::= "The answer is " [0-9] [0-9]? [0-9]? "."'
GRAMMARS = {
    "Write a SQL query that lists the names of users older than 30.": (SQL, SQL_RE),
    "What is 6 times 7?": (GBNF, r"The answer is [0-9]{1,3}\."),
}


@pytest.mark.slow
def test_regex_choice_and_grammar_outputs_match(llm):
    requests = ([(q, {"regex": r}, lambda t, r=r: re.fullmatch(r, t)) for q, r in REGEXES.items()]
                + [(q, {"choice": c}, lambda t, c=c: t in c) for q, c in CHOICES.items()]
                + [(q, {"grammar": g}, lambda t, r=r: re.fullmatch(r, t)) for q, (g, r) in GRAMMARS.items()])
    conversations, params, checks = [], [], []
    for temperature in (0.0, 0.8):
        for i, (question, so, check) in enumerate(requests):
            conversations.append([{"role": "user", "content": question}])
            params.append(SamplingParams(temperature=temperature, seed=i, max_tokens=64, structured_outputs=so))
            checks.append((question, temperature, check))
    bad = []
    for (question, temperature, check), out in zip(checks, llm.chat(conversations, params)):
        if out.finish_reason != "stop" or not check(out.text):
            bad.append(f"{question!r} at {temperature}: {out.finish_reason} {out.text!r}")
    assert not bad, "\n".join(bad)


INVALID = [
    ({"json": {"type": "object", "properties": {"a": {"type": "strng"}}}}, "Invalid type: strng"),
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}, "/[$]defs/missing"),
    ({"json": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum .5. is greater than maximum .1."),
    ({"json": {"type": "string", "pattern": "[a-z"}}, "unclosed character class"),
    ({"json": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}, "uniqueItems"),
    ({"json": '{"type": '}, "not valid JSON"),
    ({"regex": "[a-z"}, "unclosed character class"),
    ({"regex": "(?=a)b"}, "look-around"),
    ({"grammar": "start: foo\n"}, 'unknown name: "foo"'),
    ({"grammar": "start: /[a-/\n"}, "unclosed character class"),
    ({"choice": []}, "choice is empty"),
]


@pytest.mark.slow
@pytest.mark.parametrize("so,message", INVALID, ids=[f"{next(iter(so))}-{i}" for i, (so, _) in enumerate(INVALID)])
def test_an_invalid_constraint_raises_naming_the_problem(llm, so, message):
    with pytest.raises(EngineError, match="invalid structured output") as e:
        llm.chat([{"role": "user", "content": "Hi"}],
                 SamplingParams(temperature=0, max_tokens=8, structured_outputs=so))
    assert e.value.usage and re.search(message, str(e.value)), str(e.value)
    assert llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=2))[0].token_ids


def test_the_validator_catches_what_the_grammar_would_not_allow():
    """problem() is the oracle of the tests above: it must reject a wrong type, a bad format and a bad enum."""
    case = next(c for c in CASES if c.name == "calendar_event")
    good = {"title": "Standup", "start": "2026-01-05T09:00:00Z", "end": "2026-01-05T09:15:00+01:00",
            "location": None, "attendees": ["ann@example.com"], "all_day": False}
    assert problem(case, json.dumps(good)) is None
    for key, value in (("start", "2026-01-05 9am"), ("attendees", ["not an email"]), ("all_day", "no"),
                       ("title", "x" * 61), ("end", "2026-13-05T09:15:00Z")):
        assert problem(case, json.dumps({**good, key: value})) is not None, key
    assert problem(case, json.dumps({**good, "extra": 1})) is not None
    assert problem(case, '{"title": ') is not None
