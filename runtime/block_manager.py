"""The KV block pool: which block ids are free, who holds which, reference counts, and the prefix cache.

It knows block ids and token ids, not what the blocks hold (the session owns the arrays) nor how requests are
scheduled. The scheduler talks to it through small result types, vLLM v1's KVCacheManager interface:
`find_prefix(token_ids) -> PrefixHit`, `allocate_slots(...) -> NewBlocks | None` and `free`; it never sees a block
table (the engine core reads `block_table` to build the step's inputs).

    request "a": block table [4, 0, 7]   covers positions [0, 3 * tokens_per_block)
    slot of position p = block_table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block

Prefix caching: a full block is named by a chained hash of its tokens and of every token before it,

    hash(block i) = sha256(hash(block i-1) + token ids of block i)        (hash(block -1) = b"")

so equal hashes mean equal K/V (a token's K/V depend only on it and the tokens before it). A block is hashed
when an allocation covers it fully (its K/V are written by the step that follows, before any later step reads
them; a hit in the same step reads them after the step's in-graph write, see plugins/attention.py). Full blocks
are shared by reference count; a block whose count drops to 0 keeps its hash and waits in an LRU of
free-but-cached blocks, from which a later hit revives it. Allocation takes never-cached free blocks first, the
most recently freed of them first, and evicts the least recently freed cached block only when none is left.
Most recently freed first because the pool's memory is mapped lazily: a block no request has written yet costs
its page faults on first write (~3.5 ms a block of SmolLM2 at int4 on the 2-core VM, ~30% of a 512-token
prefill when every request took fresh blocks; bench/NOTES.md entry 32), and a block freed a moment ago is
resident and likely still in cache (`BlockPool.num_touched` counts the blocks taken at least once since start:
the part of the pool the process has paid for in memory). Blocks are only ever written by the
request that took them fresh: a hit covers whole blocks and stops at least one token short of the prompt.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class NewBlocks:
    """Blocks handed to a request by one allocate_slots call (possibly none: its last block had room)."""
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class PrefixHit:
    """Full blocks of a request's leading tokens already in the pool; give it back to allocate_slots."""
    block_ids: tuple[int, ...] = ()
    block_hashes: tuple[bytes, ...] = ()
    num_tokens: int = 0            # tokens covered: len(block_ids) * tokens_per_block


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


class BlockPool:
    """num_blocks blocks with reference counts; a block returns to the free lists when its count drops to 0."""

    def __init__(self, num_blocks: int):
        assert num_blocks > 0, num_blocks
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))          # free, holding nothing reusable; warmest first
        self._cached_free: OrderedDict[int, None] = OrderedDict()   # free but cached; least recently freed first
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self._taken_once = bytearray(num_blocks)   # 1: the block has held KV since start (its pages are touched)
        self.num_touched = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def take(self, n: int) -> list[int]:
        assert n <= self.num_free, (n, self.num_free)
        ids = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:   # evict the least recently freed cached block
                b, _ = self._cached_free.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
            assert self.ref_counts[b] == 0, b
            self.ref_counts[b] = 1
            if not self._taken_once[b]:
                self._taken_once[b] = 1
                self.num_touched += 1
            ids.append(b)
        return ids

    def lookup(self, h: bytes) -> int | None:
        return self._by_hash.get(h)

    def cache(self, block: int, h: bytes) -> None:
        """Name a held block by its hash, unless another block already holds the same tokens."""
        assert self.ref_counts[block] > 0, f"block {block} is free"
        if h not in self._by_hash and block not in self._hash_of:
            self._by_hash[h] = block
            self._hash_of[block] = h

    def incref(self, ids) -> None:
        for b in ids:
            if self.ref_counts[b] == 0:      # a prefix hit revives a free cached block
                del self._cached_free[b]
            self.ref_counts[b] += 1

    def decref(self, ids) -> None:
        # Freed in reverse so a request's tail blocks are evicted first: the head is what later requests share;
        # and an uncached block goes to the front of the free list (appendleft, head last, so it is taken first).
        for b in reversed(list(ids)):
            assert self.ref_counts[b] > 0, f"block {b} freed twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self._hash_of:
                    self._cached_free[b] = None
                else:
                    self._free.appendleft(b)


class BlockManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, *, enable_prefix_caching: bool = True):
        self.tokens_per_block = tokens_per_block
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}      # chained hashes of each request's full blocks so far
        self._salts: dict[str, bytes] = {}             # where each request's chain starts (find_prefix's salt)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def find_prefix(self, token_ids: Sequence[int], salt: bytes = b"") -> PrefixHit:
        """The longest run of leading full blocks of `token_ids` in the cache, leaving at least the last token
        to compute (its logits are what the step is for). `salt` starts the hash chain: the K/V of a LoRA
        adapter's tokens differ from the base model's (Sequence.cache_salt)."""
        if not self.enable_prefix_caching:
            return PrefixHit()
        tpb = self.tokens_per_block
        ids, hashes, parent = [], [], salt
        for i in range((len(token_ids) - 1) // tpb):
            h = block_hash(parent, token_ids[i * tpb:(i + 1) * tpb])
            b = self.pool.lookup(h)
            if b is None:
                break
            ids.append(b)
            hashes.append(h)
            parent = h
        return PrefixHit(tuple(ids), tuple(hashes), len(ids) * tpb)

    def num_blocks_needed(self, num_tokens: int, prefix: PrefixHit = PrefixHit()) -> int:
        """Free blocks a request not yet holding any would take to cover `num_tokens` starting from `prefix`."""
        return self._new_blocks_needed(num_tokens, 0, prefix)

    def _new_blocks_needed(self, num_tokens: int, held: int, prefix: PrefixHit) -> int:
        revived = sum(1 for b in prefix.block_ids if self.pool.ref_counts[b] == 0)
        return max(self.blocks_for(num_tokens) - held - len(prefix.block_ids), 0) + revived

    def allocate_slots(self, request_id: str, num_tokens: int, token_ids: Sequence[int] | None = None,
                       prefix: PrefixHit | None = None, salt: bytes = b"") -> NewBlocks | None:
        """Make the request's blocks cover positions [0, num_tokens); None (and nothing taken) when the pool
        has too few free blocks. `prefix` (from find_prefix, first allocation only) starts the table with the
        shared blocks. With `token_ids`, every block the allocation fills is entered in the prefix cache, its hash
        chain started from `salt` (the first allocation's)."""
        prefix = prefix or PrefixHit()
        table = self._tables.get(request_id)
        assert not (table and prefix.block_ids), f"a prefix hit for {request_id}, which already holds blocks"
        held = len(table) if table else 0
        if self._new_blocks_needed(num_tokens, held, prefix) > self.pool.num_free:
            return None
        if table is None:
            table = self._tables[request_id] = []
            self._hashes[request_id] = []
            self._salts[request_id] = salt
        self.pool.incref(prefix.block_ids)
        table.extend(prefix.block_ids)
        self._hashes[request_id].extend(prefix.block_hashes)
        ids = self.pool.take(max(self.blocks_for(num_tokens) - len(table), 0))
        table.extend(ids)
        if token_ids is not None and self.enable_prefix_caching:
            self._cache_full_blocks(request_id, token_ids, min(num_tokens, len(token_ids)))
        return NewBlocks(tuple(ids))

    def _cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        tpb, table, hashes = self.tokens_per_block, self._tables[request_id], self._hashes[request_id]
        for i in range(len(hashes), num_tokens // tpb):
            h = block_hash(hashes[-1] if hashes else self._salts[request_id], token_ids[i * tpb:(i + 1) * tpb])
            self.pool.cache(table[i], h)
            hashes.append(h)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's blocks past the first `num_tokens` positions: those of rejected speculated
        tokens (runtime/speculative/). They were never entered in the prefix cache, which names committed tokens only."""
        table = self._tables[request_id]
        keep = self.blocks_for(num_tokens)
        assert len(self._hashes[request_id]) <= keep, (request_id, num_tokens)
        if len(table) > keep:
            self.pool.decref(table[keep:])
            del table[keep:]

    def fork(self, parent_id: str, child_id: str) -> None:
        """Let `child_id` share all of the parent's blocks (reference counted; e.g. n > 1 samples of a prompt).

        The caller must only share blocks neither will write again: full blocks, or a tail it copies first."""
        assert child_id not in self._tables, child_id
        table = list(self.block_table(parent_id))
        self.pool.incref(table)
        self._tables[child_id] = table
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))
        self._salts[child_id] = self._salts.get(parent_id, b"")

    def free(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)
        self._salts.pop(request_id, None)
        self.pool.decref(self._tables.pop(request_id, []))

    def check_all_free(self) -> None:
        """Raise AssertionError naming what leaked unless every block is back in the pool."""
        held = {r: t for r, t in self._tables.items() if t}
        assert not held and self.pool.num_free == self.pool.num_blocks, (
            f"KV blocks leaked: {self.pool.num_blocks - self.pool.num_free} of {self.pool.num_blocks} not free; "
            f"held by {sorted(held)}")
        assert all(c == 0 for c in self.pool.ref_counts), "a free block has a non-zero reference count"
