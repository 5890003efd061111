"""The sampler: a pure function from a batch of logits and per-request parameters to the next tokens.

It knows nothing of the scheduler, the engine or the tokenizer; the only state it touches is each request's own
numpy Generator, which draws exactly one uniform number per sampled (non-greedy) step, so a seeded request gives
the same tokens whatever else shares its batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .sampling_params import Logprob, SamplingParams
from .structured.bitmask import masked_argmax, unpack


@dataclass
class SamplingRow:
    """What the sampler needs of one request for one step."""
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: np.random.Generator
    banned_token_ids: Sequence[int] = ()   # e.g. eos and stop ids while fewer than min_tokens were generated
    allowed: np.ndarray | None = None      # the tokens a structured output's grammar allows now (packed bits,
                                           # structured/bitmask.py)


@dataclass
class SamplerOutput:
    token_ids: np.ndarray                  # int64 [B]
    logprobs: list[Logprob | None] = field(default_factory=list)


def sample(logits: np.ndarray, rows: Sequence[SamplingRow]) -> SamplerOutput:
    """Sample one token per row of `logits` [B, vocab] (float32), row b under rows[b].

    Order of operations, per row:
      1. logprobs (when params.logprobs is not None): log-softmax of the raw model logits, before any of the
         steps below (vLLM v1's default "raw_logprobs"); the sampled token's and the top-N are returned.
      2. tokens the grammar does not allow (row.allowed, structured outputs) get -inf, then banned tokens
         (min_tokens not reached) unless the grammar allows nothing else: the grammar wins.
      3. repetition penalty (params.repetition_penalty, 1 = off) over every distinct token of the prompt AND the
         output, as vLLM and transformers do: a positive logit is divided by it, a negative one multiplied.
      4. frequency and presence penalties (OpenAI semantics) over the GENERATED tokens only, the prompt does not
         count: logit -= frequency_penalty * count + presence_penalty * (count > 0). A logit a penalty pushed past
         the float64 range is clamped to its largest value (an extreme repetition_penalty such as 5e-324).
      5. temperature 0 -> greedy: the argmax of the penalised logits (lowest id on ties); steps 6-10 are skipped
         and the generator is not used.
      6. temperature: logits /= temperature, after subtracting their maximum (softmax does not change), so a
         temperature near 0 (even 5e-324) sends every other logit to -inf instead of overflowing to +inf and NaN.
      7. top-k (0 = off): keep the tokens whose logit is >= the k-th largest (ties at the boundary are kept).
      8. top-p (1 = off): over the probabilities after 7, keep the smallest set of most likely tokens whose mass
         reaches top_p: a token is kept when the mass of the tokens sorted before it is < top_p (the most
         likely token is always kept).
      9. min-p (0 = off): keep tokens with probability >= min_p * the largest probability (unchanged by the
         renormalisation after 7 and 8, so this equals min-p over the temperature-scaled distribution).
     10. draw: u = generator.random() in [0, 1); the token is the first whose cumulative probability exceeds
         u * total (inverse CDF over token ids in order), so removed tokens are never drawn.
    """
    B = logits.shape[0]
    assert B == len(rows), (B, len(rows))
    token_ids = np.empty(B, dtype=np.int64)
    logprobs: list[Logprob | None] = []
    # Rows that are only an argmax (greedy, nothing banned or penalised, no logprobs) read the float32 logits as
    # they are, a batch of only such rows in one call: the same token as steps 1-5 (widening to float64 keeps the
    # order, the first maximum either way) without copying each row twice (2.9 ms of a batch-32 SmolLM2 step).
    plain = [argmax_only(row) for row in rows]
    if all(plain):
        np.argmax(logits, axis=1, out=token_ids)
        return SamplerOutput(token_ids=token_ids, logprobs=[None] * B)
    for b, row in enumerate(rows):
        p = row.params
        if plain[b]:
            token_ids[b] = np.argmax(logits[b])
            logprobs.append(None)
            continue
        if masked_argmax_only(row):    # the same token as steps 2 and 5, without a float64 copy of the row
            token_ids[b] = masked_argmax(logits[b], row.allowed)
            logprobs.append(None)
            continue
        raw = np.asarray(logits[b], dtype=np.float64)
        x = penalised(raw, row)
        tok = int(np.argmax(x)) if p.temperature == 0 else draw(probabilities(x, p), row.generator)
        token_ids[b] = tok
        logprobs.append(None if p.logprobs is None else logprob_of(raw, tok, p.logprobs))
    return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def penalised(raw: np.ndarray, row: SamplingRow) -> np.ndarray:
    """Steps 2-4: a float64 copy of one row's raw logits with disallowed and banned tokens at -inf and the
    penalties applied."""
    x = np.array(raw, dtype=np.float64)
    if row.allowed is not None:
        x[~unpack(row.allowed, x.shape[0])] = -np.inf
    if len(row.banned_token_ids):
        banned = np.asarray(row.banned_token_ids, dtype=np.int64)
        kept = x[banned]
        x[banned] = -np.inf
        if row.allowed is not None and not np.isfinite(x).any():
            x[banned] = kept
    apply_penalties(x, row)
    return x


def probabilities(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Steps 6-9 for temperature > 0: the distribution a token is drawn from (removed tokens at 0; the total may
    be below 1 after min-p, draw() scales by it)."""
    with np.errstate(over="ignore"):        # to -inf: intended (step 6)
        x = (x - np.max(x)) / p.temperature
    return filter_probs(x, p)


def draw(probs: np.ndarray, generator: np.random.Generator) -> int:
    """Step 10: one uniform draw, the first token whose cumulative probability exceeds it (times the total)."""
    cdf = np.cumsum(probs)
    u = generator.random()
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1))


