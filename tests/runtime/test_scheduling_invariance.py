"""Scheduling never changes results, on the tiny Llama engine: chunked == unchunked prefill, prefix-cache hit ==
miss, preempted-and-resumed == uninterrupted. Greedy tokens and the ids of the top-5 logprobs are identical; the
logprobs agree within float32 rounding (ATOL; measured here up to 1.2e-7), not bit for bit: a step's matmuls and
attention see a different batch (rows, padded lengths) when the same token is computed in a different chunk or
next to other sequences, and float32 sums in another order round differently. (With the same batch shapes they
are bit-identical: a prefix hit for a single prompt matched its miss exactly.)
Also the engine-level versions of the scheduler tests: decodes keep going during a long prompt, priority order,
and 50 requests through a pool of one request. Every test ends with all blocks free."""
import asyncio

import numpy as np
import pytest

from engine.core.errors import EngineError
from engine.runtime import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)


def prompts(lengths, seed=0, shared=()):
    rng = np.random.default_rng(seed)
    return [list(shared) + rng.integers(3, 500, size=n).tolist() for n in lengths]


ATOL = 1e-5


def results(outs):
    """Everything the engine computed for each request: tokens and top-5 ids (exact), raw logprobs (float)."""
    return [([lp.token_id for lp in o.logprobs], [tuple(lp.top) for lp in o.logprobs],
             np.array([[lp.logprob, *lp.top.values()] for lp in o.logprobs])) for o in outs]


def assert_same(got, want):
    assert len(got) == len(want)
    for (tokens, top, lps), (want_tokens, want_top, want_lps) in zip(results(got), results(want)):
        assert tokens == want_tokens and top == want_top
        np.testing.assert_allclose(lps, want_lps, rtol=0, atol=ATOL)


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine[1]


def make_llm(engine, **kw):
    return LLM(engine, **{"max_kv_tokens": 8 * 64, **kw})


@pytest.fixture(scope="module")
def reference(engine):
    """No prefix cache, the engine's full budget, a pool that never preempts."""
    llm = make_llm(engine, enable_prefix_caching=False)
    yield llm
    llm.check_all_free()


def test_chunked_prefill_equals_one_shot(engine, reference):
    ps = prompts((40, 33, 17))
    want = reference.generate(ps, PARAMS)
    for budget in (7, 16):
        llm = make_llm(engine, enable_prefix_caching=False, max_num_tokens=budget)
        got = llm.generate(ps, PARAMS)
        assert_same(got, want)
        assert llm.core.stats.max_tokens_per_step <= budget
        llm.check_all_free()


def test_prefix_cache_hit_equals_miss(engine, reference):
    system = prompts((32,), seed=1)[0]                      # 4 full blocks of 8
    first, *others = prompts((5, 9, 16, 3), seed=2, shared=system)
    want = reference.generate(others, PARAMS)
    llm = make_llm(engine)
    llm.generate([first], PARAMS)
    got = llm.generate(others, PARAMS)
    assert_same(got, want)
    assert [o.metrics.num_cached_tokens for o in got] == [32, 32, 32]
    stats = llm.stats()
    assert stats.prefix_cache_hits == 3 * 32 and stats.prefix_cache_queries == sum(len(p) for p in [first] + others)
    # the same 48-token prompt again: all but its last block come from the cache (its last token is computed)
    again = llm.generate([others[1]], PARAMS)
    assert_same(again, want[1:2])
    assert again[0].metrics.num_cached_tokens == 40
    llm.check_all_free()
    off = make_llm(engine, enable_prefix_caching=False)
    off.generate([first], PARAMS)
    assert off.generate([others[0]], PARAMS)[0].metrics.num_cached_tokens == 0 and off.stats().prefix_cache_hits == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_and_resumed_equals_uninterrupted(engine, reference, prefix_caching):
    ps = prompts((20, 30, 10, 25, 15, 5), seed=3)
    params = SamplingParams(temperature=0, max_tokens=30, logprobs=5, ignore_eos=True)
    want = reference.generate(ps, params)
    small = LLM(engine, max_kv_tokens=64, enable_prefix_caching=prefix_caching)   # one max_seq_len request
    got = small.generate(ps, params)
    assert small.stats().preemptions > 0 and any(o.metrics.num_preemptions for o in got)
    assert_same(got, want)
    small.check_all_free()


