"""Perplexity of an engine over token ids, and seeded sampling of text from an engine (for held-out text).

    ScoringSession(engine_dir, window)      its own ORT session of rank0.onnx; each window of token ids is one
        logits(ids) -> [len(ids), vocab]    fresh sequence at position 0, run as one prefill whose
                                            logits_indices name *every* packed token (the graph gathers those
                                            rows before the final norm and lm_head, so S = T works as is)
    perplexity(engine_dir, windows)         exp(mean NLL of token t+1 given tokens <= t), over all windows
    sample_tokens(engine_dir, ...)          seeded multinomial sampling (temperature 1) through EngineSession
    sample_scored(engine_dir, ...)          the same, with the sampling engine's perplexity over what it sampled
                                            (each token's log-probability under the distribution it was drawn
                                            from: the numbers `perplexity` would compute, without a second pass)

The scoring session feeds the KV pools as plain inputs (a window needs only a window's worth of slots, so the
copies ORT makes are small) instead of sharing EngineSession's IOBinding: it asks for logits at every position,
which EngineSession.run does not offer. This module must not import builder/ or recipes/.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from engine.core.engine_format import LOGITS, LOGITS_INDICES, engine_file, kcache_name, vcache_name
from engine.core.errors import EngineError
from engine.core.lora import LORA_INDEX
from engine.core.parallel import kv_heads_per_rank

from .engine_dir import load_engine_config, verifying_files
from .lora.slots import LoraSlots
from .session import engine_session_options, kv_pool_dtype, load_ort_session, shared_value
from .step_inputs import SeqChunk, make_step_inputs


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float          # mean negative log-likelihood (nats per token)
    tokens: int         # predicted tokens: every window's tokens but its first
    windows: int


def max_window(engine_dir: Path) -> int:
    """The longest window one step of the engine takes."""
    build = load_engine_config(engine_dir).build
    return min(build.max_num_tokens, build.max_seq_len)


def split_windows(ids: Sequence[int], window: int) -> list[list[int]]:
    """Consecutive windows of `window` tokens (the last one shorter; a 1-token tail predicts nothing: dropped)."""
    if window < 2:
        raise EngineError(f"perplexity window {window} is too short; use at least 2 tokens")
    windows = [list(ids[i:i + window]) for i in range(0, len(ids), window)]
    return [w for w in windows if len(w) >= 2]


class ScoringSession:
    def __init__(self, engine_dir: Path, window: int, *, threads: int | None = None):
        engine_dir = Path(engine_dir)
        self.config = config = load_engine_config(engine_dir)
        if config.build.backend != "onnxruntime" or config.mapping.world_size != 1:
            raise EngineError(f"{engine_dir}: perplexity runs tp=1 onnxruntime engines only; rebuild it with --tp 1")
        longest = min(config.build.max_num_tokens, config.build.max_seq_len)
        if not 2 <= window <= longest:
            raise EngineError(f"perplexity window {window} must be between 2 and {longest} tokens (the engine's "
                              "max_num_tokens and max_seq_len); pass a smaller --window")
        self.window = window
        model = config.model
        self._tpb = config.build.tokens_per_block
        self._blocks = -(-window // self._tpb)
        self._sliding = model.sliding_window if "sliding" in model.layer_types else None
        kv = kv_heads_per_rank(model, 1) * model.head_dim
        pool = np.zeros((self._blocks * self._tpb, kv), dtype=kv_pool_dtype(config.build.kv_cache_dtype))
        self._pools = {name(i): pool for i in range(model.num_layers) for name in (kcache_name, vcache_name)}
        with verifying_files(engine_dir, config):  # hashes every file while ORT loads the graph
            self._session = load_ort_session(engine_dir / engine_file(0), engine_session_options(config, threads))
        self._inputs = {i.name for i in self._session.get_inputs()}
        if LORA_INDEX in self._inputs:   # an engine built for LoRA adapters scores its base model: one zero slot
            slots = LoraSlots(model, config.build.lora_target_modules, 1, 1, config.build.lora_dtype)
            self._pools |= {name: shared_value(a) for name, a in slots.inputs().items()}

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits [len(ids), vocab_size] float32 of every position of `ids`, read as a new sequence."""
        if not 1 <= len(ids) <= self.window:
            raise EngineError(f"a window of {len(ids)} tokens does not fit the scoring window of {self.window}")
        vocab = self.config.model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise EngineError(f"token ids must lie in [0, {vocab}); got {min(ids)}..{max(ids)}")
        inputs = make_step_inputs([SeqChunk(list(ids), 0, list(range(self._blocks)), True)], self._tpb,
                                  self._sliding)
        inputs[LOGITS_INDICES] = np.arange(len(ids), dtype=np.int64)
        inputs[LORA_INDEX] = np.zeros(len(ids), dtype=np.int64)
        feeds = {k: v for k, v in inputs.items() if k in self._inputs} | self._pools
        return self._session.run([LOGITS], feeds)[0][:, :vocab]