def _greedy_as_is(row: SamplingRow) -> bool:
    """Greedy with nothing banned, penalised or reported: the argmax of the logits (masked, if constrained)."""
    p = row.params
    return (p.temperature == 0 and p.logprobs is None and not len(row.banned_token_ids)
            and p.repetition_penalty == 1.0 and p.frequency_penalty == 0 and p.presence_penalty == 0)


def argmax_only(row: SamplingRow) -> bool:
    return row.allowed is None and _greedy_as_is(row)


def masked_argmax_only(row: SamplingRow) -> bool:
    """A greedy row whose only processing is its grammar's mask."""
    return row.allowed is not None and _greedy_as_is(row)


def apply_penalties(x: np.ndarray, row: SamplingRow) -> None:
    """Steps 3-4, in place on the float64 logits `x` of one row."""
    p = row.params
    V = x.shape[0]
    if p.repetition_penalty != 1.0:
        seen = np.unique(np.concatenate([np.asarray(row.prompt_token_ids, dtype=np.int64),
                                         np.asarray(row.output_token_ids, dtype=np.int64)]))
        seen = seen[seen < V]
        vals = x[seen]
        with np.errstate(over="ignore"):            # clamped below
            x[seen] = np.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty != 0 or p.presence_penalty != 0) and len(row.output_token_ids):
        out = np.asarray(row.output_token_ids, dtype=np.int64)
        counts = np.bincount(out[out < V], minlength=V)[:V]
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    np.minimum(x, np.finfo(np.float64).max, out=x)    # +inf - inf would be NaN in the softmax


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


def filter_probs(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Steps 7-9: the probabilities of the scaled logits `x` with the removed tokens at 0 (not renormalised)."""
    V = x.shape[0]
    if 0 < p.top_k < V:
        kth = np.partition(x, V - p.top_k)[V - p.top_k]
        x = np.where(x >= kth, x, -np.inf)
    probs = _softmax(x)
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        sorted_probs = probs[order]
        mass_before = np.cumsum(sorted_probs) - sorted_probs
        drop = order[mass_before >= p.top_p]
        probs[drop] = 0.0
        probs /= probs.sum()
    if p.min_p > 0.0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
    return probs


def logprob_of(raw: np.ndarray, token: int, n: int) -> Logprob:
    m = np.max(raw)
    lp = raw - (m + np.log(np.exp(raw - m).sum()))
    top = {}
    if n > 0:
        idx = np.argpartition(-lp, n - 1)[:n]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = {int(i): float(lp[i]) for i in idx}
    return Logprob(token_id=token, logprob=float(lp[token]), top=top)
