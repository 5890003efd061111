"""The graph inputs of one scheduler step, built from the sequences' chunks (see core/engine_format.py).

Packed tokens, no padding: sequence b contributes q_len[b] new tokens at positions [start_pos[b], ctx_len[b]).
Attention works on *rows*: a row is a run of at most Qmax consecutive new tokens of one sequence, and the
attention batch is [rows, Qmax]. A short chunk is one row; a long chunk beside short ones is cut into several
rows, so that one 128-token prefill chunk does not pad every decode of the step to 128 queries:

    packed tokens      | seq 0: 5 tokens (prefill) | seq 1: 1 (decode) | seq 2: 3 (chunk) |
    rows of Qmax = 4     row 0: seq 0 [0..4) | row 1: seq 0 [4] | row 2: seq 1 | row 3: seq 2
    q_index [R, Qmax]    0 1 2 3 / 4 0 0 0 / 5 0 0 0 / 6 7 8 0     (pad entries: index 0, masked to key 0)
    out_index [T]        0 1 2 3   4         8         12 13 14   (row * Qmax + j)

A row of sequence b starting at position p sees keys [0, p + its length) of b, causally. Qmax is chosen per
step to minimise rows * (Qmax + ROW_OVERHEAD), a cost model of padded query rows plus each row's K/V gather
(see _row_length); a step whose chunks all have the same length stays one row per sequence. A chunk that verifies
speculated tokens (num_logits > 1) is cut into rows of one token: the attention op computes a lone token of a
row as a decode, so each position gets the floats a decode step would give it (greedy speculation stays exact).
Everything is computed with NumPy over whole arrays; the only Python loop runs once per sequence (to pad the
block tables), never once per token.

This module knows nothing of ONNX Runtime; it must stay importable without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.core.engine_format import (ATTN_MASK, ATTN_MASK_SLIDING, INPUT_IDS, KV_SLOTS, LOGITS_INDICES,
                                       OUT_INDEX, POSITIONS, Q_INDEX, SLOT_MAPPING, EngineConfig)
from engine.core.errors import EngineError


@dataclass
class SeqChunk:
    token_ids: Sequence[int]     # the new tokens of this sequence computed in this step
    start_pos: int               # tokens of this sequence already in the KV pool (its num_computed_tokens)
    block_table: Sequence[int]   # block ids covering positions [0, start_pos + len(token_ids))
    num_logits: int              # logits of its last num_logits new tokens wanted (0: none; 1 + k verifying k
                                 # speculated tokens, runtime/speculative/); a bool reads as 0 or 1
    lora_slot: int = 0           # the session's LoRA slot its tokens use (runtime/lora/), 0: the base model


# Cost of a row beyond its query entries, in units of one padded query: the K/V gather of its context (each row
# copies its whole context) and the per-row work of the attention op. Measured on SmolLM2, 8 decodes at context
# 900 beside a 128-token chunk (bench/attention_rows.py, 1 thread): Qmax 128 / 64 / 32 / 16 / 8 took
# 3.69 / 2.49 / 1.91 / 1.70 / 1.75 s; 12 makes the model pick 16.
ROW_OVERHEAD = 12


def max_attention_rows(config) -> int | None:
    """The attention batch bound of an engine: TensorRT's optimization profile admits max_batch_size rows; None
    (no bound) on onnxruntime. `config`: its EngineConfig."""
    return config.build.max_batch_size if config.build.backend == "tensorrt" else None


def make_step_inputs(chunks: list[SeqChunk], tokens_per_block: int, sliding_window: int | None,
                     max_rows: int | None = None) -> dict[str, np.ndarray]:
    """Graph inputs for `chunks` (all but the KV pools); `attn_mask_sliding` only when `sliding_window`.
    `max_rows` bounds the attention batch (a backend with a fixed batch range: TensorRT's profiles)."""
    if not chunks:
        raise EngineError("a step needs at least one sequence chunk")
    lengths, starts = [len(c.token_ids) for c in chunks], [c.start_pos for c in chunks]
    if min(lengths) < 1:
        raise EngineError(f"sequence chunk {lengths.index(min(lengths))} has no tokens; every chunk needs at least one")
    if min(starts) < 0:
        raise EngineError(f"start_pos {min(starts)} is negative")
    for b, c in enumerate(chunks):
        if not 0 <= c.num_logits <= len(c.token_ids):
            raise EngineError(f"sequence chunk {b} wants logits of {c.num_logits} tokens; it has {len(c.token_ids)}")
    if lengths == [1]:
        return _lone_decode_inputs(chunks[0], tokens_per_block, sliding_window)
    q_len, start = np.array(lengths, dtype=np.int64), np.array(starts, dtype=np.int64)
    ctx_len = start + q_len
    num_seqs, total = len(chunks), sum(lengths)

    # Block tables padded to [B, max blocks]; a table must cover every context position of its sequence.
    need = -(-ctx_len // tokens_per_block)
    width = int(need.max())
    tables = np.zeros((num_seqs, width), dtype=np.int64)
    for b, c in enumerate(chunks):
        tables[b, :int(need[b])] = _block_table(b, c, int(ctx_len[b]), tokens_per_block)
    if total == num_seqs:
        return _decode_inputs(chunks, start, ctx_len, tables, tokens_per_block, sliding_window)
    return _packed_inputs(chunks, q_len, start, tables, tokens_per_block, sliding_window, max_rows)


def lora_index(chunks: list[SeqChunk]) -> np.ndarray:
    """The lora_index input of an engine built with LoRA: each packed token's slot."""
    return np.repeat(np.array([c.lora_slot for c in chunks], dtype=np.int64), [len(c.token_ids) for c in chunks])


def _block_table(b: int, chunk: SeqChunk, ctx_len: int, tokens_per_block: int) -> np.ndarray:
    """The blocks covering sequence chunk b's ctx_len positions, or an EngineError when its table is too short."""
    n = -(-ctx_len // tokens_per_block)
    if len(chunk.block_table) < n:
        raise EngineError(f"sequence chunk {b} has {len(chunk.block_table)} blocks for {ctx_len} tokens; "
                          f"it needs {n} blocks of {tokens_per_block} tokens")
    return np.asarray(chunk.block_table[:n], dtype=np.int64)


def _lone_decode_inputs(chunk: SeqChunk, tokens_per_block: int, sliding_window: int | None) -> dict[str, np.ndarray]:
    """_decode_inputs for a step of one decode (batch-1 generation, the latency case) from half its NumPy calls:
    every key of the one row is visible, and the row's indices are all 0. With the caches cold from a float32
    SmolLM2 step's weight streams, make_step_inputs took 81 us a step, 49 on this path (bench/NOTES.md entry 52)."""
    p = chunk.start_pos
    table = _block_table(0, chunk, p + 1, tokens_per_block)
    kv_slots = ((table * tokens_per_block)[:, None] + np.arange(tokens_per_block)).reshape(1, -1)[:, :p + 1]
    inputs = {
        INPUT_IDS: np.array([chunk.token_ids[0]], dtype=np.int64),
        POSITIONS: np.array([p], dtype=np.int64),
        SLOT_MAPPING: kv_slots[0, p:],
        Q_INDEX: np.zeros((1, 1), dtype=np.int64),
        KV_SLOTS: kv_slots,
        ATTN_MASK: np.ones((1, 1, 1, p + 1), dtype=bool),
        OUT_INDEX: np.zeros(1, dtype=np.int64),
        LOGITS_INDICES: np.zeros(int(chunk.num_logits), dtype=np.int64),
    }
    if sliding_window:
        inputs[ATTN_MASK_SLIDING] = (np.arange(p + 1) > p - sliding_window)[None, None, None, :]
    return inputs


def _decode_inputs(chunks: list[SeqChunk], start: np.ndarray, ctx_len: np.ndarray, tables: np.ndarray,
                   tokens_per_block: int, sliding_window: int | None) -> dict[str, np.ndarray]:
    """The inputs of a step of one new token per sequence (decodes), as _packed_inputs makes them (one row per
    sequence, Qmax 1, query b seeing keys [0, ctx_len[b])) from a third of its array operations: a decode step
    runs this after the weights have streamed through the caches, where each NumPy call costs several times its
    warm time (a lone SmolLM2 decode: 0.28 ms cold, bench/NOTES.md entry 34)."""
    num_seqs = len(chunks)
    seqs = np.arange(num_seqs)
    l = np.arange(int(ctx_len.max()))
    visible = l[None, :] < ctx_len[:, None]                      # [B, Lmax]
    kv_slots = np.where(visible, tables[:, l // tokens_per_block] * tokens_per_block + l % tokens_per_block, 0)
    want = np.array([c.num_logits for c in chunks], dtype=bool)
    inputs = {
        INPUT_IDS: np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=num_seqs),
        POSITIONS: start,
        SLOT_MAPPING: kv_slots[seqs, start],
        Q_INDEX: seqs[:, None],
        KV_SLOTS: kv_slots,
        ATTN_MASK: visible[:, None, None, :],
        OUT_INDEX: seqs,
        LOGITS_INDICES: seqs[want],
    }
    if sliding_window:
        inputs[ATTN_MASK_SLIDING] = (visible & (l[None, :] > (start - sliding_window)[:, None]))[:, None, None, :]
    return inputs


def _packed_inputs(chunks: list[SeqChunk], q_len: np.ndarray, start: np.ndarray, tables: np.ndarray,
                   tokens_per_block: int, sliding_window: int | None, max_rows: int | None) -> dict[str, np.ndarray]:
    """Any step: the module docstring's packing of rows."""
    num_seqs, total = len(chunks), int(q_len.sum())
    seq = np.repeat(np.arange(num_seqs), q_len)                  # [T] sequence of each packed token
    first = np.cumsum(q_len) - q_len                             # [B] packed index of each sequence's first token
    offset = np.arange(total) - first[seq]                       # [T] index within its chunk
    positions = start[seq] + offset
    slot_mapping = tables[seq, positions // tokens_per_block] * tokens_per_block + positions % tokens_per_block

    # Rows: sequence b's chunk cut into pieces of at most q_max tokens; a chunk verifying speculated tokens
    # (num_logits > 1) into rows of one token, so that each is attended exactly as a decode of it would be.
    verify = np.array([c.num_logits > 1 for c in chunks], dtype=bool)
    q_max = _row_length(q_len[~verify], max_rows or len(chunks) + total) if not verify.all() else 1
    per_row = np.where(verify, 1, q_max)                         # [B] tokens a row of each chunk
    pieces = -(-q_len // per_row)
    row_seq = np.repeat(np.arange(num_seqs), pieces)             # [R] sequence of each row
    piece = np.arange(len(row_seq)) - (np.cumsum(pieces) - pieces)[row_seq]
    row_first = first[row_seq] + piece * per_row[row_seq]        # [R] packed index of the row's first token
    row_len = np.minimum(per_row[row_seq], q_len[row_seq] - piece * per_row[row_seq])
    row_start = start[row_seq] + piece * per_row[row_seq]        # [R] position of the row's first token
    row_ctx = row_start + row_len                                # [R] keys the row's last query sees
    num_rows, l_max = len(row_seq), int(row_ctx.max())
    row_of_token = np.repeat(np.arange(num_rows), row_len)       # [T]

    j = np.arange(q_max)
    q_valid = j[None, :] < row_len[:, None]                      # [R, Qmax]
    q_index = np.where(q_valid, row_first[:, None] + j[None, :], 0)
    l = np.arange(l_max)
    kv_valid = l[None, :] < row_ctx[:, None]                     # [R, Lmax]
    row_tables = tables[row_seq]
    kv_slots = row_tables[np.arange(num_rows)[:, None],
                          np.minimum(l[None, :], row_ctx[:, None] - 1) // tokens_per_block]
    kv_slots = np.where(kv_valid, kv_slots * tokens_per_block + l[None, :] % tokens_per_block, 0)

    q_pos = row_start[:, None] + j[None, :]                      # [R, Qmax] position of query j
    causal = l[None, None, :] <= q_pos[:, :, None]               # [R, Qmax, Lmax]
    # Padded query rows see key 0 only, so their softmax stays finite; out_index never reads them.
    pad_row = ~q_valid[:, :, None] & (l == 0)[None, None, :]
    mask = (causal & q_valid[:, :, None]) | pad_row

    inputs = {
        INPUT_IDS: np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=total),
        POSITIONS: positions,
        SLOT_MAPPING: slot_mapping,
        Q_INDEX: q_index,
        KV_SLOTS: kv_slots,
        ATTN_MASK: mask[:, None],
        OUT_INDEX: row_of_token * q_max + np.arange(total) - row_first[row_of_token],
        LOGITS_INDICES: _logit_rows(chunks, first + q_len),
    }
    if sliding_window:
        near = l[None, None, :] > q_pos[:, :, None] - sliding_window  # the query's own key included
        inputs[ATTN_MASK_SLIDING] = ((causal & near & q_valid[:, :, None]) | pad_row)[:, None]
    return inputs


def _logit_rows(chunks: list[SeqChunk], ends: np.ndarray) -> np.ndarray:
    """Packed indices of the tokens whose logits are wanted: the last num_logits of each chunk, in order."""
    n = np.array([c.num_logits for c in chunks], dtype=np.int64)
    first = np.repeat(ends - n, n)
    return first + np.arange(len(first)) - np.repeat(np.cumsum(n) - n, n)


def _row_length(q_len: np.ndarray, max_rows: int) -> int:
    """The Qmax (a power of two, or the longest chunk) minimising rows * (Qmax + ROW_OVERHEAD) with at most
    max_rows rows. Equal-length chunks (a batch of decodes, one prefill) keep one row per sequence."""
    longest = int(q_len.max())
    best, best_cost = longest, len(q_len) * (longest + ROW_OVERHEAD)
    size = 1
    while size < longest:
        rows = int((-(-q_len // size)).sum())
        cost = rows * (size + ROW_OVERHEAD)
        if rows <= max_rows and cost < best_cost:
            best, best_cost = size, cost
        size *= 2
    return best


def check_step(inputs: dict[str, np.ndarray], chunks: list[SeqChunk], config: EngineConfig, num_blocks: int) -> None:
    """Refuse a step the engine was not built for, or one naming tokens or blocks that do not exist."""
    build, vocab = config.build, config.model.vocab_size
    if len(chunks) > build.max_batch_size:
        raise EngineError(f"a step of {len(chunks)} sequences exceeds the engine's max_batch_size "
                          f"{build.max_batch_size}")
    total = len(inputs[INPUT_IDS])
    if total > build.max_num_tokens:
        raise EngineError(f"a step of {total} tokens exceeds the engine's max_num_tokens {build.max_num_tokens}")
    longest = max(c.start_pos + len(c.token_ids) for c in chunks)
    if longest > build.max_seq_len:
        raise EngineError(f"a sequence of {longest} tokens exceeds the engine's max_seq_len {build.max_seq_len}")
    ids = inputs[INPUT_IDS]
    if ids.min() < 0 or ids.max() >= vocab:
        bad = int(ids[(ids < 0) | (ids >= vocab)][0])
        raise EngineError(f"token id {bad} is outside the vocabulary [0, {vocab})")
    slots = num_blocks * build.tokens_per_block
    if inputs[KV_SLOTS].min() < 0 or inputs[KV_SLOTS].max() >= slots:
        raise EngineError(f"a block table names a block outside the pool of {num_blocks} blocks")