def token_nll(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """-log softmax(logits)[target] per row, in float64.

    exp runs in float32 (3x faster than over a float64 copy of [window, vocab]: this was an eighth of the scoring
    time); the sums, the log and the result are float64, so a row's error stays ~1e-7 nats."""
    x = np.asarray(logits, dtype=np.float32)
    top = x.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(x - top).sum(axis=-1, dtype=np.float64)) + top[:, 0]
    return log_z - x[np.arange(len(targets)), np.asarray(targets)]


def perplexity(engine_dir: Path, windows: list[list[int]], *, threads: int | None = None) -> PerplexityResult:
    """Perplexity of the engine over `windows` (each a fresh sequence; the first token of each is context only)."""
    windows = [w for w in windows if len(w) >= 2]
    if not windows:
        raise EngineError("no text to score: perplexity needs at least one window of 2 or more tokens")
    scorer = ScoringSession(engine_dir, max(len(w) for w in windows), threads=threads)
    total, count = 0.0, 0
    for w in windows:
        nll = token_nll(scorer.logits(w)[:-1], w[1:])
        total += float(nll.sum())
        count += len(nll)
    mean = total / count
    return PerplexityResult(perplexity=math.exp(mean), nll=mean, tokens=count, windows=len(windows))


def sample_tokens(engine_dir: Path, *, sequences: int, length: int, seed: int, start_token: int,
                  threads: int | None = None) -> list[list[int]]:
    """`sequences` token sequences of `length` tokens, each `start_token` followed by tokens sampled from the
    engine's own distribution (temperature 1, seeded): text the model finds typical, needing no download."""
    return sample_scored(engine_dir, sequences=sequences, length=length, seed=seed, start_token=start_token,
                         threads=threads)[0]


def sample_scored(engine_dir: Path, *, sequences: int, length: int, seed: int, start_token: int,
                  threads: int | None = None) -> tuple[list[list[int]], PerplexityResult]:
    """`sample_tokens`' sequences, and the engine's perplexity over them as windows (what `perplexity(engine_dir,
    sequences)` measures, from the decode steps' logits instead of a second, scoring pass over the text)."""
    from .session import EngineSession

    config = load_engine_config(engine_dir)
    build = config.build
    if length > build.max_seq_len or sequences > build.max_batch_size:
        raise EngineError(f"cannot sample {sequences} x {length} tokens with an engine of max_batch_size "
                          f"{build.max_batch_size} and max_seq_len {build.max_seq_len}")
    per_seq = -(-length // build.tokens_per_block)
    session = EngineSession(engine_dir, num_blocks=sequences * per_seq, threads=threads)
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(sequences)]
    rng = np.random.default_rng(seed)
    seqs = [[start_token] for _ in range(sequences)]
    total = 0.0
    while len(seqs[0]) < length:
        pos = len(seqs[0]) - 1
        logits = session.run([SeqChunk([s[-1]], pos, t, True) for s, t in zip(seqs, tables)])
        tokens, logp = sample_rows(logits, rng.random(len(seqs)))
        for s, token in zip(seqs, tokens):
            s.append(int(token))
        total -= float(logp.sum())
    count = sequences * (length - 1)
    mean = total / count
    return seqs, PerplexityResult(perplexity=math.exp(mean), nll=mean, tokens=count, windows=sequences)


def sample_rows(logits: np.ndarray, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One sample of softmax(row) per row of `logits` by inverse CDF, from one uniform in [0, 1) per row, and each
    sample's log-probability. (Gumbel-max drew a random number per vocabulary entry: three times the cost.)"""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    cdf = np.cumsum(np.exp(x), axis=-1)          # unnormalized: cdf[:, -1] is the partition function
    rows = np.arange(len(x))
    # the first index whose cumulative mass exceeds u * total: a token of zero mass is never picked
    tokens = np.minimum((cdf <= (uniforms * cdf[:, -1])[:, None]).sum(axis=-1), x.shape[-1] - 1)
    return tokens, x[rows, tokens] - np.log(cdf[:, -1])
