"""SamplingParams: how one request is sampled and when it stops; validated once, at construction.

Defaults follow vLLM and the OpenAI API: temperature 1.0, no top-k / top-p / min-p, no penalties, 16 new tokens.
Every bad value raises EngineError(usage=True) naming the value and the accepted range, so the CLI exits 2.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.errors import EngineError

from .structured.spec import StructuredOutputs

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0              # 0 = greedy (argmax after penalties)
    top_k: int = 0                        # 0 = off
    top_p: float = 1.0                    # 1 = off
    min_p: float = 0.0                    # 0 = off; keeps tokens with p >= min_p * max p
    repetition_penalty: float = 1.0       # 1 = off; > 1 discourages tokens of the prompt and the output
    presence_penalty: float = 0.0         # 0 = off; subtracted once from tokens already generated
    frequency_penalty: float = 0.0        # 0 = off; subtracted per occurrence among generated tokens
    seed: int | None = None               # per-request generator; None draws from OS entropy
    max_tokens: int = 16                  # new tokens; clipped to max_seq_len - prompt length (with a warning)
    min_tokens: int = 0                   # eos and stop_token_ids are ignored before this many new tokens
    stop: tuple[str, ...] = ()            # stop strings, matched across token boundaries
    stop_token_ids: tuple[int, ...] = ()  # stop when one of these is sampled (in addition to eos)
    ignore_eos: bool = False              # keep generating past the model's eos ids
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True      # in the output text (token ids are always complete)
    logprobs: int | None = None           # None = off; N = the sampled token's logprob and the top N
    structured_outputs: StructuredOutputs | None = None   # constrain the output (a dict in vLLM's spelling works)

    def __post_init__(self):
        # Accept lists and a lone string for the tuple fields; the object stays frozen and hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        object.__setattr__(self, "structured_outputs", StructuredOutputs.of(self.structured_outputs))
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               f"temperature {self.temperature!r} must be >= 0 (0 = greedy)")
        _check(_is_int(self.top_k) and self.top_k >= 0, f"top_k {self.top_k!r} must be an integer >= 0 (0 = off)")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
               f"top_p {self.top_p!r} must be in (0, 1] (1 = off)")
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1,
               f"min_p {self.min_p!r} must be in [0, 1] (0 = off)")
        _check(isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0,
               f"repetition_penalty {self.repetition_penalty!r} must be > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(isinstance(v, (int, float)) and -2 <= v <= 2, f"{name} {v!r} must be in [-2, 2] (0 = off)")
        _check(self.seed is None or _is_int(self.seed), f"seed {self.seed!r} must be an integer or None")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens {self.max_tokens!r} must be >= 1")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens {self.min_tokens!r} must be in [0, max_tokens={self.max_tokens}]")
        for s in self.stop:
            _check(isinstance(s, str) and s != "", f"stop string {s!r} must be a non-empty string")
        for t in self.stop_token_ids:
            _check(t >= 0, f"stop token id {t} must be >= 0")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs {self.logprobs!r} must be None or an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise EngineError(f"invalid sampling parameter: {message}", usage=True)


@dataclass(frozen=True)
class Logprob:
    """The logprob of the sampled token and the top-N alternatives (token id -> logprob), of one position."""
    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
