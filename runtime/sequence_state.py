"""The resumable state of one sequence in flight, as plain JSON data: captured between engine steps, restored
into a fresh Sequence on another process.

What makes a resumed sequence continue exactly where it stopped:
  - its token ids (prompt + generated so far): the engine recomputes their KV (the scheduler's recompute path,
    as after a preemption), so nothing of the old KV pool is needed;
  - its SamplingParams and clipped max_tokens;
  - its numpy Generator's bit-generator state at that point: the sampler draws one number per sampled step
    (sampler.py), so the restored generator draws what the old one would have drawn next, seeded or not;
  - its detokenizer, rebuilt by replaying the generated tokens (detokenizer.py is deterministic over a token
    sequence), so stop strings spanning the checkpoint still match and the text is the same.
Greedy requests need only the tokens. Requests asking for logprobs are not captured (`resumable`): their
already-streamed logprobs cannot be rebuilt without recomputing them.

It knows nothing of files (server/state_file.py) or of HTTP (server/resume.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.core.errors import EngineError

from .sampling_params import SamplingParams
from .sequence import Sequence

_TUPLE_FIELDS = ("stop", "stop_token_ids")
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")   # numpy's; default_rng makes PCG64


def resumable(params: SamplingParams) -> bool:
    """Whether a request with these params can be checkpointed and resumed (see the module docstring)."""
    return params.logprobs is None


@dataclass(frozen=True)
class SequenceState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]        # generated so far; the last one has not been fed to the engine yet
    max_tokens: int                    # params.max_tokens clipped to the engine's max_seq_len
    priority: int
    params: SamplingParams
    rng_state: dict[str, Any]          # numpy bit_generator.state (JSON-safe: str and int values)
    lora_name: str | None = None       # its LoRA adapter, resolved by name again where it resumes

    @classmethod
    def capture(cls, seq: Sequence) -> "SequenceState":
        """A copy of `seq` now; call it between engine steps (the engine thread owns the sequence)."""
        return cls(request_id=seq.request_id, prompt_token_ids=list(seq.prompt_token_ids),
                   output_token_ids=list(seq.output_token_ids), max_tokens=seq.max_tokens, priority=seq.priority,
                   params=seq.params, rng_state=seq.generator.bit_generator.state, lora_name=seq.lora_name)

    @classmethod
    def at_start(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int, lora_name: str | None = None) -> "SequenceState":
        """A request before its first step, which a restart runs again from its prompt: its params must carry a
        seed, the only way to know the generator it will start from."""
        if params.seed is None:
            raise EngineError(f"request {request_id}: only a seeded request's start can be recorded")
        return cls(request_id=request_id, prompt_token_ids=list(prompt_token_ids), output_token_ids=[],
                   max_tokens=params.max_tokens, priority=priority, params=params,
                   rng_state=np.random.default_rng(params.seed).bit_generator.state, lora_name=lora_name)

    def restore_into(self, seq: Sequence) -> None:
        """Give a new Sequence (same prompt and params) this state's generated tokens and generator state."""
        assert seq.num_output_tokens == 0 and list(seq.prompt_token_ids) == self.prompt_token_ids
        name = seq.generator.bit_generator.state["bit_generator"]
        if self.rng_state.get("bit_generator") != name:
            raise EngineError(f"request {self.request_id}: saved generator {self.rng_state.get('bit_generator')!r} "
                              f"is not this runtime's {name!r}; the state was written by another version")
        max_tokens = min(self.max_tokens, seq.max_tokens)   # seq's is clipped to this engine's max_seq_len
        if len(self.output_token_ids) >= max_tokens:
            raise EngineError(f"request {self.request_id}: {len(self.output_token_ids)} tokens were generated but "
                              f"this engine allows {max_tokens}; resume it on an engine with its max_seq_len")
        seq.generator.bit_generator.state = self.rng_state
        seq.token_ids.extend(self.output_token_ids)
        seq.max_tokens = max_tokens

    def to_json(self) -> dict:
        params = dataclasses.asdict(self.params)
        for name in _TUPLE_FIELDS:
            params[name] = list(params[name])
        return {"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
                "output_token_ids": self.output_token_ids, "max_tokens": self.max_tokens,
                "priority": self.priority, "params": params, "rng_state": self.rng_state, "lora_name": self.lora_name}

    @classmethod
    def from_json(cls, d: dict) -> "SequenceState":
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = set(d["params"]) - known
        if unknown:
            raise EngineError(f"request {d['request_id']}: unknown sampling parameters {sorted(unknown)} in the "
                              "saved state (written by a newer version?)")
        params = SamplingParams(**d["params"])     # validated again, as any new request is
        return cls(request_id=str(d["request_id"]), prompt_token_ids=[int(t) for t in d["prompt_token_ids"]],
                   output_token_ids=[int(t) for t in d["output_token_ids"]], max_tokens=int(d["max_tokens"]),
                   priority=int(d["priority"]), params=params, rng_state=_rng_state(d["rng_state"]),
                   lora_name=d.get("lora_name"))


def _rng_state(state: dict) -> dict:
    """Check a saved bit-generator state by loading it into a generator of its kind (refuses garbage)."""
    kind = state.get("bit_generator") if isinstance(state, dict) else None
    if kind not in _BIT_GENERATORS:
        raise EngineError(f"the saved generator kind {kind!r} is not one of {', '.join(_BIT_GENERATORS)}; the state "
                          "file is damaged")
    try:
        bitgen = getattr(np.random, kind)()
        bitgen.state = state
    except Exception as e:  # noqa: BLE001 - numpy raises TypeError / ValueError / KeyError for bad states
        raise EngineError(f"the saved generator state is not valid ({e!r}); the state file is damaged") from None
    return bitgen.state
