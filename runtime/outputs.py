"""What a request gives back: RequestOutput (cumulative text and tokens, plus the delta since the last one);
and what the engine reports about itself: EngineStats (`LLM.stats()`, read by the server's /metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .sampling_params import Logprob
from .speculative.speculator import SpecDecodeStats


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float                  # time.monotonic() seconds
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0
    num_cached_tokens: int = 0           # prompt tokens found in the prefix cache (not computed again)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token (queueing and prefill included)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None                   # None when the request was given as token ids
    prompt_token_ids: list[int]
    text: str                            # all output text so far (cut before a stop string)
    token_ids: list[int]                 # all generated token ids so far (eos / stop token included)
    delta_text: str                      # text new since the previous output of this request
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None            # "stop" | "length" | "abort" once finished
    stop_reason: str | int | None        # the stop string or stop token id that matched (None for eos)
    metrics: RequestMetrics
    logprobs: list[Logprob] | None = field(default=None)  # one per generated token when asked for

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def time_to_first_token(self) -> float | None:
        return self.metrics.time_to_first_token

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Generated tokens after the first, per second after the first (None until finished or for one token)."""
        m = self.metrics
        if m.finish_time is None or m.first_token_time is None or self.num_generated_tokens < 2:
            return None
        span = m.finish_time - m.first_token_time
        return (self.num_generated_tokens - 1) / span if span > 0 else None


@dataclass(frozen=True)
class EngineStats:
    """The scheduler's queues, the KV pool and counters since start, under the names /metrics reads."""
    running: int                         # requests holding KV blocks (scheduled in steps)
    waiting: int                         # requests queued: new, or preempted to be recomputed
    kv_usage: float                      # fraction of KV blocks held by requests, 0..1 (cached free ones are free)
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int               # blocks named in the prefix cache, held or free
    num_touched_blocks: int              # blocks that have held KV since start (their memory is resident)
    preemptions: int                     # recompute preemptions since start
    prefix_cache_queries: int            # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hits: int               # of those, tokens found (not computed)
    num_steps: int
    speculation: SpecDecodeStats | None = None   # drafts proposed and accepted, with speculative decoding
    running_loras: tuple[str, ...] = ()   # the LoRA adapters of the running requests, and of the waiting ones
    waiting_loras: tuple[str, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
