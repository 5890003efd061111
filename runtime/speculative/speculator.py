"""The engine core's side of speculation: who proposes this step, how many tokens, and what was accepted.

Before each step `propose` gives each running sequence that decodes next its drafts (seq.draft_token_ids), when
they are expected to pay. A step of B decodes that verifies k drafts each costs about 1 + verify_cost * k * B plain
decode steps (measured: the step is memory-bound only up to its first row; each further row costs compute), and
emits, for a sequence whose drafts are accepted at rate a, E(a) = (1 - a^(k+1)) / (1 - a) tokens. A sequence
proposes when E of its recent acceptance rate (an exponential average over its drafts, weight 1/2; 1 at first)
reaches that cost; else it pauses for `pause_steps` steps and then tries afresh. So the batch size where proposals
stop follows from the cost: with k = 4 and verify_cost 0.2, a rate of 0.47 pays alone, 0.66 beside one other
sequence, 0.9 among four; and no step of more than `max_batch_size` decodes proposes at all. No proposal either
where there is no room: at most max_tokens - 1 more output tokens and max_seq_len - 1 positions.
After the step the engine core reports each verified draft (`record`); the counters are vLLM's spec-decode ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol, Sequence as Seq

from ..sequence import Sequence
from .config import SpeculativeConfig
from .ngram import propose as lookup

AVERAGE_WEIGHT = 0.5


class Proposer(Protocol):
    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        """Up to ks[i] tokens to follow seqs[i].token_ids, for each sequence."""

    def forget(self, request_id: str) -> None:
        """The request finished: drop what is kept for it."""


@dataclass
class SpecDecodeStats:
    """Counters since start (vLLM's vllm:spec_decode_* metrics) and the proposer's own time."""
    num_drafts: int = 0                  # proposals verified (one a sequence and step)
    num_draft_tokens: int = 0            # tokens proposed in them
    num_accepted_tokens: int = 0         # of those, accepted
    accepted_per_pos: list[int] = field(default_factory=list)   # [i]: drafts whose token i was accepted
    propose_seconds: float = 0.0

    def copy(self) -> "SpecDecodeStats":
        return replace(self, accepted_per_pos=list(self.accepted_per_pos))

    def since(self, before: "SpecDecodeStats") -> "SpecDecodeStats":
        """The counts between `before` and these."""
        return SpecDecodeStats(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                               self.num_accepted_tokens - before.num_accepted_tokens,
                               [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)],
                               self.propose_seconds - before.propose_seconds)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified step emits on average: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _Track:
    rate: float = 1.0
    paused_until: int = 0


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_seq_len: int):
        self.config, self.proposer, self.max_seq_len = config, proposer, max_seq_len
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._tracks: dict[str, _Track] = {}
        self._step = 0

    def propose(self, running: Seq[Sequence]) -> None:
        self._step += 1
        decodes = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        if not decodes or len(decodes) > self.config.max_batch_size:
            return
        k_max = self.config.num_speculative_tokens
        cost = 1 + self.config.verify_cost * k_max * len(decodes)
        seqs, ks = [], []
        for seq in decodes:
            track = self._tracks.setdefault(seq.request_id, _Track())
            if track.paused_until > self._step:
                continue
            if expected_tokens(track.rate, k_max) < cost:
                track.paused_until, track.rate = self._step + 1 + self.config.pause_steps, 1.0
                continue
            k = min(k_max, seq.max_tokens - seq.num_output_tokens - 1, self.max_seq_len - seq.num_tokens)
            if k > 0:
                seqs.append(seq)
                ks.append(k)
        if not seqs:
            return
        t = time.perf_counter()
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, ks)):
            seq.draft_token_ids = drafts
        self.stats.propose_seconds += time.perf_counter() - t

    def record(self, request_id: str, proposed: int, accepted: int) -> None:
        st = self.stats
        st.num_drafts += 1
        st.num_draft_tokens += proposed
        st.num_accepted_tokens += accepted
        for i in range(accepted):
            st.accepted_per_pos[i] += 1
        track = self._tracks.setdefault(request_id, _Track())
        track.rate += AVERAGE_WEIGHT * (accepted / proposed - track.rate)

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
        self.proposer.forget(request_id)


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verified step emits when each draft is accepted with probability `rate` (until the first miss)."""
    return k + 1.0 if rate >= 1 else (1 - rate ** (k + 1)) / (1 - rate)


class NgramProposer:
    """Prompt lookup (ngram.py) for each sequence; nothing kept between steps."""

    def __init__(self, config: SpeculativeConfig):
        self.n_min, self.n_max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        return [lookup(seq.token_ids, k, self.n_min, self.n_max) for seq, k in zip(seqs, ks)]

    def forget(self, request_id: str) -> None:
        pass


def make_speculator(config: SpeculativeConfig | None, target, tokenizer, threads: int | None) -> Speculator | None:
    """The Speculator of `config` for the target engine whose EngineConfig is `target` and Tokenizer `tokenizer`
    (None: no speculation)."""
    if config is None:
        return None
    if config.method == "ngram":
        proposer: Proposer = NgramProposer(config)
    else:
        from .draft import DraftProposer
        proposer = DraftProposer(config, target, tokenizer, threads)
    return Speculator(config, proposer, target.build.max_seq_len)
