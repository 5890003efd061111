"""What rank 0 sends the other ranks each step: a fixed header, then the step's chunks as one int64 array.

    header  int64[4]  [command, B sequences, T tokens, total block-table entries]
    payload int64[4B + T + blocks]
            | q_len[B] | start_pos[B] | num_logits[B] | table_len[B] | token ids[T] | block tables, concatenated |

Every rank rebuilds the graph inputs from the chunks with runtime/step_inputs.py, so the masks and index arrays
(up to B * Qmax * Lmax) never cross the wire and every rank computes exactly what rank 0 does. Plain numpy, no
pickling: a worker runs nothing but what these integers say.
"""
from __future__ import annotations

import numpy as np

from ..step_inputs import SeqChunk

STEP, PING, SHUTDOWN = 1, 2, 3
HEADER_SIZE = 4


def encode(chunks: list[SeqChunk]) -> tuple[np.ndarray, np.ndarray]:
    """(header, payload) of a step."""
    q_len = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    start = np.array([c.start_pos for c in chunks], dtype=np.int64)
    want = np.array([c.num_logits for c in chunks], dtype=np.int64)
    table_len = np.array([len(c.block_table) for c in chunks], dtype=np.int64)
    tokens = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=int(q_len.sum()))
    blocks = np.fromiter((b for c in chunks for b in c.block_table), dtype=np.int64, count=int(table_len.sum()))
    payload = np.concatenate([q_len, start, want, table_len, tokens, blocks])
    return header(STEP, len(chunks), len(tokens), len(blocks)), payload


def header(command: int, num_seqs: int = 0, num_tokens: int = 0, num_blocks: int = 0) -> np.ndarray:
    return np.array([command, num_seqs, num_tokens, num_blocks], dtype=np.int64)


def payload_size(head: np.ndarray) -> int:
    _, num_seqs, num_tokens, num_blocks = (int(x) for x in head)
    return 4 * num_seqs + num_tokens + num_blocks


def decode(head: np.ndarray, payload: np.ndarray) -> list[SeqChunk]:
    """The chunks `encode` packed (exactly: the same tokens, positions, block tables and flags)."""
    b = int(head[1])
    q_len, start, want, table_len = payload[:b], payload[b:2 * b], payload[2 * b:3 * b], payload[3 * b:4 * b]
    tok_end = np.cumsum(q_len) + 4 * b
    blk_end = np.cumsum(table_len) + 4 * b + int(head[2])
    chunks = []
    for i in range(b):
        chunks.append(SeqChunk(token_ids=payload[tok_end[i] - q_len[i]:tok_end[i]].tolist(), start_pos=int(start[i]),
                               block_table=payload[blk_end[i] - table_len[i]:blk_end[i]].tolist(),
                               num_logits=int(want[i])))
    return chunks
