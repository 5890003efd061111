"""The Python API: `LLM(engine_dir).generate(prompts, params)`, streaming, and an async generator for the server.

    llm = LLM("engine_dir")
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    async for out in llm.generate_async("Hello", params): print(out.delta_text, end="")
    LLM("engine_dir", scheduling_policy="priority").generate_async(prompt, params, request_id="a", priority=-1)
    llm.stats()    # running / waiting requests, KV usage, preemptions, prefix-cache queries and hits
    states = llm.snapshot(); llm2.resume_async(states[0])   # checkpoint / resume (sequence_state.py)

The engine core is single-threaded. Sync calls (generate, chat, stream) drive it in the calling thread; the
async API starts one background engine thread, and from then on every call (sync ones too) submits requests to
that thread, so requests from any thread batch together (engine_thread.py).

Limits are checked when a request is made, before it queues: an empty prompt or one that leaves no room under
max_input_len / max_seq_len, or a non-zero priority under the fcfs policy, raises EngineError naming the limit;
max_tokens beyond max_seq_len - prompt length is clipped to it with a warning on the `engine.runtime` logger
(the request still runs).
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence as Seq, Union

from engine.core.errors import EngineError

from .engine_core import EngineCore, check_stream_interval
from .engine_dir import load_engine_config
from .kv_budget import DEFAULT_KV_CACHE_MEM_FRACTION, KVPlan, plan_kv_cache
from .engine_thread import EngineLoopStopped, EngineThread
from .loop_sink import LoopSink
from .lora import LoraConfig, LoraManager
from .outputs import EngineStats, RequestOutput
from .sampling_params import SamplingParams
from .request_limits import check_request
from .scheduler import DEFAULT_MAX_PREFILL_CHUNK_WITH_DECODES, SchedulerConfig
from .sequence import Sequence
from .sequence_state import SequenceState
from .speculative import SpeculativeConfig, make_speculator
from .structured import GrammarBackend
from .tokenizer import Tokenizer

log = logging.getLogger("engine.runtime")
__all__ = ["LLM", "EngineLoopStopped"]

Prompt = Union[str, Seq[int]]          # text, or token ids used as they are


class LLM:
    """An engine, its KV pool and its scheduler.

    KV pool size, first match: `max_kv_tokens`, `kv_cache_memory_bytes`, else `kv_cache_mem_fraction` of the
    memory available after the weights; it must hold one max_seq_len request (else EngineError naming the largest
    max_seq_len that fits). `scheduling_policy` "fcfs" (arrival order; every priority must be 0) or "priority"
    (lower `priority` first, ties by arrival). `enable_prefix_caching` (default on) shares the KV blocks of common
    prompt prefixes. `max_prefill_chunk_with_decodes` caps a prefill chunk in a step that also runs decodes
    (None: no cap), so that a long prompt does not slow every decode of its steps (bench/scheduler_policies.py measures
    the trade-off). `max_num_tokens` / `max_batch_size`: the per-step token budget and sequence count, at most
    (and by default) the engine's build limits. `stream_interval` N: a request reports its first token, then every
    N-th and its finish, each output's delta holding the tokens since the last (engine_core.py; default 1).
    `speculative_config` (vLLM's: a dict or SpeculativeConfig, e.g. {"method": "ngram", "num_speculative_tokens":
    4}): decoding proposes k tokens a step and keeps what the engine confirms (speculative/). `lora_config` (a
    dict or lora.LoraConfig: max_loras, max_lora_rank, max_cpu_loras, modules) serves LoRA adapters on an engine
    built with --lora-target-modules; `self.loras` adds and removes them, requests name one (lora=).
    `max_sequences`: the most sequences this LLM will run at once when fewer than max_batch_size (`engine run`
    knows its prompts); the pool is then no larger than they can use. `tokenizer`: this engine's Tokenizer, already
    loaded (a server that reloads an engine keeps it: parsing tokenizer.json holds the GIL, stalling the server's
    other streams)."""

    def __init__(self, engine_dir: Path | str, *, kv_cache_mem_fraction: float = DEFAULT_KV_CACHE_MEM_FRACTION,
                 max_kv_tokens: int | None = None, threads: int | None = None,
                 kv_cache_memory_bytes: int | None = None, enable_prefix_caching: bool = True,
                 scheduling_policy: str = "fcfs",
                 max_prefill_chunk_with_decodes: int | None = DEFAULT_MAX_PREFILL_CHUNK_WITH_DECODES,
                 max_num_tokens: int | None = None, max_batch_size: int | None = None, stream_interval: int = 1,
                 distributed=None, speculative_config: SpeculativeConfig | dict | None = None,
                 max_sequences: int | None = None, lora_config: LoraConfig | dict | None = None,
                 tokenizer: Tokenizer | None = None):
        from .session import EngineSession  # onnxruntime is imported only when an engine is really loaded
        self.engine_dir = Path(engine_dir)
        self.config = load_engine_config(self.engine_dir)
        b = self.config.build
        for name, value, limit in (("max-num-tokens", max_num_tokens, b.max_num_tokens),
                                   ("max-batch-size", max_batch_size, b.max_batch_size)):
            if value is not None and not 1 <= value <= limit:
                raise EngineError(f"--{name} {value} is outside [1, {limit}]: the engine was built for at most "
                                  f"{limit}; give a value in range, or rebuild with a larger --{name}", usage=True)
        check_stream_interval(stream_interval)
        speculative = SpeculativeConfig.of(speculative_config)
        if speculative is not None and b.backend == "tensorrt":
            raise EngineError(f"speculative decoding runs on onnxruntime engines; {self.engine_dir} is a TensorRT "
                              "engine (its optimization profiles bound the logits rows a step returns)", usage=True)
        lora = LoraConfig.of(lora_config)
        if lora is not None and not b.lora_target_modules:
            raise EngineError(f"{self.engine_dir} was built without LoRA support; rebuild it with `engine build "
                              "--lora-target-modules all` to serve adapters", usage=True)
        scheduler = SchedulerConfig(max_batch_size=max_batch_size or b.max_batch_size,
                                    max_num_tokens=max_num_tokens or b.max_num_tokens,
                                    policy=scheduling_policy,
                                    max_prefill_chunk_with_decodes=max_prefill_chunk_with_decodes,
                                    max_loras=lora.max_loras if lora else 0)
        # tokenizer.json (~0.15 s to parse) loads on another thread while the session loads the graph, which
        # releases the GIL: a cold start pays for the longer of the two, not both
        loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-tokenizer")
        parsing = loader.submit(Tokenizer, self.engine_dir) if tokenizer is None else None
        loader.shutdown(wait=False)
        self.kv_plan: KVPlan = plan_kv_cache(self.config, kv_cache_mem_fraction=kv_cache_mem_fraction,
                                             max_kv_tokens=max_kv_tokens, kv_cache_bytes=kv_cache_memory_bytes,
                                             max_sequences=min(filter(None, (max_batch_size, max_sequences)),
                                                               default=None))
        if self.config.mapping.world_size > 1:
            # torch, imported only for tensor-parallel engines; `distributed` (runtime/tp/distributed.py): None spawns
            # the other ranks here, else this process is rank 0 of ranks started elsewhere (torchrun-style)
            from .tp.session import TPSession
            self.session = TPSession(self.engine_dir, num_blocks=self.kv_plan.num_blocks, threads=threads,
                                     distributed=distributed)
        elif self.config.build.backend == "tensorrt":
            from .trt_session import TrtSession  # torch + tensorrt, imported only for TensorRT engines
            self.session = TrtSession(self.engine_dir, num_blocks=self.kv_plan.num_blocks)
        else:
            self.session = EngineSession(self.engine_dir, num_blocks=self.kv_plan.num_blocks, threads=threads)
        self.tokenizer = tokenizer if tokenizer is not None else parsing.result()
        # the adapters by name (runtime/lora/), on an engine built with LoRA inputs (their slots bound to them)
        self.loras = LoraManager(self.config, lora) if b.lora_target_modules else None
        if self.loras is not None:
            self.session.bind_lora(self.loras.slots.inputs())
        eos = self.config.generation.eos_token_ids
        if not eos and self.tokenizer.eos_token_id is not None:
            eos = (self.tokenizer.eos_token_id,)
        self.eos_token_ids = tuple(eos)
        self.grammars = GrammarBackend(self.tokenizer, self.config.model.vocab_size, self.eos_token_ids)
        self.core = EngineCore(self.session, self.tokenizer, self.eos_token_ids, scheduler=scheduler,
                               tokens_per_block=b.tokens_per_block, vocab_size=self.config.model.vocab_size,
                               enable_prefix_caching=enable_prefix_caching, stream_interval=stream_interval,
                               speculator=make_speculator(speculative, self.config, self.tokenizer, threads),
                               grammars=self.grammars, loras=self.loras)
        self._ids = itertools.count()
        self.engine_thread = EngineThread(self.core)

    # ---- making requests ---------------------------------------------------------------------------------

    @property
    def max_seq_len(self) -> int:
        return self.config.build.max_seq_len

    @property
    def scheduling_policy(self) -> str:
        return self.core.scheduler.config.policy

    def stats(self) -> EngineStats:
        """Queues, KV pool usage, preemptions and prefix-cache counters now (safe from any thread)."""
        return self.core.engine_stats()

    def make_sequence(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
                      priority: int = 0, lora: str | None = None) -> tuple[Sequence, str | None]:
        """Tokenize and check one request; raises EngineError for prompts the engine cannot take."""
        params = params or SamplingParams()
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if text is not None else [int(t) for t in prompt]
        max_tokens = check_request(self.config, self.scheduling_policy, ids, params, priority)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(request_id=rid, prompt_token_ids=ids, params=params, max_tokens=max_tokens,
                       priority=int(priority))
        if params.structured_outputs is not None:
            seq.matcher = self.grammars.matcher(params.structured_outputs)
        if lora is not None:
            seq.lora_name, seq.lora_id = lora, self._lora_manager().resolve(lora)
        return seq, text

    def _lora_manager(self) -> LoraManager:
        if self.loras is None or self.loras.options is None:
            raise EngineError("a request named a LoRA adapter, but this LLM has none: make it with lora_config "
                              "(engine run --lora, engine serve --lora-modules) on an engine built with "
                              "--lora-target-modules", usage=True)
        return self.loras

    def chat_prompt(self, messages: list[dict], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation under the engine's chat template."""
        return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)

    # ---- sync API ----------------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, priority: int | Seq[int] = 0, lora: str | None | Seq[str | None] = None) -> list[RequestOutput]:
        """Final outputs, in prompt order. All prompts run together (continuous batching); `priority`: one for
        all prompts or one each (priority policy only)."""
        final: dict[str, RequestOutput] = {}
        order = []
        for out in self.stream(prompts, params, request_ids=order, priority=priority, lora=lora):
            if out.finished:
                final[out.request_id] = out
        return [final[rid] for rid in order]

    def chat(self, conversations: list[dict] | Seq[list[dict]],
             params: SamplingParams | Seq[SamplingParams] | None = None, *,
             lora: str | None | Seq[str | None] = None) -> list[RequestOutput]:
        """generate() over conversations (lists of {"role", "content"}) rendered with the chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.chat_prompt(c) for c in conversations], params, lora=lora)

    def stream(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
               *, request_ids: list | None = None, priority: int | Seq[int] = 0,
               lora: str | None | Seq[str | None] = None) -> Iterator[RequestOutput]:
        """Every output of every prompt as it is produced (each carries its delta_text); all prompts run
        together. Every prompt is checked before any runs. `request_ids`, when given, receives the request
        ids in prompt order. `lora`: the LoRA adapter (by name, self.loras) of all prompts or of each."""
        prompts = _as_prompt_list(prompts)
        each = [_per_prompt(v, len(prompts), what) for v, what in ((params, "sampling params"),
                                                                   (priority, "priorities"), (lora, "LoRA names"))]
        seqs = [self.make_sequence(p, sp, priority=pr, lora=lo) for p, sp, pr, lo in zip(prompts, *each)]
        if request_ids is not None:
            request_ids.extend(s.request_id for s, _ in seqs)
        if not self.engine_thread.started():
            yield from self.engine_thread.drive(seqs)
            return
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        pending = {s.request_id for s, _ in seqs}
        for seq, text in seqs:
            self.engine_thread.submit(seq, text, inbox.put)
        try:
            while pending:
                item = inbox.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    pending.discard(item.request_id)
                yield item
        finally:
            for rid in pending:
                self.abort(rid)

    # ---- async API (background engine thread) ------------------------------------------------------------

    async def generate_async(self, prompt: Prompt, params: SamplingParams | None = None, *,
                             request_id: str | None = None, priority: int = 0,
                             lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced; leaving the iteration early aborts the request and
        frees its blocks (a client that disconnects)."""
        seq, text = self.make_sequence(prompt, params, request_id=request_id, priority=priority, lora=lora)
        async for out in self._run_async(seq, text):
            yield out

    async def resume_async(self, state: SequenceState) -> AsyncIterator[RequestOutput]:
        """generate_async for a sequence captured by snapshot() (maybe in another process): its prompt and
        generated tokens are recomputed and it continues as it would have; outputs carry the whole text."""
        seq, _ = self.make_sequence(state.prompt_token_ids, state.params, request_id=state.request_id,
                                    priority=state.priority, lora=state.lora_name)
        state.restore_into(seq)
        async for out in self._run_async(seq, None):
            yield out

    def snapshot(self, timeout: float = 60.0) -> list[SequenceState]:
        """The resumable state (sequence_state.py) of every request in flight, taken between two engine steps."""
        return self.engine_thread.snapshot(timeout)

    async def _run_async(self, seq: Sequence, text: str | None) -> AsyncIterator[RequestOutput]:
        import asyncio  # here, not at the top: `engine run` never needs it, and it costs ~70 ms of cold start

        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self.start()
        self.engine_thread.submit(seq, text, LoopSink(loop, q))
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(seq.request_id)

    def start(self) -> None:
        """Start the background engine thread (idempotent)."""
        self.engine_thread.start()

    def is_running(self) -> bool:
        """Whether the background engine thread is alive (False before start() and after it died or closed)."""
        return self.engine_thread.is_running()

    def abort(self, request_id: str) -> None:
        self.engine_thread.abort(request_id)

    def close(self) -> None:
        """Stop the background thread; requests still in flight end with finish_reason "abort"."""
        self.engine_thread.close()

    def check_all_free(self) -> None:
        """AssertionError unless no request is in flight and every KV block is back in the pool."""
        assert not self.core.requests, f"requests still in flight: {sorted(self.core.requests)}"
        self.core.blocks.check_all_free()


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]       # one prompt given as token ids
    return prompts


def _per_prompt(value, n: int, what: str) -> list:
    """One value for all n prompts, or one each."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise EngineError(f"{len(values)} {what} for {n} prompts; give one, or one each")
    return values