def test_fifty_requests_through_a_pool_of_one_request(engine, reference):
    rng = np.random.default_rng(4)
    shared = prompts((16,), seed=5)[0]
    ps = [p if i % 3 else shared + p[:24] for i, p in enumerate(prompts(rng.integers(1, 41, 50), seed=6))]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in rng.integers(1, 24, 50)]
    small = LLM(engine, max_kv_tokens=64)
    need = sum(-(-(len(p) + sp.max_tokens) // 8) for p, sp in zip(ps, params))
    assert need > 10 * small.kv_plan.num_blocks
    got = small.generate(ps, params)
    assert small.stats().preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in reference.generate(ps, params)]
    assert all(o.finished and o.finish_reason == "length" for o in got)
    small.check_all_free()


def test_long_prompt_while_seven_decode(engine, reference):
    # Seven: the tiny engine's max_batch_size is 8 (the scheduler test runs a 4,000-token prompt past eight).
    decoders = prompts((3, 4, 5, 6, 7, 8, 9), seed=7)
    long = prompts((45,), seed=8)[0]                        # with 7 decodes, 40 - 7 tokens a step: 2 chunks
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=5, ignore_eos=True)
    want = reference.generate(decoders + [long], params)
    llm = make_llm(engine, max_prefill_chunk_with_decodes=None)
    seqs = [llm.make_sequence(p, params)[0] for p in decoders]
    for s in seqs:
        llm.core.add_request(s)
    outs = {}
    for _ in range(2):
        for o in llm.core.step():
            outs[o.request_id] = o
    long_seq = llm.make_sequence(long, params)[0]
    llm.core.add_request(long_seq)
    prefill_steps = 0
    while llm.core.has_unfinished():
        running_decoders = {s.request_id for s in seqs if not s.is_finished}
        prefill_steps += not long_seq.output_token_ids
        step = llm.core.step()
        for o in step:
            outs[o.request_id] = o
        assert running_decoders <= {o.request_id for o in step}, "a decode got no token in this step"
    assert prefill_steps == 2
    assert_same([outs[s.request_id] for s in seqs + [long_seq]], want)
    llm.check_all_free()


def test_priority_order_and_refusal_under_fcfs(engine):
    ps = prompts((5, 6, 7, 8), seed=9)
    llm = make_llm(engine, scheduling_policy="priority", max_batch_size=1)
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), priority=[3, 1, 3, 0])
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_token_time)
    assert order == [3, 1, 0, 2]                             # lower first; tie (0 and 2) by arrival
    llm.check_all_free()
    fcfs = make_llm(engine)
    with pytest.raises(EngineError, match="priority 2 needs the priority scheduling policy.*--scheduling-policy"):
        fcfs.generate(ps[:1], priority=2)
    with pytest.raises(EngineError, match="priority 'high' must be an integer"):
        llm.generate(ps[:1], priority="high")
    assert fcfs.generate(ps[:1], SamplingParams(max_tokens=2), priority=0)[0].finished

    async def last(llm, **kw):      # the server's call
        async for out in llm.generate_async(ps[0], SamplingParams(max_tokens=2), **kw):
            pass
        return out
    with pytest.raises(EngineError, match="priority 1 needs the priority scheduling policy"):
        asyncio.run(last(fcfs, request_id="x", priority=1))
    assert asyncio.run(last(llm, request_id="x", priority=-5)).finished
    llm.close()
    llm.check_all_free()


def test_stats_and_limits(engine):
    llm = make_llm(engine)
    s = llm.stats()
    assert (s.running, s.waiting, s.kv_usage, s.num_free_blocks) == (0, 0, 0.0, s.num_blocks)
    for p in prompts((10, 20, 30, 5), seed=10):
        llm.core.add_request(llm.make_sequence(p, SamplingParams(max_tokens=5, ignore_eos=True))[0])
    assert llm.stats().waiting == 4
    llm.core.step()
    s = llm.stats()
    # a budget of 40: 10 + 20 + the first 10 of the third prompt; the fourth waits. 2 + 3 + 2 blocks of 8.
    assert (s.running, s.waiting, s.num_free_blocks, s.num_cached_blocks) == (3, 1, s.num_blocks - 7, 4)
    assert s.kv_usage == 7 / s.num_blocks
    while llm.core.has_unfinished():
        llm.core.step()
    llm.check_all_free()
    with pytest.raises(EngineError, match="--max-num-tokens 41 is outside \\[1, 40\\]"):
        make_llm(engine, max_num_tokens=41)
    with pytest.raises(EngineError, match="--max-batch-size 0 is outside \\[1, 8\\]"):
        make_llm(engine, max_batch_size=0)
    with pytest.raises(EngineError, match="scheduling policy 'random' is unknown"):
        make_llm(engine, scheduling_policy="random")
