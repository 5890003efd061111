"""Checkpoint / resume of sequences (runtime/sequence_state.py): a sequence captured mid-generation and resumed by
another LLM (a restarted process) gives exactly the tokens and text of an uninterrupted run, greedy or sampled."""
from __future__ import annotations

import asyncio
import json

import pytest

from engine.core.errors import EngineError
from engine.runtime import LLM, SamplingParams
from engine.runtime.sequence_state import SequenceState

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def llms(tiny_engine):
    """Two engines on the same engine dir: the one that stops, and the one that resumes."""
    return LLM(tiny_engine[1], max_kv_tokens=512), LLM(tiny_engine[1], max_kv_tokens=512)


def capture_after(llm: LLM, params: SamplingParams, n: int, rid: str = "r"):
    """Run one request inline; after `n` generated tokens snapshot it (through JSON) and let it run on to the
    end. Returns (the state, the uninterrupted run's final output)."""
    seq, _ = llm.make_sequence(PROMPT, params, request_id=rid)
    llm.core.add_request(seq)
    state, final = None, None
    while final is None:
        for out in llm.core.step():
            final = out if out.finished else None
        if state is None and seq.num_output_tokens == n:
            (state,) = llm.core.snapshot()
    llm.check_all_free()
    return SequenceState.from_json(json.loads(json.dumps(state.to_json()))), final


def resume(llm: LLM, state: SequenceState):
    async def run():
        outs = [out async for out in llm.resume_async(state)]
        return outs
    try:
        return asyncio.run(run())
    finally:
        llm.close()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, presence_penalty=0.5, min_tokens=20),
], ids=["greedy", "seeded", "unseeded-penalties"])
def test_resumed_sequence_equals_uninterrupted_run(llms, params):
    first, second = llms
    state, ref = capture_after(first, params, 11)
    assert len(state.output_token_ids) == 11
    outs = resume(second, state)
    final = outs[-1]
    assert final.finished and final.token_ids == ref.token_ids and final.text == ref.text
    assert len(final.token_ids) == params.max_tokens
    # the first output after resuming reports only what is new, and the text grows from the captured prefix
    assert outs[0].delta_token_ids == [final.token_ids[11]]
    assert "".join(o.delta_text for o in outs) == final.text[len(outs[0].text) - len(outs[0].delta_text):]
    second.check_all_free()


def test_stop_string_spanning_the_checkpoint(llms):
    first, second = llms
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    (free,) = first.generate([PROMPT], greedy)
    stop = free.text[8:14]          # a stop string that straddles the capture point (token 3) or comes after it
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    state, ref = capture_after(first, params, 3)
    assert ref.finish_reason == "stop"
    final = resume(second, state)[-1]
    assert (final.text, final.finish_reason, final.stop_reason) == (ref.text, "stop", stop)


def test_state_json_round_trip_and_damage():
    params = SamplingParams(temperature=0.5, seed=7, stop=["x", "yz"], stop_token_ids=[3], max_tokens=9)
    import numpy as np
    rng = np.random.default_rng(7)
    rng.random()
    state = SequenceState("a", [1, 2], [3], 9, 0, params, rng.bit_generator.state)
    back = SequenceState.from_json(json.loads(json.dumps(state.to_json())))
    assert back == state
    d = state.to_json()
    with pytest.raises(EngineError, match="generator kind 'seed'"):
        SequenceState.from_json({**d, "rng_state": {"bit_generator": "seed"}})
    with pytest.raises(EngineError, match="not valid"):
        SequenceState.from_json({**d, "rng_state": {"bit_generator": "PCG64", "state": 3}})
    with pytest.raises(EngineError, match="unknown sampling parameters"):
        SequenceState.from_json({**d, "params": {**d["params"], "mirostat": 1}})
    with pytest.raises(EngineError, match="temperature"):
        SequenceState.from_json({**d, "params": {**d["params"], "temperature": -1}})
