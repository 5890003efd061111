"""The state of one request as the scheduler sees it: its tokens and how many are already in the KV pool.

There is no prefill or decode phase: the tokens from num_computed_tokens to num_tokens still have to run
through the engine (the whole prompt at first, less what the prefix cache holds; one sampled token later;
everything again after preemption). Its rank in the scheduler's queues is (priority, arrival_index).
It knows nothing of blocks (block_manager.py) nor of text (detokenizer.py).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # eos, a stop token id or a stop string
    LENGTH = "length"    # max_tokens (or max_seq_len) reached
    ABORT = "abort"      # cancelled by the caller (e.g. a client disconnected)


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                       # params.max_tokens clipped to the room left by max_seq_len
    priority: int = 0                     # lower runs first under the priority policy (always 0 under fcfs)
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_index: int = 0                # order of arrival at the scheduler; breaks priority ties
    token_ids: list[int] = field(default_factory=list)   # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0            # tokens found in the prefix cache at its (latest) admission
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: np.random.Generator = field(default=None)  # type: ignore[assignment]
    # tokens speculated to follow token_ids (runtime/speculative/), set before a step and verified after it;
    # never part of token_ids until accepted
    draft_token_ids: list[int] = field(default_factory=list)
    # the llguidance matcher of a structured output (runtime/structured/), at the tokens committed so far
    matcher: object = None
    lora_name: str | None = None          # the LoRA adapter it runs with (runtime/lora/), None: the base model
    lora_id: int = 0                      # that adapter's registration (a re-added name gets a new id), 0: none

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.generator is None:
            # Unseeded requests draw from OS entropy; a seed makes the request reproducible whatever its batch.
            self.generator = np.random.default_rng(self.params.seed)

    @property
    def cache_salt(self) -> bytes:
        """Where its prefix-cache hash chain starts: blocks computed with an adapter hold other K/V."""
        return f"lora:{self.lora_id}".encode() if self.lora_id else b""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.monotonic()
