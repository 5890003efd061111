"""The scheduler under load: decodes never stall behind a long prompt, priority order and FCFS ties, priority
preemption, and pool exhaustion (many requests, KV need many times the pool). Every run checks, step by step,
what attention would read from the pool and that all blocks are free at the end (tests/runtime/scheduling.py)."""
import random

import pytest

from engine.core.errors import EngineError
from engine.runtime.scheduler import SchedulerConfig
from tests.runtime.scheduling import expected_output, make, run, seq


@pytest.mark.parametrize("cap", [None, 100])
def test_long_prompt_arriving_during_eight_decodes(cap):
    sched, bm = make(num_blocks=400, tpb=16, max_batch_size=16, max_num_tokens=512,
                     max_prefill_chunk_with_decodes=cap)
    decoders = [seq(f"d{i}", 10 + i, 60) for i in range(8)]
    for s in decoders:
        sched.add(s)
    long = seq("long", 4000, 3)
    seen = {}

    def step(n, out):
        ids = {c.seq.request_id: c for c in out.chunks}
        if n == 2:                                   # the eight are decoding now
            assert all(ids[s.request_id].start_pos >= s.num_prompt_tokens for s in decoders)
            sched.add(long)
        elif n > 2 and "long" in ids and not any(s.is_finished for s in decoders):
            assert all(s.request_id in ids and ids[s.request_id].num_new_tokens == 1 for s in decoders), (
                f"step {n}: a decode got no token while the long prompt ran")
            seen.setdefault("chunks", []).append(ids["long"].num_new_tokens)
    run(sched, bm, step)
    chunks = seen["chunks"]
    per_step = cap or 512 - 8                        # the budget left by eight decodes, or the cap
    prefill = [min(per_step, 4000 - per_step * i) for i in range(-(-4000 // per_step))]
    assert chunks[:len(prefill)] == prefill and all(c == 1 for c in chunks[len(prefill):])
    assert long.output_token_ids == expected_output(long)
    assert all(s.output_token_ids == expected_output(s) for s in decoders)


def first_scheduled(steps):
    order = []
    for out in steps:
        for c in out.chunks:
            if c.seq.request_id not in order:
                order.append(c.seq.request_id)
    return order


def test_priority_order_with_fcfs_ties():
    prios = {"a": 2, "b": 0, "c": 1, "d": 0, "e": 2, "f": -1}
    sched, bm = make(num_blocks=64, max_batch_size=1, max_num_tokens=64, policy="priority")
    for rid, p in prios.items():
        sched.add(seq(rid, 6, 3, priority=p))
    assert first_scheduled(run(sched, bm)) == ["f", "b", "d", "c", "a", "e"]
    sched, bm = make(num_blocks=64, max_batch_size=1, max_num_tokens=64)      # fcfs: arrival order
    for rid in prios:
        sched.add(seq(rid, 6, 3))
    assert first_scheduled(run(sched, bm)) == list(prios)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_higher_priority_arrival_takes_the_slot_of_the_lowest(policy):
    sched, bm = make(num_blocks=64, max_batch_size=2, max_num_tokens=64, policy=policy)
    low = [seq("low0", 5, 20, priority=5 if policy == "priority" else 0),
           seq("low1", 5, 20, priority=5 if policy == "priority" else 0)]
    high = seq("high", 5, 4)
    for s in low:
        sched.add(s)
    started = {}

    def step(n, out):
        if n == 3:
            sched.add(high)
        if any(c.seq is high for c in out.chunks):
            started.setdefault("high", n)
            started.setdefault("preempted", [s.request_id for s in out.preempted])
    steps = run(sched, bm, step)
    if policy == "priority":
        assert started == {"high": 4, "preempted": ["low1"]}     # the latest arrival of the lowest priority
    else:
        assert started["high"] > 20 and not any(out.preempted for out in steps)
    assert all(s.output_token_ids == expected_output(s) for s in low + [high])


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_pool_pressure_victim_is_lowest_priority_then_latest_arrival(policy):
    # 9 blocks of 4; three requests growing to 16 tokens (4 blocks each) cannot all fit.
    sched, bm = make(num_blocks=9, tpb=4, max_num_tokens=64, policy=policy)
    ranks = {"A": 0, "B": 9, "C": 0} if policy == "priority" else {"A": 0, "B": 0, "C": 0}
    seqs = [seq(rid, 4, 12, priority=p) for rid, p in ranks.items()]
    for s in seqs:
        sched.add(s)
    victims = {v.request_id for out in run(sched, bm) for v in out.preempted}
    assert victims == ({"B"} if policy == "priority" else {"C"})
    assert all(s.output_token_ids == expected_output(s) for s in seqs)


@pytest.mark.parametrize("policy, prefix_caching, cap", [("fcfs", True, None), ("fcfs", False, 8),
                                                         ("priority", True, 8), ("priority", False, None)])
def test_fifty_requests_needing_many_times_the_pool_all_complete(policy, prefix_caching, cap):
    rnd = random.Random(50)
    sched, bm = make(num_blocks=20, tpb=4, max_batch_size=8, max_num_tokens=24, policy=policy,
                     prefix_caching=prefix_caching, max_prefill_chunk_with_decodes=cap)
    shared = list(range(7000, 7012))       # a common "system prompt" for half of them
    seqs = []
    for i in range(50):
        n, m = rnd.randint(3, 40), rnd.randint(1, 36)
        prompt = (shared + list(range(i * 100, i * 100 + n))) if i % 2 else None
        seqs.append(seq(f"r{i}", n, m, prompt=prompt, priority=rnd.randint(-2, 2) if policy == "priority" else 0))
    need = sum(-(-(s.num_prompt_tokens + s.max_tokens) // 4) for s in seqs)
    assert need > 10 * bm.num_blocks
    for s in seqs[:30]:
        sched.add(s)
    late = iter(seqs[30:])
    steps = run(sched, bm, lambda n, out: [sched.add(s) for s in [next(late, None)] if s is not None])
    assert sum(len(out.preempted) for out in steps) > 0, "the pool was meant to force preemption"
    for s in seqs:
        assert s.output_token_ids == expected_output(s), s.request_id
    assert (sched.stats.prefix_cache_hits > 0) == prefix_caching


def test_bad_policy_and_cap_are_refused():
    with pytest.raises(EngineError, match="'lifo' is unknown; use one of fcfs, priority"):
        SchedulerConfig(max_batch_size=1, max_num_tokens=8, policy="lifo")
    with pytest.raises(EngineError, match="max_prefill_chunk_with_decodes 0 must be >= 1"):
        SchedulerConfig(max_batch_size=1, max_num_tokens=8, max_prefill_chunk_with_decodes=0)
