"""A driver for scheduler tests: the engine step is replaced by a model of the KV pool that checks what
attention would read.

Every slot of the pool holds a fingerprint of the K/V written there: the hash of the token ids from position 0 up
to that slot's position (a token's K/V depend on exactly those). A step first writes the fingerprints of every
scheduled token into its slot (the graph writes K/V before attention reads them), then checks that every context
position of every chunk reads its own sequence's fingerprint: a block shared by the prefix cache, reused after
eviction, or resumed after preemption that holds anything else fails the test. No sequence writes a block that was
shared before the step. A chunk that reaches its sequence's last token appends a token (100 + output index), so
outputs are known in advance."""
from __future__ import annotations

import weakref
import zlib
from collections import Counter

from engine.runtime import SamplingParams
from engine.runtime.block_manager import BlockManager
from engine.runtime.scheduler import Scheduler, SchedulerConfig
from engine.runtime.sequence import FinishReason, Sequence


_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # block manager -> {slot: fingerprint}


def make(num_blocks, tpb=4, max_batch_size=8, max_num_tokens=16, *, prefix_caching=True, **config):
    bm = BlockManager(num_blocks, tpb, enable_prefix_caching=prefix_caching)
    cfg = SchedulerConfig(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, **config)
    return Scheduler(cfg, bm), bm


def seq(rid, prompt_len, max_tokens, prompt=None, priority=0):
    """A sequence whose prompt shares no block with another request's (unless `prompt` is given)."""
    base = zlib.crc32(rid.encode()) % 10_000 * 1000
    prompt = prompt if prompt is not None else list(range(base + 1, base + prompt_len + 1))
    return Sequence(request_id=rid, prompt_token_ids=list(prompt), params=SamplingParams(max_tokens=max_tokens),
                    max_tokens=max_tokens, priority=priority)


def expected_output(s: Sequence) -> list[int]:
    return [100 + i for i in range(s.max_tokens)]


def _fingerprints(token_ids, end):
    out, h = [], 0
    for t in token_ids[:end]:
        h = hash((h, t))
        out.append(h)
    return out


def run(sched, bm, on_step=None, max_steps=100_000):
    """Drive until done; returns the per-step outputs. Checks every step's invariants and the pool's contents,
    and that every block is free at the end."""
    steps = []
    pool = _POOLS.setdefault(bm, {})          # the pool outlives one run: later runs hit what earlier ones left
    tpb = bm.tokens_per_block
    while sched.has_unfinished():
        assert len(steps) < max_steps, "the scheduler did not finish (livelock)"
        # K/V other sequences already rely on: blocks shared before this step. (A block can become shared
        # within a step, by a prefix hit on a block its first holder fills in that same step.)
        shared = {b for b, n in enumerate(bm.pool.ref_counts) if n > 1}
        out = sched.schedule()
        assert out.chunks, "a step with unfinished sequences scheduled nothing (deadlock)"
        assert out.num_tokens <= sched.config.max_num_tokens
        assert len(out.chunks) <= sched.config.max_batch_size
        assert len({c.seq.request_id for c in out.chunks}) == len(out.chunks)
        held = Counter(b for s in sched.running for b in bm.block_table(s.request_id))
        assert all(bm.pool.ref_counts[b] == n for b, n in held.items()), "reference counts != holders"
        assert sum(c > 0 for c in bm.pool.ref_counts) == len(held), "a block is held by no running sequence"
        prints = {}
        for c in out.chunks:
            end = c.start_pos + c.num_new_tokens
            table = bm.block_table(c.seq.request_id)
            assert len(table) * tpb >= end
            prints[c.seq.request_id] = fp = _fingerprints(c.seq.token_ids, end)
            for p in range(c.start_pos, end):
                block = table[p // tpb]
                assert block not in shared, f"{c.seq.request_id} writes block {block}, shared before this step"
                pool[block * tpb + p % tpb] = fp[p]
        for c in out.chunks:
            table = bm.block_table(c.seq.request_id)
            fp = prints[c.seq.request_id]
            for p in range(c.start_pos + c.num_new_tokens):
                assert pool.get(table[p // tpb] * tpb + p % tpb) == fp[p], (
                    f"{c.seq.request_id} reads wrong K/V at position {p}")
        steps.append(out)
        if on_step:
            on_step(len(steps), out)
        for c in out.chunks:
            if c.want_logits:
                c.seq.append_token(100 + c.seq.num_output_tokens)
                if c.seq.num_output_tokens >= c.seq.max_tokens:
                    sched.finish(c.seq, FinishReason.LENGTH)
    bm.check_all_free()
    return steps
