"""Prefix caching: chained block hashes, sharing by reference count, the LRU of free cached blocks, and hits
through the scheduler (whose driver checks that every hit reads its own tokens' K/V: tests/runtime/scheduling.py)."""
from engine.runtime.block_manager import BlockManager, block_hash
from tests.runtime.scheduling import expected_output, make, run, seq


def test_full_blocks_are_found_by_chained_hash_and_shared():
    bm = BlockManager(num_blocks=8, tokens_per_block=4)
    a = list(range(1, 11))                                   # 2 full blocks + 2 tokens
    assert bm.find_prefix(a).num_tokens == 0
    bm.allocate_slots("a", 10, a)
    assert bm.pool.num_cached == 2                           # the partial third block is not cached
    hit = bm.find_prefix(a[:8] + [99, 98, 97])
    assert hit.block_ids == tuple(bm.block_table("a")[:2]) and hit.num_tokens == 8
    assert bm.find_prefix([1, 2, 3, 4, 0, 6, 7, 8, 9]).num_tokens == 4     # second block differs
    assert bm.find_prefix(a[4:]).num_tokens == 0             # same tokens, other position: other chain
    assert hit.block_hashes[1] == block_hash(block_hash(b"", a[:4]), a[4:8])
    bm.allocate_slots("b", 11, a[:8] + [99, 98, 97], hit)
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert [bm.pool.ref_counts[i] for i in bm.block_table("a")] == [2, 2, 1]
    assert bm.num_free_blocks == 8 - 4
    bm.free("a")
    bm.free("b")
    bm.check_all_free()


def test_a_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, tokens_per_block=4)
    p = list(range(1, 9))                                    # exactly two blocks
    bm.allocate_slots("a", 8, p)
    assert bm.find_prefix(p).num_tokens == 4                 # not 8: the last token's logits are needed
    assert bm.find_prefix(p + [9]).num_tokens == 8
    bm.free("a")


def test_freed_cached_blocks_wait_in_an_lru_and_are_evicted_last():
    bm = BlockManager(num_blocks=4, tokens_per_block=2)
    bm.allocate_slots("a", 4, [1, 2, 3, 4])
    bm.free("a")
    assert bm.num_free_blocks == 4 and bm.pool.num_cached == 2
    hit = bm.find_prefix([1, 2, 3, 4, 5])
    assert hit.num_tokens == 4
    assert bm.num_blocks_needed(5, hit) == 3                 # 2 revived from the LRU + 1 fresh
    bm.allocate_slots("x", 4)                                # takes the two never-cached blocks first
    assert bm.pool.num_cached == 2 and bm.find_prefix([1, 2, 3, 4, 5]).num_tokens == 4
    bm.allocate_slots("y", 2)                                # now evicts: the tail block [3, 4] goes first
    assert bm.pool.num_cached == 1 and bm.find_prefix([1, 2, 3, 4, 5]).num_tokens == 2
    hit = bm.find_prefix([1, 2, 9])
    assert bm.allocate_slots("z", 3, [1, 2, 9], hit) is None         # the revived block + 1 fresh: 1 free
    assert bm.pool.num_cached == 1                           # a failed allocation takes and evicts nothing
    for r in ("x", "y"):
        bm.free(r)
    assert bm.allocate_slots("z", 3, [1, 2, 9], hit).block_ids != ()
    assert bm.pool.ref_counts[hit.block_ids[0]] == 1
    bm.free("z")
    bm.check_all_free()


def test_disabled_cache_never_hits():
    bm = BlockManager(num_blocks=4, tokens_per_block=2, enable_prefix_caching=False)
    bm.allocate_slots("a", 4, [1, 2, 3, 4])
    bm.free("a")
    assert bm.find_prefix([1, 2, 3, 4, 5]).num_tokens == 0 and bm.pool.num_cached == 0


def test_scheduler_computes_only_what_the_cache_lacks():
    sched, bm = make(num_blocks=32, tpb=4, max_num_tokens=64)
    system = list(range(500, 516))                           # 4 full blocks
    a = seq("a", 0, 3, prompt=system + [1, 2, 3])
    sched.add(a)
    run(sched, bm)
    b = seq("b", 0, 3, prompt=system + [7, 8])
    sched.add(b)
    steps = run(sched, bm)
    assert (steps[0].chunks[0].start_pos, steps[0].chunks[0].num_new_tokens) == (16, 2)
    assert b.num_cached_tokens == 16 and b.output_token_ids == expected_output(b)
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (19 + 18, 16)


def test_identical_prompts_in_one_step_share_blocks_as_they_are_written():
    sched, bm = make(num_blocks=32, tpb=4, max_num_tokens=64)
    p = list(range(1, 14))
    seqs = [seq(f"s{i}", 0, 5, prompt=p) for i in range(3)]
    for s in seqs:
        sched.add(s)
    steps = run(sched, bm)
    assert [(c.start_pos, c.num_new_tokens) for c in steps[0].chunks] == [(0, 13), (12, 1), (12, 1)]
    assert all(s.output_token_ids == expected_output(s) for s in seqs)


def test_preempted_sequence_resumes_from_its_cached_blocks():
    # 6 blocks of 4; two requests growing to 20 tokens: one is preempted, and when it comes back the blocks it
    # filled are found in the LRU (unless evicted meanwhile), so the recompute is shorter.
    sched, bm = make(num_blocks=6, tpb=4, max_num_tokens=64)
    a, b = seq("a", 8, 12), seq("b", 8, 12)
    sched.add(a)
    sched.add(b)
    steps = run(sched, bm)
    assert b.num_preemptions > 0 and a.num_preemptions == 0
    resumed = [c for out in steps for c in out.chunks if c.seq is b and c.num_new_tokens > 1 and c.start_pos > 0]
    assert resumed, "b resumed without a prefix hit"
    assert a.output_token_ids == expected_output(a) and b.output_token_ids == expected_output(b)
