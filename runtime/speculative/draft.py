"""Draft-engine proposals: a smaller engine with the same tokenizer runs k greedy steps for the sequences that
propose, batched, in a KV pool of its own.

The draft keeps, per request, the tokens whose K/V its pool holds. Each proposal first brings the draft up to the
target's committed tokens: the longest common prefix stays, the rest (the prompt at first; later the accepted
drafts and the target's own token, after the rejected tail) runs in one batched catch-up step, whose last logits
give the first proposal; k - 1 batched single-token steps give the others. Proposals are the draft's argmax, so
the proposal distribution q is one-hot: verify.py's rejection sampling then keeps the target's distribution for
any temperature, and a seeded request needs no draft generator state to be reproducible or resumed. A pool that
runs short evicts the requests the draft used least recently (they catch up again when they next propose).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence as Seq

import numpy as np

from engine.core.errors import EngineError

from ..block_manager import BlockManager
from ..sequence import Sequence
from ..step_inputs import SeqChunk
from .config import SpeculativeConfig


def check_same_vocabulary(draft_dir, draft_tokenizer, target_tokenizer) -> None:
    """A draft proposes token ids; they mean the same text only under the same vocabulary."""
    draft_vocab, target_vocab = draft_tokenizer.vocabulary(), target_tokenizer.vocabulary()
    if draft_vocab != target_vocab:
        differ = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda kv: kv[1])[:3]
        raise EngineError(f"the draft engine {draft_dir} has a vocabulary of {len(draft_vocab)} tokens and the target "
                          f"engine {len(target_vocab)}, not the same token ids (first differences: {differ}); a "
                          "draft must share the target's tokenizer", usage=True)


class DraftProposer:
    def __init__(self, config: SpeculativeConfig, target, target_tokenizer, threads: int | None):
        from ..engine_dir import load_engine_config
        from ..kv_budget import plan_kv_cache
        from ..session import EngineSession
        from ..tokenizer import Tokenizer

        draft_dir = config.draft_engine_dir
        check_same_vocabulary(draft_dir, Tokenizer(draft_dir), target_tokenizer)
        dc = load_engine_config(draft_dir)
        b = dc.build
        self.max_len, self.budget, self.max_batch = b.max_seq_len, b.max_num_tokens, b.max_batch_size
        self.vocab = min(dc.model.vocab_size, target.model.vocab_size)
        self.min_confidence = config.draft_min_confidence
        plan = plan_kv_cache(dc, max_kv_tokens=min(config.max_batch_size, b.max_batch_size) * b.max_seq_len)
        self.session = EngineSession(draft_dir, num_blocks=plan.num_blocks, threads=threads)
        self.blocks = BlockManager(plan.num_blocks, b.tokens_per_block, enable_prefix_caching=False)
        self.computed: OrderedDict[str, list[int]] = OrderedDict()   # least recently proposing first

    def propose(self, seqs: Seq[Sequence], ks: Seq[int]) -> list[list[int]]:
        proposals: dict[str, list[int]] = {}
        active = [(s, min(k, self.max_len - s.num_tokens)) for s, k in zip(seqs, ks)]
        active = [(s, k) for s, k in active if k > 0 and self._reserve(s, k, {x.request_id for x, _ in active})]
        for group in range(0, len(active), self.max_batch):
            self._propose_group(active[group:group + self.max_batch], proposals)
        return [proposals.get(s.request_id, []) for s in seqs]

    def _reserve(self, seq: Sequence, k: int, keep: set[str]) -> bool:
        """Keep the draft's common prefix with `seq`, and blocks for its catch-up and k - 1 fed proposals."""
        rid, tokens = seq.request_id, seq.token_ids
        have = self.computed.pop(rid, [])
        common = 0
        for a, b in zip(have, tokens[:-1]):   # the last token always runs: its logits give the first proposal
            if a != b:
                break
            common += 1
        self.computed[rid] = have[:common]    # most recently used now
        if self.blocks.block_table(rid):
            self.blocks.trim(rid, common)
        while self.blocks.allocate_slots(rid, seq.num_tokens + k - 1) is None:
            victim = next((r for r in self.computed if r not in keep), None)
            if victim is None:
                self.forget(rid)
                return False
            self.forget(victim)
        return True

    def _propose_group(self, group: list[tuple[Sequence, int]], proposals: dict[str, list[int]]) -> None:
        # catch-up: each sequence's tokens past its common prefix, in rounds of the draft's token budget
        pending = [(s, len(self.computed[s.request_id])) for s, _ in group]
        while pending:
            chunks, taken, budget = [], [], self.budget
            for seq, start in pending:
                n = min(seq.num_tokens - start, budget)
                if n <= 0:
                    break
                budget -= n
                chunks.append(self._chunk(seq, seq.token_ids[start:start + n], start, start + n == seq.num_tokens))
                taken.append((seq, start, n))
            logits = self._run(chunks)
            row, later = 0, []
            for seq, start, n in taken:
                self.computed[seq.request_id].extend(seq.token_ids[start:start + n])
                if start + n == seq.num_tokens:
                    tok = self._confident(logits[row])
                    proposals[seq.request_id] = [] if tok is None else [tok]
                    row += 1
                else:
                    later.append((seq, start + n))
            pending = later + pending[len(taken):]
        # k - 1 single-token steps, each feeding the last proposal, while the draft is confident of it
        done = {s.request_id for s, _ in group if not proposals.get(s.request_id)}
        for step in range(1, max(k for _, k in group)):
            live = [(s, proposals[s.request_id]) for s, k in group if k > step and s.request_id not in done]
            if not live:
                break
            chunks = [self._chunk(s, [p[-1]], s.num_tokens + len(p) - 1, True) for s, p in live]
            for (s, p), row in zip(live, self._run(chunks)):
                self.computed[s.request_id].append(p[-1])
                tok = self._confident(row)
                if tok is None:
                    done.add(s.request_id)
                else:
                    p.append(tok)

    def _confident(self, logits: np.ndarray) -> int | None:
        """The draft's argmax, or None when its probability is below min_confidence (the target would likely
        reject it: proposing it costs a verified position, and drafting on from it more draft steps)."""
        tok = int(np.argmax(logits))
        if self.min_confidence > 0:
            top = logits[tok]
            if 1.0 / np.exp(logits - top).sum() < self.min_confidence:
                return None
        return tok

    def _chunk(self, seq: Sequence, tokens: list[int], start: int, logits: bool) -> SeqChunk:
        return SeqChunk(tokens, start, self.blocks.block_table(seq.request_id), int(logits))

    def _run(self, chunks: list[SeqChunk]) -> np.ndarray:
        return self.session.run(chunks, copy=False)[:, :self.vocab]

    def forget(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
        self.blocks.free(request_id)
