"""The checks a request passes before it queues (LLM.make_sequence): priority under the scheduling policy, the
prompt's length and token ids against the engine's build limits, and max_tokens clipped to max_seq_len."""
from __future__ import annotations

import logging

import numpy as np

from engine.core.engine_format import EngineConfig
from engine.core.errors import EngineError

from .sampling_params import SamplingParams

log = logging.getLogger("engine.runtime")


def check_request(config: EngineConfig, policy: str, ids: list[int], params: SamplingParams, priority) -> int:
    """EngineError for a request the engine cannot take; else its max_tokens, clipped to what max_seq_len leaves
    (with a warning on the `engine.runtime` logger)."""
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise EngineError(f"priority {priority!r} must be an integer (lower runs first)")
    if priority != 0 and policy != "priority":
        raise EngineError(f"priority {priority} needs the priority scheduling policy, but this engine runs "
                          f"{policy!r} (every request in arrival order, priority 0); start it "
                          "with scheduling_policy='priority' (--scheduling-policy priority) or drop the priority")
    b, vocab = config.build, config.model.vocab_size
    if not ids:
        raise EngineError("the prompt is empty (0 tokens); give at least one token of text")
    limit = min(b.max_input_len, b.max_seq_len - 1)
    if len(ids) > limit:
        raise EngineError(f"the prompt has {len(ids)} tokens, more than this engine takes: max_input_len "
                          f"{b.max_input_len}, and the maximum context length is {b.max_seq_len} tokens "
                          f"(prompt + output); shorten the prompt or rebuild with larger --max-input-len / "
                          f"--max-seq-len")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise EngineError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if len(ids) + params.max_tokens <= b.max_seq_len:
        return params.max_tokens
    max_tokens = b.max_seq_len - len(ids)
    log.warning("max_tokens %d with a %d-token prompt exceeds max_seq_len %d; generating at most %d tokens",
                params.max_tokens, len(ids), b.max_seq_len, max_tokens)
    return max_tokens
