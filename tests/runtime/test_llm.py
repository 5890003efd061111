"""End to end on the tiny Llama engine: greedy == transformers, batch == singles, preemption, limits, streaming."""
import asyncio
import logging
import threading
import time

import numpy as np
import pytest

from engine.core.errors import EngineError
from engine.runtime import LLM, SamplingParams
from engine.runtime.llm import EngineLoopStopped

GREEDY = SamplingParams(temperature=0, max_tokens=16)
LENGTHS = (3, 11, 45, 1, 24)  # 45 > max_num_tokens 40: a chunked prefill


def prompts(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def llm(tiny_engine):
    llm = LLM(tiny_engine[1], max_kv_tokens=8 * 64)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def hf_model(tiny_engine):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_engine[0], dtype=torch.float32).eval()


def hf_greedy(model, ids, n=16):
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(s[0], -1).numpy() for s in out.scores]
    return tokens, logprobs


def test_greedy_matches_transformers(llm, hf_model):
    ps = prompts()
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=16, logprobs=3))
    full = 0
    for p, o in zip(ps, outs):
        want, want_lp = hf_greedy(hf_model, p)
        assert o.token_ids == want, f"prompt of {len(p)} tokens"
        assert o.prompt_token_ids == p and o.num_prompt_tokens == len(p)
        assert o.finish_reason == ("length" if len(want) == 16 else "stop")
        full += len(want) == 16
        for lp, ref in zip(o.logprobs, want_lp):  # raw logprobs == HF log_softmax, top-3 ids identical
            np.testing.assert_allclose(lp.logprob, ref[lp.token_id], atol=1e-4)
            assert list(lp.top) == np.argsort(-ref, kind="stable")[:3].tolist()
            np.testing.assert_allclose(list(lp.top.values()), np.sort(ref)[::-1][:3], atol=1e-4)
    assert full >= 3, "too few prompts ran their 16 tokens to test anything"
    llm.check_all_free()


def test_batch_equals_singles(llm):
    ps = prompts(seed=1)
    batched = llm.generate(ps, GREEDY)
    assert llm.core.stats.max_seqs_per_step > 1
    for p, o in zip(ps, batched):
        assert llm.generate([p], GREEDY)[0].token_ids == o.token_ids
    llm.check_all_free()


def test_tiny_pool_forces_preemption_and_gives_the_same_tokens(llm, tiny_engine):
    ps = prompts((20, 30, 10, 25, 15, 5), seed=2)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(ps, params)]
    small = LLM(tiny_engine[1], max_kv_tokens=64)   # 8 blocks: one max_seq_len request
    assert small.kv_plan.num_blocks == 8
    got = small.generate(ps, params)
    assert small.core.stats.num_preempted > 0
    assert [o.token_ids for o in got] == want
    assert any(o.metrics.num_preemptions for o in got)
    small.check_all_free()


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    ps = prompts(seed=3)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    alone = llm.generate([ps[0]], params)[0].token_ids
    batched = llm.generate(ps, [params] + [SamplingParams(temperature=0.8, max_tokens=7)] * (len(ps) - 1))
    assert batched[0].token_ids == alone
    other = llm.generate([ps[0]], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=12))
    assert other[0].token_ids != alone


