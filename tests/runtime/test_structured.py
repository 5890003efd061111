"""Structured outputs (runtime/structured/) on the tiny Llama engine: a random model's output always obeys its
constraint, and constraining keeps the runtime's invariances (batched == single, speculative == plain, preempted
== unpreempted, resumed == uninterrupted). The sampler's masking is checked against a plain reference."""
import json
import re

import numpy as np
import pytest

from engine.core.errors import EngineError
from engine.runtime import LLM, SamplingParams
from engine.runtime.sampler import SamplingRow, sample
from engine.runtime.sequence_state import SequenceState
from engine.runtime.speculative import verify
from engine.runtime.structured import StructuredOutputs

COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["ab", "cd"]}, "ok": {"type": "boolean"}},
          "required": ["n", "tag", "ok"], "additionalProperties": False, "x-guidance": COMPACT}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'start: "x" ("+" "x")* "=" NUM\nNUM: /[0-9]{1,2}/'
CONSTRAINTS = [{"json": SCHEMA}, {"regex": REGEX}, {"choice": CHOICES}, {"grammar": GRAMMAR}, {"json_object": True}]


def obeys(text: str, constraint: dict) -> bool:
    if "json" in constraint:
        obj = json.loads(text)
        return set(obj) == {"n", "tag", "ok"} and 0 <= obj["n"] <= 99 and obj["tag"] in ("ab", "cd")
    if "regex" in constraint:
        return re.fullmatch(REGEX, text) is not None
    if "choice" in constraint:
        return text in CHOICES
    if "grammar" in constraint:
        return re.fullmatch(r"x(\+x)*=[0-9]{1,2}", text) is not None
    return isinstance(json.loads(text), dict)


PROMPTS = [[5, 17, 99, 3], [44, 45, 46, 47, 48, 49], [200, 7], [9, 9, 9, 9, 9, 9, 9, 9]]


@pytest.fixture(scope="module")
def llm(tiny_engine):
    llm = LLM(tiny_engine[1], max_kv_tokens=8 * 64)
    yield llm
    llm.close()


def params(constraint, **kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 40, **kw}, structured_outputs=constraint)


@pytest.mark.parametrize("constraint", CONSTRAINTS[:4], ids=["json", "regex", "choice", "grammar"])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_every_output_obeys_its_constraint(llm, constraint, temperature):
    outs = llm.generate(PROMPTS, [params(constraint, temperature=temperature, seed=i) for i in range(len(PROMPTS))])
    for o in outs:
        assert o.finish_reason == "stop" and obeys(o.text, constraint), (o.text, o.finish_reason)
    llm.check_all_free()


def test_any_json_object_is_valid_json_when_it_ends(llm):
    # a random model may write a long object; whatever ended by itself parses
    outs = llm.generate(PROMPTS, params({"json_object": True}, temperature=1.0, seed=3))
    assert any(o.finish_reason == "stop" for o in outs)
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict), o.text


def test_batched_equals_single_and_mixes_with_unconstrained(llm):
    ps = [params(c, temperature=0.8, seed=7) for c in CONSTRAINTS[:4]] + [SamplingParams(temperature=0,
                                                                                       max_tokens=12)]
    prompts = PROMPTS + [PROMPTS[0]]
    batched = llm.generate(prompts, ps)
    single = [llm.generate([p], sp)[0] for p, sp in zip(prompts, ps)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]


def test_a_constrained_request_ends_when_its_grammar_is_complete(llm):
    out = llm.generate([PROMPTS[0]], params({"choice": ["only"]}, max_tokens=30))[0]
    assert out.text == "only" and out.finish_reason == "stop" and len(out.token_ids) < 30


def test_speculative_decoding_gives_the_same_constrained_tokens(llm, tiny_engine):
    spec = LLM(tiny_engine[1], max_kv_tokens=8 * 64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "max_batch_size": 8, "verify_cost": 0})
    try:
        for temperature in (0, 0.9):
            ps = [params(c, temperature=temperature, seed=i) for i, c in enumerate(CONSTRAINTS[:4])]
            got = spec.generate(PROMPTS, ps)
            for o, c in zip(got, CONSTRAINTS):
                assert o.finish_reason == "stop" and obeys(o.text, c), o.text
            if temperature == 0:
                assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(PROMPTS, ps)]
        assert spec.core.speculator.stats.num_drafts > 0
        spec.check_all_free()
    finally:
        spec.close()


def test_preemption_keeps_the_grammar_state(llm, tiny_engine):
    small = LLM(tiny_engine[1], max_kv_tokens=64)   # one max_seq_len request: six long ones preempt each other
    try:
        prompts = [list(range(10 + i, 30 + i)) for i in range(6)]
        ps = [params({"regex": "[a-z]{25,30}"} if i % 2 else {"json": SCHEMA}, temperature=0.7, seed=i)
              for i in range(6)]
        got = small.generate(prompts, ps)
        assert small.core.stats.num_preempted > 0
        assert [o.token_ids for o in got] == [o.token_ids for o in llm.generate(prompts, ps)]
        small.check_all_free()
    finally:
        small.close()


