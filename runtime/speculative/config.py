"""SpeculativeConfig: how a runtime speculates (`--speculative ngram|draft` and its options), validated once.

vLLM's `speculative_config` keys: method, num_speculative_tokens, prompt_lookup_min / max, and the draft engine's
directory (vLLM's `model`). The adaptive switches are this runtime's own (speculator.py says how they act).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from engine.core.errors import EngineError

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str                            # "ngram" (prompt lookup) or "draft" (a smaller engine proposes)
    num_speculative_tokens: int = 4        # k: tokens proposed a step
    prompt_lookup_min: int = 2             # ngram: the shortest suffix matched
    prompt_lookup_max: int = 4             # ngram: the longest suffix matched, tried first
    draft_engine_dir: Path | None = None   # draft: the engine that proposes (same tokenizer)
    draft_min_confidence: float = 0.0      # draft: stop a proposal at a token the draft gives less probability
    max_batch_size: int = 4                # no proposals in a step with more decodes than this
    # a verified draft token's cost, as a fraction of a plain decode step, for each sequence in the step (a step of
    # B decodes verifying k drafts each takes ~1 + verify_cost * k * B plain steps): 0.17-0.24 measured on
    # Qwen2.5-Coder-1.5B, B = 1-4 (bench/speculative.py's batch part, bench/NOTES.md entry 57)
    verify_cost: float = 0.2
    pause_steps: int = 16                  # steps a sequence whose drafts do not pay goes without proposing

    def __post_init__(self):
        _check(self.method in METHODS, f"--speculative {self.method!r} is not one of {', '.join(METHODS)}")
        _check(_is_int(self.num_speculative_tokens) and 1 <= self.num_speculative_tokens <= 16,
               f"--num-speculative-tokens {self.num_speculative_tokens!r} must be in [1, 16]")
        _check(_is_int(self.prompt_lookup_min) and _is_int(self.prompt_lookup_max)
               and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
               f"--prompt-lookup-min {self.prompt_lookup_min!r} and --prompt-lookup-max {self.prompt_lookup_max!r} "
               "must be integers with 1 <= min <= max")
        if self.method == "draft":
            _check(self.draft_engine_dir is not None, "--speculative draft needs --draft-engine-dir DIR")
            object.__setattr__(self, "draft_engine_dir", Path(self.draft_engine_dir))
        else:
            _check(self.draft_engine_dir is None,
                   f"--draft-engine-dir {self.draft_engine_dir} is for --speculative draft, not {self.method}")
        _check(isinstance(self.draft_min_confidence, (int, float)) and 0 <= self.draft_min_confidence < 1,
               f"speculative draft_min_confidence {self.draft_min_confidence!r} must be in [0, 1)")
        _check(_is_int(self.max_batch_size) and self.max_batch_size >= 1,
               f"speculative max_batch_size {self.max_batch_size!r} must be an integer >= 1")
        _check(isinstance(self.verify_cost, (int, float)) and self.verify_cost >= 0,
               f"speculative verify_cost {self.verify_cost!r} must be >= 0")
        _check(_is_int(self.pause_steps) and self.pause_steps >= 0,
               f"speculative pause_steps {self.pause_steps!r} must be an integer >= 0")

    @classmethod
    def of(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """LLM(speculative_config=...): a SpeculativeConfig, a dict of its fields (vLLM's form), or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise EngineError(f"speculative_config must be a dict or SpeculativeConfig, not {type(value).__name__}",
                              usage=True)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        _check(not unknown, f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        _check("method" in value, "speculative_config needs a method (ngram or draft)")
        return cls(**value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise EngineError(message, usage=True)