def test_stop_token_ids_and_stop_strings(llm):
    p = llm.tokenizer.encode("The capital of France is")
    base = llm.generate(p, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    o = llm.generate(p, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert o.token_ids == base.token_ids[:first + 1]
    assert (o.finish_reason, o.stop_reason) == ("stop", stop_tok)
    # min_tokens: the stop id cannot be drawn (nor end the request) before 3 tokens
    o = llm.generate(p, SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[base.token_ids[0]],
                                       min_tokens=3, ignore_eos=True))[0]
    assert base.token_ids[0] not in o.token_ids[:3] and o.num_generated_tokens >= 4
    # a stop string made of the text of three generated tokens: the output is the text before it
    text = base.text
    pieces = [llm.tokenizer.decode(base.token_ids[i:i + 3]) for i in range(2, 12)]
    piece = next(x for x in pieces if "\ufffd" not in x and x.strip() and x in text)
    o = llm.generate(p, SamplingParams(temperature=0, max_tokens=16, stop=[piece], ignore_eos=True))[0]
    assert o.text == text[:text.index(piece)]
    assert (o.finish_reason, o.stop_reason) == ("stop", piece)
    llm.check_all_free()


def test_limits(llm, tiny_engine, caplog):
    with pytest.raises(EngineError, match="empty"):
        llm.generate([""], GREEDY)
    with pytest.raises(EngineError, match="49 tokens.*max_input_len 48.*maximum context length is 64"):
        llm.generate([[5] * 49], GREEDY)
    with caplog.at_level(logging.WARNING, logger="engine.runtime"):
        o = llm.generate([[5] * 40], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert "max_seq_len 64" in caplog.text and "at most 24" in caplog.text
    assert o.num_generated_tokens == 24 and o.finish_reason == "length"
    with pytest.raises(EngineError, match="largest max_seq_len that fits is 56"):
        LLM(tiny_engine[1], max_kv_tokens=50)
    llm.check_all_free()


async def collect(llm, p):
    """The joined deltas and the last output of one greedy generate_async stream."""
    deltas, last = [], None
    async for out in llm.generate_async(p, GREEDY):
        deltas.append(out.delta_text)
        last = out
    return "".join(deltas), last


def test_async_streaming_and_abort(llm):
    ps = prompts((7, 19, 4), seed=4)
    want = llm.generate(ps, GREEDY)

    async def abort_early(p):
        n = 0
        async for out in llm.generate_async(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)):
            n += 1
            if n == 2:
                break
        return n

    async def main():
        return await asyncio.gather(*[collect(llm, p) for p in ps], abort_early(ps[0]))

    *results, n = asyncio.run(main())
    assert n == 2
    for (joined, last), w in zip(results, want):
        assert last.finished and last.token_ids == w.token_ids
        assert joined == last.text == w.text
    # sync calls keep working once the background thread runs, and batch with it
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == [w.token_ids for w in want]
    llm.check_all_free()   # the aborted request's blocks came back (its abort was queued before that generate)
    llm.close()
    llm.check_all_free()


def test_stream_interval_reports_every_nth_token_and_the_same_text(llm, tiny_engine):
    """stream_interval 3: a request's outputs are its first token, then every 3rd, then its finish (the rest);
    the deltas join to the same text and tokens as one output per token, sync and async."""
    ps = prompts((7, 19, 4), seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = {i: o for i, o in enumerate(llm.generate(ps, params))}
    with pytest.raises(EngineError, match="--stream-interval 0 must be >= 1"):
        LLM(tiny_engine[1], max_kv_tokens=8 * 64, stream_interval=0)
    chunky = LLM(tiny_engine[1], max_kv_tokens=8 * 64, stream_interval=3)
    try:
        ids: list = []
        outs = list(chunky.stream(ps, params, request_ids=ids))
        for i, rid in enumerate(ids):
            mine = [o for o in outs if o.request_id == rid]
            assert [len(o.delta_token_ids) for o in mine] == [1, 3, 3, 3, 2]      # 12 tokens: 1 + 3 + 3 + 3 + 2
            assert [o.finished for o in mine] == [False] * 4 + [True]
            assert sum((o.delta_token_ids for o in mine), []) == mine[-1].token_ids == want[i].token_ids
            assert "".join(o.delta_text for o in mine) == mine[-1].text == want[i].text

        async def deltas(p):
            return [len(o.delta_token_ids) async for o in chunky.generate_async(p, params)]

        async def main():
            return await asyncio.gather(*(deltas(p) for p in ps))
        assert asyncio.run(main()) == [[1, 3, 3, 3, 2]] * len(ps)
        chunky.check_all_free()
    finally:
        chunky.close()


def test_async_requests_from_event_loops_in_two_threads(llm):
    """A step's outputs go to each event loop in one hand-over (runtime/loop_sink.py): requests from loops in
    two threads, batched in the same steps, each get their own outputs, every delta in order."""
    ps = prompts((5, 11, 8, 3), seed=6)
    want = llm.generate(ps, GREEDY)
    got: dict[int, tuple[str, list[int]]] = {}
    errors: list[str] = []

    def thread(indices):
        async def main():   # a stream that never ends (an output sent to the wrong loop) times out here
            return await asyncio.wait_for(asyncio.gather(*[collect(llm, ps[i]) for i in indices]), 60)
        try:
            for i, (joined, last) in zip(indices, asyncio.run(main())):
                got[i] = (joined, last.token_ids)
        except BaseException as e:  # noqa: BLE001 - the assertion below reports it
            errors.append(repr(e))

    workers = [threading.Thread(target=thread, args=(ix,), daemon=True) for ix in ((0, 2), (1, 3))]
    for t in workers:
        t.start()
    deadline = time.monotonic() + 90   # one deadline for both threads, not 60 s each
    for t in workers:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not errors and not any(t.is_alive() for t in workers), errors
    assert {i: got.get(i) for i in range(len(ps))} == {i: (w.text, w.token_ids) for i, w in enumerate(want)}
    llm.check_all_free()


def test_a_stream_whose_event_loop_closed_unread_costs_only_its_request(llm):
    """asyncio.run can return (its loop closed) just after a stream was left early, before that stream's abort
    reaches the engine thread (CI hung on this in test_async_streaming_and_abort): the engine's hand-over to the
    closed loop aborts that request instead of killing the engine thread, and every other request runs on."""
    ps = prompts((7, 19), seed=9)
    want = [o.token_ids for o in llm.generate(ps, GREEDY)]
    loop = asyncio.new_event_loop()
    orphan = llm.generate_async(prompts((6,), seed=8)[0], SamplingParams(temperature=0, max_tokens=50,
                                                                          ignore_eos=True))
    assert not loop.run_until_complete(orphan.__anext__()).finished
    loop.close()   # without aborting the stream: no aclose() of it has run
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want
    assert llm.is_running()
    llm.check_all_free()   # the orphan was aborted (or, on a stalled machine, finished) and its blocks came back
    asyncio.run(orphan.aclose())   # its own abort, now of a request the engine no longer has, changes nothing
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want
    llm.check_all_free()


def test_an_engine_loop_that_dies_fails_its_readers_instead_of_hanging_them(tiny_engine, monkeypatch):
    llm = LLM(tiny_engine[1], max_kv_tokens=8 * 64)
    monkeypatch.setattr(llm.engine_thread, "_dispatch", lambda outputs: 1 / 0)
    llm.start()
    with pytest.raises(EngineLoopStopped, match="the engine loop stopped .*ZeroDivisionError"):
        llm.generate(prompts((5,)), GREEDY)
    assert not llm.is_running()
    with pytest.raises(EngineLoopStopped, match="start a new LLM"):   # refused at once, not queued for no one
        llm.generate(prompts((5,)), GREEDY)
    llm.close()
