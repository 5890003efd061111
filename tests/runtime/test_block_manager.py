"""The KV block pool: allocation, growth, reference counts, and leak checks."""
import pytest

from engine.runtime.block_manager import BlockManager


def test_allocate_grows_by_blocks_and_frees():
    bm = BlockManager(num_blocks=4, tokens_per_block=4)
    assert bm.allocate_slots("a", 5).block_ids == (0, 1)
    assert bm.allocate_slots("a", 8).block_ids == ()        # the second block still has room
    assert bm.allocate_slots("a", 9).block_ids == (2,)
    assert bm.block_table("a") == [0, 1, 2]
    assert bm.num_free_blocks == 1
    assert bm.allocate_slots("b", 8) is None                 # needs 2, 1 free: nothing taken
    assert bm.num_free_blocks == 1 and bm.block_table("b") == []
    bm.free("a")
    assert bm.num_free_blocks == 4
    assert len(bm.allocate_slots("b", 16).block_ids) == 4    # freed blocks are reusable at once
    bm.free("b")
    bm.check_all_free()



def test_freed_blocks_are_taken_again_before_untouched_ones():
    """The pool's pages are mapped on first write: a request after a freed one reuses its (resident, cache-warm)
    blocks, in the same order, instead of walking into never-written blocks."""
    bm = BlockManager(num_blocks=8, tokens_per_block=4, enable_prefix_caching=False)
    assert bm.allocate_slots("a", 12).block_ids == (0, 1, 2)
    assert bm.allocate_slots("b", 4).block_ids == (3,)
    bm.free("a")
    assert bm.allocate_slots("c", 8).block_ids == (0, 1)
    assert bm.allocate_slots("d", 12).block_ids == (2, 4, 5)   # the last freed one, then untouched blocks
    for r in "bcd":
        bm.free(r)
    bm.check_all_free()


def test_touched_blocks_count_each_block_once_and_survive_frees():
    """num_touched: the blocks that have held KV since start (what of the lazily mapped pool is resident), with
    cached blocks evicted and reused, and blocks freed, counted once each."""
    bm = BlockManager(num_blocks=6, tokens_per_block=2)
    assert bm.pool.num_touched == 0
    bm.allocate_slots("a", 6, token_ids=[1, 2, 3, 4, 5, 6])            # 3 full blocks, cached
    bm.free("a")
    assert bm.pool.num_touched == 3 and bm.num_free_blocks == 6
    bm.allocate_slots("b", 8, token_ids=[9, 9, 9, 9, 9, 9, 9, 9])      # 3 untouched, then evicts one cached
    assert bm.pool.num_touched == 6
    bm.free("b")
    bm.allocate_slots("c", 12)
    assert bm.pool.num_touched == 6

def test_reference_counts_on_fork():
    bm = BlockManager(num_blocks=3, tokens_per_block=2)
    bm.allocate_slots("parent", 4)
    bm.fork("parent", "child")
    assert bm.pool.ref_counts[:2] == [2, 2]
    bm.free("parent")
    assert bm.num_free_blocks == 1                            # still held by the child
    with pytest.raises(AssertionError, match="held by \\['child'\\]"):
        bm.check_all_free()
    bm.free("child")
    bm.check_all_free()


def test_double_free_is_caught():
    bm = BlockManager(num_blocks=2, tokens_per_block=2)
    bm.allocate_slots("a", 1)
    ids = bm.block_table("a")
    bm.free("a")
    with pytest.raises(AssertionError, match="freed twice"):
        bm.pool.decref(ids)
