"""Verification of speculated tokens against the target's logits: the accepted prefix plus one token of its own.

The target scored the sequence's next token and each of its k drafts in one step, so position i's logits are the
distribution of the token after drafts[:i]. Each position is processed exactly as the sampler processes a step
(runtime/sampler.py: banned tokens, penalties over the history including the drafts before it, temperature,
top-k / top-p / min-p), then:

  greedy       the sampler's own choice t_i; drafts[i] is accepted while it equals t_i, and the first t_i that
               differs (or t_k after k acceptances) is the step's last token: token-identical to decoding one
               token a step.
  temperature  rejection sampling (Leviathan et al., Chen et al.) with the proposer's distribution q one-hot
               (prompt lookup, and a draft engine that proposes its argmax): drafts[i] is accepted with
               probability p_i(drafts[i]); on rejection the token is drawn from p_i with drafts[i] removed,
               renormalised (the residual max(0, p - q)); after k acceptances one more is drawn from p_k. Every
               emitted token is then distributed as p given the tokens before it, so the output distribution is
               the sampler's. Draws come from the request's own generator, so a seeded request is reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ..sampler import SamplingRow, argmax_only, draw, logprob_of, masked_argmax_only, penalised, probabilities
from ..structured.bitmask import masked_argmax
from ..sampling_params import Logprob


@dataclass
class Verdict:
    token_ids: list[int]                  # accepted drafts, then the target's own token
    logprobs: list[Logprob | None]

    @property
    def accepted(self) -> int:
        return len(self.token_ids) - 1


def verify(logits: np.ndarray, drafts: Sequence[int], row: SamplingRow, banned_at,
           allowed: np.ndarray | None = None) -> Verdict:
    """`logits` [1 + k, V] of the positions of the sequence's next token and its k `drafts`; `row` the sampling
    row of the first position (its output_token_ids the history before it); `banned_at(n)` the banned token ids
    once n tokens are generated (min_tokens); `allowed` [1 + k, ...], the grammar's packed mask at each position
    (structured outputs; the drafts are a prefix the grammar allows)."""
    p = row.params
    out = list(row.output_token_ids)
    # nothing banned now: nor later
    if allowed is None and argmax_only(replace(row, banned_token_ids=banned_at(len(out)))):
        # greedy with nothing banned or penalised: the float32 rows' argmax, as the sampler's own fast path takes it
        # (a float64 copy of a 151936-token row per position was ~1 ms of a 1.5B verification step)
        best = np.argmax(logits, axis=1).tolist()
        n = next((i for i, (t, d) in enumerate(zip(best, drafts)) if t != d), len(drafts))
        return Verdict(best[:n + 1], [None] * (n + 1))
    if allowed is not None and masked_argmax_only(replace(row, banned_token_ids=banned_at(len(out)),
                                                          allowed=allowed[0])):
        best = []
        for i in range(len(drafts) + 1):    # each position's masked argmax, until one differs from its draft
            best.append(masked_argmax(logits[i], allowed[i]))
            if i == len(drafts) or best[i] != drafts[i]:
                break
        return Verdict(best, [None] * len(best))
    tokens: list[int] = []
    logprobs: list[Logprob | None] = []
    for i in range(len(drafts) + 1):
        at = replace(row, output_token_ids=out, banned_token_ids=banned_at(len(out)),
                     allowed=None if allowed is None else allowed[i])
        raw = np.asarray(logits[i], dtype=np.float64)
        x = penalised(raw, at)
        draft = drafts[i] if i < len(drafts) else None
        if p.temperature == 0:
            tok = int(np.argmax(x))
        else:
            probs = probabilities(x, p)
            probs = probs / probs.sum()
            if draft is not None and row.generator.random() < probs[draft]:
                tok = draft
            else:
                if draft is not None:
                    probs[draft] = 0.0
                # an empty residual: the draft held all the mass, and only rounding rejected it
                tok = draw(probs, row.generator) if probs.any() else draft
        tokens.append(tok)
        logprobs.append(None if p.logprobs is None else logprob_of(raw, tok, p.logprobs))
        if tok != draft:
            break
        out.append(tok)
    return Verdict(tokens, logprobs)
