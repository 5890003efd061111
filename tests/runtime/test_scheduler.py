"""The scheduler alone: token budget, batch size, chunked prefill, continuous batching and preemption.

The engine is replaced by appending a token for every chunk that wants logits: the scheduler never sees
logits, so this drives exactly the calls the engine core makes."""
import pytest

from engine.runtime.sequence import FinishReason
from tests.runtime.scheduling import make, run, seq


def test_chunked_prefill_within_budget():
    sched, bm = make(num_blocks=64, max_num_tokens=16)
    s = seq("a", 40, 2)
    sched.add(s)
    steps = run(sched, bm)
    assert [(c.start_pos, c.num_new_tokens, c.want_logits) for st in steps for c in st.chunks] == [
        (0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True)]
    assert s.output_token_ids == [100, 101]


def test_decodes_first_then_prefills_and_batch_limit():
    sched, bm = make(num_blocks=64, max_batch_size=3, max_num_tokens=12)
    seqs = [seq(f"s{i}", 5, 4) for i in range(5)]
    for s in seqs:
        sched.add(s)

    def check(step, out):
        kinds = [c.start_pos >= c.seq.num_prompt_tokens for c in out.chunks]
        assert kinds == sorted(kinds, reverse=True), "decodes must come before prefills"
        assert len(sched.running) <= 3
    steps = run(sched, bm, check)
    assert max(len(st.chunks) for st in steps) == 3
    assert all(s.output_token_ids == [100, 101, 102, 103] for s in seqs)


def test_finished_sequence_blocks_go_to_a_waiting_one():
    # 4 blocks of 4: a (8 tokens) and b (7) take them all; c waits until a finishes after its first token.
    sched, bm = make(num_blocks=4, tpb=4, max_num_tokens=64)
    a, b, c = seq("a", 8, 1), seq("b", 7, 2), seq("c", 4, 2)
    for s in (a, b, c):
        sched.add(s)
    seen = {}

    def check(step, out):
        ids = [ch.seq.request_id for ch in out.chunks]
        if "c" in ids and "c" not in seen:
            seen["c"] = (step, list(bm.block_table("c")))
    blocks_of_a = []
    orig_finish = sched.finish

    def finish(s, *args):
        if s is a:
            blocks_of_a.extend(bm.block_table("a"))
            seen["a_done"] = True
        orig_finish(s, *args)
    sched.finish = finish
    run(sched, bm, check)
    assert seen["c"][0] == 2                       # the step right after a finished (a: 1 token at step 1)
    assert set(seen["c"][1]) <= set(blocks_of_a)
    assert a.num_preemptions == b.num_preemptions == c.num_preemptions == 0


def test_preemption_by_recompute_when_the_pool_is_small():
    # 6 blocks of 4 = 24 slots; 4 requests of 6 + 10 tokens (4 blocks each) cannot all grow at once.
    sched, bm = make(num_blocks=6, tpb=4, max_num_tokens=32)
    seqs = [seq(f"s{i}", 6, 10) for i in range(4)]
    for s in seqs:
        sched.add(s)
    preempted = []
    steps = run(sched, bm, lambda step, out: preempted.extend(s.request_id for s in out.preempted))
    assert preempted, "the pool was meant to force preemption"
    assert "s0" not in preempted                   # the earliest arrival is never the victim
    for s in seqs:
        assert s.output_token_ids == [100 + i for i in range(10)]
    # a recomputed sequence runs its prompt and its generated tokens again from position 0
    resumed = [c for st in steps for c in st.chunks if c.start_pos == 0 and c.num_new_tokens > 6]
    assert resumed and all(c.seq.num_preemptions > 0 for c in resumed)


def test_abort_frees_blocks_and_waiting_abort():
    sched, bm = make(num_blocks=8)
    a, b = seq("a", 4, 5), seq("b", 4, 5)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a, FinishReason.ABORT)
    assert bm.block_table("a") == [] and a.finish_reason is FinishReason.ABORT
    sched.finish(b, FinishReason.ABORT)
    assert not sched.has_unfinished()
    bm.check_all_free()
    c = seq("c", 4, 5)
    sched.add(c)
    sched.finish(c, FinishReason.ABORT)          # still waiting: nothing allocated
    bm.check_all_free()


@pytest.mark.parametrize("max_num_tokens, max_batch_size, num_blocks", [(7, 2, 12), (32, 8, 9), (5, 3, 40)])
def test_random_workloads_complete(max_num_tokens, max_batch_size, num_blocks):
    import random
    rnd = random.Random(max_num_tokens)
    sched, bm = make(num_blocks=num_blocks, tpb=4, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens)
    seqs = [seq(f"r{i}", rnd.randint(1, 20), rnd.randint(1, 12)) for i in range(12)]
    for s in seqs:
        sched.add(s)
    run(sched, bm)
    assert all(s.output_token_ids == [100 + i for i in range(s.max_tokens)] for s in seqs)
