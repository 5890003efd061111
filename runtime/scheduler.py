"""The continuous-batching scheduler: which sequences run in the next engine step, and how many tokens each.

There is no prefill phase nor decode phase (vLLM v1's model): each sequence has num_computed_tokens and
num_tokens, and each step brings some sequences' num_computed_tokens closer to their num_tokens. A step fills a
token budget (max_num_tokens) over at most max_batch_size sequences:

  1. running sequences first, in arrival order: their remaining tokens (1 for a decode, the rest of the prompt for
     a chunked prefill), cut to the budget left;
  2. then waiting sequences (new prompts, or preempted ones to recompute), FCFS, while the budget and the batch
     size allow; a prompt longer than the budget left is chunked, its next chunk runs in the next step.

A sequence needs KV blocks for every token it computes. When the pool runs out, the latest-arrived running
sequence is preempted by recompute: its blocks are freed, num_computed_tokens drops to 0 and it goes back to the
front of the waiting queue with its prompt and everything it generated, to be recomputed when blocks free up.
Finished sequences free their blocks at once (`finish`), so a waiting prompt can take them in the next step.

The block manager is reached only through allocate_slots / free / block_table (small result types), so priorities
and prefix caching can be added here and there independently.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import FinishReason, Sequence, Status


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int     # sequences per step
    max_num_tokens: int     # tokens per step (the engine's build limit)


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start_pos, start_pos + num_new_tokens) of `seq` run in this step; want_logits when the chunk
    reaches the sequence's last token (only then does the step yield its next token)."""
    seq: Sequence
    start_pos: int
    num_new_tokens: int
    want_logits: bool

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start_pos:self.start_pos + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        # The caller checked that the sequence fits the pool on its own (LLM checks max_seq_len at load).
        assert self.blocks.blocks_for(seq.num_prompt_tokens + seq.max_tokens) <= self.blocks.num_blocks
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            assert n > 0, (seq.request_id, seq.num_tokens, seq.num_computed_tokens)
            while self.blocks.allocate_slots(seq.request_id, seq.num_computed_tokens + n) is None:
                victim = self.running[-1]   # latest arrival; never one already scheduled (those are before i)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.chunks.append(self._take(seq, n))
                budget -= n
                i += 1
                continue
            break   # seq itself was preempted: everything after it is gone too
        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
                seq = self.waiting[0]
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                if self.blocks.allocate_slots(seq.request_id, seq.num_computed_tokens + n) is None:
                    break
                self.waiting.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
                out.chunks.append(self._take(seq, n))
                budget -= n
        return out

    def _take(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        chunk = ScheduledChunk(seq=seq, start_pos=start, num_new_tokens=n, want_logits=start + n == seq.num_tokens)
        # Counted as computed once scheduled (vLLM v1): the engine step that follows writes their K/V.
        seq.num_computed_tokens += n
        return chunk

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End `seq` (stopped, length, aborted) and return its blocks to the pool now."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.request_id)
        seq.finish(reason, stop_reason)
