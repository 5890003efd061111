"""The KV block pool: which block ids are free, who holds which, and reference counts.

It knows block ids and token counts, not what the blocks hold (the session owns the arrays) nor how requests are
scheduled. The scheduler talks to it through `allocate_slots` -> `NewBlocks | None` and `free`, vLLM v1's
KVCacheManager interface, so prefix caching (shared full blocks, hence the reference counts) can grow here
without touching the scheduler.

    request "a": block table [4, 0, 7]   covers positions [0, 3 * tokens_per_block)
    slot of position p = block_table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class NewBlocks:
    """Blocks handed to a request by one allocate_slots call (possibly none: its last block had room)."""
    block_ids: tuple[int, ...]


class BlockPool:
    """num_blocks blocks with reference counts; a block returns to the free queue when its count drops to 0."""

    def __init__(self, num_blocks: int):
        assert num_blocks > 0, num_blocks
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        assert n <= len(self._free), (n, len(self._free))
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            assert self.ref_counts[b] == 0, b
            self.ref_counts[b] = 1
        return ids

    def incref(self, ids) -> None:
        for b in ids:
            assert self.ref_counts[b] > 0, f"block {b} is free"
            self.ref_counts[b] += 1

    def decref(self, ids) -> None:
        # Freed in reverse so a request's tail blocks are reused last (the head is what a prefix cache would hit).
        for b in reversed(list(ids)):
            assert self.ref_counts[b] > 0, f"block {b} freed twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int):
        self.tokens_per_block = tokens_per_block
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_tokens: int) -> NewBlocks | None:
        """Make the request's blocks cover positions [0, num_tokens); None (and nothing taken) when the pool
        has too few free blocks."""
        table = self._tables.setdefault(request_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:
            return NewBlocks(())
        if need > self.pool.num_free:
            if not table:
                del self._tables[request_id]
            return None
        ids = self.pool.take(need)
        table.extend(ids)
        return NewBlocks(tuple(ids))

    def fork(self, parent_id: str, child_id: str) -> None:
        """Let `child_id` share all of the parent's blocks (reference counted; e.g. n > 1 samples of a prompt).

        The caller must only share blocks neither will write again: full blocks, or a tail it copies first."""
        assert child_id not in self._tables, child_id
        table = list(self.block_table(parent_id))
        self.pool.incref(table)
        self._tables[child_id] = table

    def free(self, request_id: str) -> None:
        self.pool.decref(self._tables.pop(request_id, []))

    def check_all_free(self) -> None:
        """Raise AssertionError naming what leaked unless every block is back in the pool."""
        held = {r: t for r, t in self._tables.items() if t}
        assert not held and self.pool.num_free == self.pool.num_blocks, (
            f"KV blocks leaked: {self.pool.num_blocks - self.pool.num_free} of {self.pool.num_blocks} not free; "
            f"held by {sorted(held)}")