def test_a_checkpointed_constrained_sequence_resumes_to_the_same_tokens(llm, tiny_engine):
    ps = params({"json": SCHEMA}, temperature=0.9, seed=11)
    want = llm.generate([PROMPTS[1]], ps)[0]
    other = LLM(tiny_engine[1], max_kv_tokens=8 * 64)
    try:
        seq, _ = other.make_sequence(PROMPTS[1], ps, request_id="r")
        other.core.add_request(seq)
        for _ in range(6):
            other.core.step()
        state = SequenceState.from_json(json.loads(json.dumps(other.core.snapshot()[0].to_json())))
        assert 0 < len(state.output_token_ids) < len(want.token_ids)
        assert state.params.structured_outputs == StructuredOutputs(json=SCHEMA)
        other.core.abort("r")

        async def resume():
            return [o async for o in llm.resume_async(state)][-1]
        import asyncio
        assert asyncio.run(resume()).token_ids == want.token_ids
    finally:
        other.close()


@pytest.mark.parametrize("constraint, words", [
    ({"json": '{"type": "object", "properties": {"a": {"type": "no-such-type"}}}'}, "no-such-type"),
    ({"json": '{"type": "string", "format": "no-such-format"}'}, "no-such-format"),
    ({"json": "{"}, "not valid JSON"),
    ({"regex": "a(b"}, "unclosed group"),
    ({"grammar": "start: missing_rule"}, "missing_rule"),
    ({"choice": []}, "choice is empty"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"jsn": {}}, "jsn"),
])
def test_constraints_the_library_refuses_are_usage_errors_naming_the_problem(llm, constraint, words):
    with pytest.raises(EngineError, match=re.escape(words)) as e:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert e.value.usage
    llm.check_all_free()


# ---- the sampler's masking against a reference ---------------------------------------------------------------

def packed(allowed: np.ndarray) -> np.ndarray:
    return np.packbits(allowed, axis=-1, bitorder="little")


def _row(allowed, **kw):
    return SamplingRow(params=SamplingParams(**kw), prompt_token_ids=[1], output_token_ids=[],
                       generator=np.random.default_rng(0), allowed=packed(allowed))


@pytest.mark.parametrize("extra", [{}, {"logprobs": 2}, {"repetition_penalty": 1.2}])
def test_masked_greedy_is_the_argmax_over_allowed_tokens(extra):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 300)).astype(np.float32)
    allowed = rng.random((6, 300)) < 0.1
    allowed[0, np.argmax(logits[0])] = True      # the plain argmax allowed (the fast path), or not
    got = sample(logits, [_row(a, temperature=0, **extra) for a in allowed]).token_ids
    x = logits.astype(np.float64)
    if extra.get("repetition_penalty"):
        x[:, 1] = np.where(x[:, 1] > 0, x[:, 1] / 1.2, x[:, 1] * 1.2)    # the prompt's token
    want = [int(np.flatnonzero(a)[np.argmax(lg[a])]) for lg, a in zip(x, allowed)]
    assert got.tolist() == want


def test_sampling_never_draws_a_disallowed_token_and_keeps_the_allowed_proportions():
    logits = np.zeros((1, 50), dtype=np.float32)
    logits[0, [3, 4]] = [0.0, np.log(3.0)]
    logits[0, 10] = 20.0                   # most likely, but not allowed
    allowed = np.zeros(50, dtype=bool)
    allowed[[3, 4]] = True
    row = _row(allowed, temperature=1.0, seed=0)
    row.generator = np.random.default_rng(1)
    draws = [int(sample(logits, [row]).token_ids[0]) for _ in range(4000)]
    assert set(draws) <= {3, 4}
    assert abs(draws.count(4) / len(draws) - 0.75) < 0.03


def test_the_grammar_wins_over_a_min_tokens_ban():
    logits = np.random.default_rng(2).normal(size=(1, 20)).astype(np.float32)
    allowed = np.zeros(20, dtype=bool)
    allowed[2] = True                      # only eos may follow: a complete grammar
    row = SamplingRow(params=SamplingParams(temperature=0, min_tokens=5, max_tokens=10), prompt_token_ids=[1],
                      output_token_ids=[], generator=np.random.default_rng(0), banned_token_ids=[2],
                      allowed=packed(allowed))
    assert sample(logits, [row]).token_ids.tolist() == [2]


def test_verification_applies_each_positions_mask():
    logits = np.zeros((3, 10), dtype=np.float32)
    logits[:, 7] = 5.0                      # the model wants 7 everywhere
    allowed = np.zeros((3, 10), dtype=bool)
    allowed[0, [1, 7]] = True
    allowed[1, [2]] = True                  # after draft 7, only 2 is allowed: the draft 7 is rejected
    allowed[2, :] = True
    for temperature, seed in ((0, 0), (1e-6, 1)):        # the greedy path, and the sampling path at its limit
        row = SamplingRow(params=SamplingParams(temperature=temperature, seed=seed), prompt_token_ids=[1],
                          output_token_ids=[], generator=np.random.default_rng(seed))
        assert verify(logits, [7, 7], row, lambda n: [], packed(allowed)).token_ids == [7, 2]
