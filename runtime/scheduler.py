"""The continuous-batching scheduler: which sequences run in the next engine step, and how many tokens each.

There is no prefill phase nor decode phase (vLLM v1's model): each sequence has num_computed_tokens and
num_tokens, and each step brings some sequences' num_computed_tokens closer to their num_tokens. A step fills a
token budget (max_num_tokens) over at most max_batch_size sequences:

  0. (priority policy) a waiting sequence that ranks above the lowest-ranked running one and finds no free
     batch slot or too few free blocks for its first chunk takes them from it (that one is preempted);
  1. running sequences with one token to go (decodes), all of them, so a decode never waits for a prefill; a
     decode carrying speculated tokens (seq.draft_token_ids) runs them too when the budget and the free blocks
     allow, else it drops them (drafts never preempt anyone);
  2. then prefills in rank order: running ones part-way through their prompt and waiting ones (new prompts, or
     preempted ones to recompute), while the budget and the batch size allow. A prompt longer than the budget
     left is chunked; its next chunk runs in the next step. While decodes run, a chunk is also capped at
     `max_prefill_chunk_with_decodes` tokens: a step lasts as long as its longest work, and every decode of the
     step waits for it, so the cap bounds the decodes' inter-token time while a long prompt prefills.

Rank: the lower `priority` value first, then the earlier arrival (FCFS is the same order with every priority 0).

A waiting sequence first looks up the prefix cache: the leading full blocks already in the pool count as
computed, so only the rest runs (at least its last token, whose logits are sampled).

A sequence needs KV blocks for every token it computes. When the pool runs out, the lowest-ranked running
sequence not yet served in this step (the one asking, if it ranks lowest) is preempted by recompute: its blocks
are freed, num_computed_tokens drops to 0 and it goes back to the waiting queue with its prompt and everything
it generated (its full blocks stay in the prefix cache, so the recompute may be short). No waiting sequence is
admitted in a step whose running sequences ran out of blocks. The highest-ranked running sequence can
always grow (the pool holds one max_seq_len request), so every step makes progress and nothing is lost.
Finished sequences free their blocks at once (`finish`), so a waiting prompt can take them in the next step.

The block manager is reached only through its result types (find_prefix -> PrefixHit, allocate_slots ->
NewBlocks | None, free): the scheduler never touches a block list.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from engine.core.errors import EngineError

from .block_manager import BlockManager
from .sequence import FinishReason, Sequence, Status

POLICIES = ("fcfs", "priority")
# The cap on a prefill chunk in a step that also runs decodes, chosen by bench/scheduler_policies.py (part 3) on SmolLM2:
# eight decodes while a 1,000-token prompt prefills, 1 thread. First measured when a step's attention padded every
# decode to the longest chunk's queries (no cap: one 33 s step; 128: 3.5 s worst step and the best TTFT). Since
# step_inputs cuts a long chunk into rows, a cap no longer saves work, it only bounds the step: on the int4 engine
# (2026-12-05, Zen 5) no cap ran one 680 ms step (TTFT 0.68 s); caps 32 / 64 / 128 / 256 / 512 gave worst steps of
# 39 / 67 / 108 / 195 / 394 ms and TTFTs of 0.91 / 0.79 / 0.69 / 0.65 / 0.68 s. 128 keeps the inter-token time near
# 0.1 s for 2% more TTFT. A cap costs no budget: several prompts still get a chunk each.
DEFAULT_MAX_PREFILL_CHUNK_WITH_DECODES = 128


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int     # sequences per step
    max_num_tokens: int     # tokens per step (the engine's build limit)
    policy: str = "fcfs"    # "fcfs" | "priority"
    max_prefill_chunk_with_decodes: int | None = None   # cap on a prefill chunk in a step with decodes
    max_loras: int = 0      # LoRA adapters the running sequences may use together (the session's slots)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise EngineError(f"scheduling policy {self.policy!r} is unknown; use one of {', '.join(POLICIES)}",
                              usage=True)
        cap = self.max_prefill_chunk_with_decodes
        if cap is not None and cap < 1:
            raise EngineError(f"max_prefill_chunk_with_decodes {cap} must be >= 1 (or None for no cap)", usage=True)


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start_pos, start_pos + num_new_tokens) of `seq` run in this step, then its `draft_token_ids`;
    want_logits when the chunk reaches the sequence's last token (only then does the step yield its next token,
    and with drafts the logits of each drafted position too)."""
    seq: Sequence
    start_pos: int
    num_new_tokens: int
    want_logits: bool
    draft_token_ids: tuple[int, ...] = ()

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start_pos:self.start_pos + self.num_new_tokens] + list(self.draft_token_ids)

    @property
    def num_logits(self) -> int:
        return 1 + len(self.draft_token_ids) if self.want_logits else 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens + len(c.draft_token_ids) for c in self.chunks)


