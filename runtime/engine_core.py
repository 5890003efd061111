"""One engine step at a time: (propose) -> schedule -> run the session -> sample -> detokenize -> stop checks.

A request with a structured output (structured/) has a grammar matcher: the step's allowed-token masks are computed
on a worker thread while the session runs, applied by the sampler, and every committed token advances the matcher;
a grammar that is complete finishes the request (finish_reason "stop").

With a speculator (speculative/), a step first gives decoding sequences drafts of their next tokens, runs each
with its drafts, and keeps the accepted prefix plus one token (several tokens a step; _verify_step).

Single-threaded by design; llm.py drives it either inline (sync generate) or from one background thread (async
streaming). It owns the requests in flight; it does not tokenize prompts (llm.py does) nor size the pool.

`stream_interval` N (SGLang's and TensorRT-LLM's `stream_interval`, vLLM's `--stream-interval`): a request's
first token, its finish and then every N-th token make an output, whose delta holds the tokens since the last one.
N = 1 (the default) reports every token; a larger N trades inter-token smoothness for less per-output work (the
server's SSE chunk and socket write, the reader's wake-up), which matters with many streams on few cores.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np

from engine.core.errors import EngineError

from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .lora.manager import LoraManager
from .outputs import EngineStats, RequestMetrics, RequestOutput
from .sampler import SamplingRow, sample
from .sampling_params import Logprob
from .scheduler import Scheduler, SchedulerConfig
from .sequence import FinishReason, Sequence
from .sequence_state import SequenceState, resumable
from .speculative import Speculator, verify
from .structured import GrammarBackend, MaskRequest, consume, valid_prefix
from .step_inputs import SeqChunk
from .tokenizer import Tokenizer

log = logging.getLogger("engine.runtime")


def check_stream_interval(n: int) -> None:
    if n < 1:
        raise EngineError(f"--stream-interval {n} must be >= 1 (1 reports every token)", usage=True)


@dataclass
class _Request:
    seq: Sequence
    prompt: str | None
    detok: IncrementalDetokenizer
    logprobs: list[Logprob] | None
    emitted_tokens: int = 0            # output tokens already reported in a delta


@dataclass
class StepStats:
    """Counters since the engine started, for metrics and tests."""
    num_steps: int = 0
    num_preempted: int = 0              # preemptions since start
    max_seqs_per_step: int = 0
    max_tokens_per_step: int = 0


class EngineCore:
    def __init__(self, session, tokenizer: Tokenizer, eos_token_ids: Seq[int], *, scheduler: SchedulerConfig,
                 tokens_per_block: int, vocab_size: int, enable_prefix_caching: bool = True,
                 stream_interval: int = 1, speculator: Speculator | None = None,
                 grammars: GrammarBackend | None = None, loras: LoraManager | None = None):
        self.session = session
        self.loras = loras
        self.grammars = grammars
        self.speculator = speculator
        self.stream_interval = stream_interval
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.vocab_size = vocab_size
        self.blocks = BlockManager(session.num_blocks, tokens_per_block, enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(scheduler, self.blocks)
        self.requests: dict[str, _Request] = {}
        self.stats = StepStats()

    def add_request(self, seq: Sequence, prompt: str | None = None) -> None:
        if seq.request_id in self.requests:
            raise EngineError(f"request id {seq.request_id!r} is already in flight; use a unique id")
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params)
        req = _Request(seq, prompt, detok, [] if seq.params.logprobs is not None else None)
        if seq.num_output_tokens:
            self._replay(req)
        self.requests[seq.request_id] = req
        self.scheduler.add(seq)

    def _replay(self, req: _Request) -> None:
        """A resumed sequence (sequence_state.py) arrives with generated tokens: feed them to its detokenizer as
        _check_stop did, one at a time (none of them stopped it), so its text and held-back text are as before."""
        seq = req.seq
        if seq.matcher is not None:
            consume(seq.matcher, seq.output_token_ids)
        for k, tok in enumerate(seq.output_token_ids):
            req.detok.update([tok], check_stop=k + 1 >= seq.params.min_tokens)
        req.detok.take_delta(finished=False)
        req.emitted_tokens = seq.num_output_tokens

    def snapshot(self) -> list[SequenceState]:
        """The resumable state of every request in flight; call it between steps."""
        return [SequenceState.capture(r.seq) for r in self.requests.values() if resumable(r.seq.params)]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def engine_stats(self) -> EngineStats:
        """A snapshot of the scheduler's queues, the KV pool and the counters (plain reads: a caller on another
        thread may see a step half done, which gauges and counters tolerate)."""
        sched, blocks = self.scheduler, self.blocks
        return EngineStats(running=len(sched.running), waiting=len(sched.waiting), kv_usage=blocks.usage,
                           num_blocks=blocks.num_blocks, num_free_blocks=blocks.num_free_blocks,
                           num_cached_blocks=blocks.pool.num_cached, num_touched_blocks=blocks.pool.num_touched,
                           preemptions=sched.stats.num_preemptions,
                           prefix_cache_queries=sched.stats.prefix_cache_queries,
                           prefix_cache_hits=sched.stats.prefix_cache_hits, num_steps=self.stats.num_steps,
                           speculation=self.speculator.stats.copy() if self.speculator is not None else None,
                           running_loras=_adapters(sched.running), waiting_loras=_adapters(sched.waiting))

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req.seq, FinishReason.ABORT)
        return self._output(req)

    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
            for seq in self.scheduler.running:   # a grammar's matcher checks drafts: only allowed ones are verified
                if seq.matcher is not None and seq.draft_token_ids:
                    del seq.draft_token_ids[valid_prefix(seq.matcher, seq.draft_token_ids):]
        sched = self.scheduler.schedule()
        st = self.stats
        st.num_steps += 1
        st.num_preempted += len(sched.preempted)
        st.max_seqs_per_step = max(st.max_seqs_per_step, len(sched.chunks))
        st.max_tokens_per_step = max(st.max_tokens_per_step, sched.num_tokens)
        for seq in self.scheduler.running:   # drafts the scheduler did not take are dropped; taken ones are in chunks
            seq.draft_token_ids = []
        aborted = self._drop_unreadable_adapters(sched) if self.loras is not None else []
        if not sched.chunks:
            return aborted
        lora_ids = [c.seq.lora_id for c in sched.chunks]
        slots = self.loras.slots_for(lora_ids) if any(lora_ids) else lora_ids   # the scheduler kept them <= max_loras
        chunks = [SeqChunk(token_ids=c.token_ids, start_pos=c.start_pos,
                           block_table=list(self.blocks.block_table(c.seq.request_id)),
                           num_logits=c.num_logits, lora_slot=slot) for c, slot in zip(sched.chunks, slots)]
        scored = [c for c in sched.chunks if c.want_logits]
        constrained = [i for i, c in enumerate(scored) if c.seq.matcher is not None]
        masks = self.grammars.start_masks([MaskRequest(scored[i].seq.matcher, scored[i].draft_token_ids)
                                           for i in constrained]) if constrained else None
        logits = self.session.run(chunks, copy=False)   # sampled before the next run overwrites it
        allowed = self._allowed_rows(scored, constrained, masks.result()) if masks else [None] * len(scored)
        assert logits.shape[0] == sum(c.num_logits for c in scored), (logits.shape, len(scored))
        logits = np.asarray(logits)[:, :self.vocab_size]
        if any(c.draft_token_ids for c in scored):
            return aborted + self._verify_step(scored, logits, allowed)
        result = sample(logits, [self._row(c.seq, _first(a)) for c, a in zip(scored, allowed)])
        outputs = []
        for c, tok, lp in zip(scored, result.token_ids, result.logprobs):
            self._commit(c.seq, [int(tok)], [lp])
            if self._due(self.requests[c.seq.request_id]):
                outputs.append(self._output(self.requests[c.seq.request_id]))
        return aborted + outputs

    def _drop_unreadable_adapters(self, sched) -> list[RequestOutput]:
        """Abort the scheduled requests whose LoRA adapter can no longer be read (an evicted adapter's directory
        gone): they cannot run as asked, and the others must not stop with them. Their final outputs."""
        failed = self.loras.unreadable([c.seq.lora_id for c in sched.chunks])
        if not failed:
            return []
        outputs = []
        for c in [c for c in sched.chunks if c.seq.lora_id in failed]:
            log.error("request %s aborted: %s", c.seq.request_id, failed[c.seq.lora_id])
            self.scheduler.finish(c.seq, FinishReason.ABORT)
            outputs.append(self._output(self.requests[c.seq.request_id]))
        sched.chunks = [c for c in sched.chunks if c.seq.lora_id not in failed]
        return outputs

    @staticmethod
    def _allowed_rows(scored, constrained: list[int], masks: np.ndarray) -> list[np.ndarray | None]:
        """Per scored chunk: its rows of the step's grammar masks (one per logits row), or None."""
        allowed: list[np.ndarray | None] = [None] * len(scored)
        start = 0
        for i in constrained:
            allowed[i] = masks[start:start + scored[i].num_logits]
            start += scored[i].num_logits
        return allowed

    def _verify_step(self, scored, logits: np.ndarray, allowed: list) -> list[RequestOutput]:
        """A step with speculated tokens: sequences without drafts sample as usual (one batch), each with drafts
        keeps its accepted prefix plus one token (speculative/verify.py) and gives back the KV blocks past it."""
        starts = np.cumsum([0] + [c.num_logits for c in scored])
        plain = [i for i, c in enumerate(scored) if not c.draft_token_ids]
        tokens = {}
        if plain:
            result = sample(logits[starts[plain]], [self._row(scored[i].seq, _first(allowed[i])) for i in plain])
            tokens = {i: ([int(t)], [lp]) for i, t, lp in zip(plain, result.token_ids, result.logprobs)}
        outputs = []
        for i, c in enumerate(scored):
            seq = c.seq
            if c.draft_token_ids:
                verdict = verify(logits[starts[i]:starts[i + 1]], c.draft_token_ids, self._row(seq),
                                 lambda n, s=seq: self._banned(s, n), allowed[i])
                self.speculator.record(seq.request_id, len(c.draft_token_ids), verdict.accepted)
                tokens[i] = (verdict.token_ids, verdict.logprobs)
            self._commit(seq, *tokens[i])
            if c.draft_token_ids and not seq.is_finished:
                # the accepted drafts' K/V are in place; the last token runs next step
                seq.num_computed_tokens = seq.num_tokens - 1
                self.blocks.trim(seq.request_id, seq.num_tokens)
            if self._due(self.requests[seq.request_id]):
                outputs.append(self._output(self.requests[seq.request_id]))
        return outputs

    def _row(self, seq: Sequence, allowed: np.ndarray | None = None) -> SamplingRow:
        return SamplingRow(params=seq.params, prompt_token_ids=seq.prompt_token_ids,
                           output_token_ids=seq.output_token_ids, generator=seq.generator,
                           banned_token_ids=self._banned(seq), allowed=allowed)

    def _commit(self, seq: Sequence, tokens: list[int], logprobs: list) -> None:
        """Append a step's tokens to `seq` one at a time, each checked for a stop; those after a stop are dropped."""
        req = self.requests[seq.request_id]
        for tok, lp in zip(tokens, logprobs):
            seq.append_token(tok)
            if req.logprobs is not None:
                req.logprobs.append(lp)
            self._check_stop(req, tok)
            if seq.matcher is not None and consume(seq.matcher, [tok]) and not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.STOP)    # the grammar is complete: nothing may follow
            if seq.is_finished:
                break

    def _due(self, req: _Request) -> bool:
        """Whether this step reports the request: its first token, its finish, or stream_interval new tokens."""
        seq = req.seq
        return (seq.is_finished or req.emitted_tokens == 0
                or seq.num_output_tokens - req.emitted_tokens >= self.stream_interval)

    def _banned(self, seq: Sequence, num_output_tokens: int | None = None) -> list[int]:
        """Token ids the sampler may not choose once `num_output_tokens` (default: the sequence's) were generated."""
        if (seq.num_output_tokens if num_output_tokens is None else num_output_tokens) >= seq.params.min_tokens:
            return []
        ids = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else set(self.eos_token_ids))
        return sorted(t for t in ids if t < self.vocab_size)

    def _check_stop(self, req: _Request, tok: int) -> None:
        seq, p = req.seq, req.seq.params
        past_min = seq.num_output_tokens >= p.min_tokens
        is_eos = tok in self.eos_token_ids and not p.ignore_eos
        is_stop_id = tok in p.stop_token_ids
        stop_string = req.detok.update([tok], stop_terminated=past_min and (is_eos or is_stop_id),
                                       check_stop=past_min)
        if past_min and is_eos:
            self.scheduler.finish(seq, FinishReason.STOP)
        elif past_min and is_stop_id:
            self.scheduler.finish(seq, FinishReason.STOP, tok)
        elif past_min and stop_string is not None:
            self.scheduler.finish(seq, FinishReason.STOP, stop_string)
        elif seq.num_output_tokens >= seq.max_tokens:
            self.scheduler.finish(seq, FinishReason.LENGTH)

    def _output(self, req: _Request) -> RequestOutput:
        seq = req.seq
        finished = seq.is_finished
        if finished:
            del self.requests[seq.request_id]
            if self.speculator is not None:
                self.speculator.forget(seq.request_id)
        out_ids = seq.output_token_ids
        delta_ids = out_ids[req.emitted_tokens:]
        req.emitted_tokens = len(out_ids)
        delta_text = req.detok.take_delta(finished=finished)
        return RequestOutput(
            request_id=seq.request_id, prompt=req.prompt, prompt_token_ids=list(seq.prompt_token_ids),
            text=req.detok.emitted_text, token_ids=list(out_ids), delta_text=delta_text,
            delta_token_ids=list(delta_ids), finished=finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None, stop_reason=seq.stop_reason,
            metrics=RequestMetrics(arrival_time=seq.arrival_time, first_token_time=seq.first_token_time,
                                   finish_time=seq.finish_time, num_preemptions=seq.num_preemptions,
                                   num_cached_tokens=seq.num_cached_tokens),
            logprobs=list(req.logprobs) if req.logprobs is not None else None)


def _adapters(seqs: list[Sequence]) -> tuple[str, ...]:
    return tuple(sorted({s.lora_name for s in list(seqs) if s.lora_name}))


def _first(rows: np.ndarray | None) -> np.ndarray | None:
    """A chunk's first mask row (its next token's), or None when it is not constrained."""
    return None if rows is None else rows[0]