@dataclass
class SchedulerStats:
    """Counters since start (prefix cache in tokens, as vLLM counts them)."""
    num_preemptions: int = 0
    prefix_cache_queries: int = 0       # tokens of admitted sequences looked up in the prefix cache
    prefix_cache_hits: int = 0          # of those, tokens found in the cache


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: list[Sequence] = []     # sorted by rank
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self._arrivals = itertools.count()

    def add(self, seq: Sequence) -> None:
        # The caller checked that the sequence fits the pool on its own (LLM checks max_seq_len at load) and
        # that a non-zero priority comes with the priority policy (LLM.make_sequence).
        assert self.blocks.blocks_for(seq.num_prompt_tokens + seq.max_tokens) <= self.blocks.num_blocks
        assert self.config.policy == "priority" or seq.priority == 0, seq.priority
        seq.arrival_index = next(self._arrivals)
        seq.status = Status.WAITING
        self._enqueue(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def rank(seq: Sequence) -> tuple[int, int]:
        return seq.priority, seq.arrival_index

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.policy == "priority":
            self._make_room_for_higher_priority(out)
        self.running.sort(key=self.rank)
        served: set[str] = set()
        budget = self.config.max_num_tokens
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        for seq in decodes:
            if seq.status is not Status.RUNNING or budget <= 0:
                continue
            if seq.draft_token_ids and self._speculate(seq, budget, served, out):
                budget -= 1 + len(seq.draft_token_ids)
                continue
            seq.draft_token_ids = []
            if self._grow(seq, 1, served, out):
                budget -= 1
        preempted_here = len(out.preempted)
        cap = self.config.max_prefill_chunk_with_decodes if decodes else None
        prefills = sorted([s for s in self.running if s.request_id not in served] + self.waiting, key=self.rank)
        admitting = True
        for seq in prefills:
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, cap or budget)
            if seq.status is Status.RUNNING:
                if self._grow(seq, n, served, out):
                    budget -= n
            elif seq.status is Status.WAITING and admitting and len(out.preempted) == preempted_here \
                    and self._adapter_fits(seq):
                taken = self._admit(seq, budget, cap, out)
                admitting = taken > 0
                budget -= taken
        return out

    def _grow(self, seq: Sequence, n: int, served: set[str], out: SchedulerOutput) -> bool:
        """Schedule n more tokens of running `seq`, preempting the lowest-ranked running sequence not yet served
        while the pool is short; False when `seq` itself was that one."""
        while self.blocks.allocate_slots(seq.request_id, seq.num_computed_tokens + n, seq.token_ids) is None:
            victim = max((s for s in self.running if s.request_id not in served), key=self.rank)
            self._preempt(victim, out)
            if victim is seq:
                return False
        served.add(seq.request_id)
        out.chunks.append(self._take(seq, n))
        return True

    def _speculate(self, seq: Sequence, budget: int, served: set[str], out: SchedulerOutput) -> bool:
        """Schedule decode `seq` with its drafts if the budget and the free blocks hold them all."""
        n = 1 + len(seq.draft_token_ids)
        if n > budget or self.blocks.allocate_slots(seq.request_id, seq.num_computed_tokens + n,
                                                    seq.token_ids) is None:
            return False
        served.add(seq.request_id)
        out.chunks.append(self._take(seq, 1, tuple(seq.draft_token_ids)))
        return True

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether `seq`'s LoRA adapter can be resident beside the running ones (max_loras slots); one that
        cannot waits while later requests are admitted, as vLLM does."""
        if not seq.lora_id:   # the common case: no set of the running adapters built per waiting request
            return True
        running = {s.lora_id for s in self.running if s.lora_id}
        return seq.lora_id in running or len(running) < self.config.max_loras

    def _admit(self, seq: Sequence, budget: int, cap: int | None, out: SchedulerOutput) -> int:
        """Start (or resume) waiting `seq` with its first chunk; the tokens it takes, 0 when it does not fit."""
        if len(self.running) >= self.config.max_batch_size:
            return 0
        hit = self.blocks.find_prefix(seq.token_ids, seq.cache_salt)
        n = min(seq.num_tokens - hit.num_tokens, budget, cap or budget)
        if self.blocks.allocate_slots(seq.request_id, hit.num_tokens + n, seq.token_ids, hit,
                                      seq.cache_salt) is None:
            return 0
        self.stats.prefix_cache_queries += seq.num_tokens
        self.stats.prefix_cache_hits += hit.num_tokens
        self.waiting.remove(seq)
        seq.status = Status.RUNNING
        seq.num_computed_tokens = hit.num_tokens
        seq.num_cached_tokens = hit.num_tokens
        self.running.append(seq)
        out.chunks.append(self._take(seq, n))
        return n

    def _make_room_for_higher_priority(self, out: SchedulerOutput) -> None:
        """Preempt the lowest-ranked running sequences for waiting ones that outrank them and lack a batch slot
        or the blocks of their first chunk (vLLM v0's priority preemption); at most one step's budget of them."""
        slots = self.config.max_batch_size - len(self.running)
        reserved = tokens = 0
        for seq in list(self.waiting):
            if tokens >= self.config.max_num_tokens:
                return
            while True:
                # a victim's freed blocks may hold the prefix
                hit = self.blocks.find_prefix(seq.token_ids, seq.cache_salt)
                first = min(seq.num_tokens - hit.num_tokens, self.config.max_num_tokens)
                need = self.blocks.num_blocks_needed(hit.num_tokens + first, hit)
                if slots >= 1 and need + reserved <= self.blocks.num_free_blocks:
                    break
                victim = max(self.running, key=self.rank, default=None)
                if victim is None or self.rank(victim) <= self.rank(seq):
                    return
                self._preempt(victim, out)
                slots += 1
            slots -= 1
            reserved += need
            tokens += first

    def _take(self, seq: Sequence, n: int, drafts: tuple[int, ...] = ()) -> ScheduledChunk:
        start = seq.num_computed_tokens
        chunk = ScheduledChunk(seq=seq, start_pos=start, num_new_tokens=n, want_logits=start + n == seq.num_tokens,
                               draft_token_ids=drafts)
        # Counted as computed once scheduled (vLLM v1): the engine step that follows writes their K/V. Drafts are
        # not: the engine core counts the accepted ones after verifying them (EngineCore._commit).
        seq.num_computed_tokens += n
        return chunk

    def _enqueue(self, seq: Sequence) -> None:
        keys = [self.rank(s) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, self.rank(seq)), seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self._enqueue(seq)
        out.preempted.append(seq)
        self.stats.num_preemptions += 1

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End `seq` (stopped, length, aborted) and return its blocks to the pool now."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)
        seq.finish(reason, stop_reason)
