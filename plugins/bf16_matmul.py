"""The engine's Bf16MatMul and Bf16Gather (plugins/kernels/bf16_matmul.cc): a weight stored in bfloat16.

    x [T, K] ──engine Bf16MatMul(tiles uint16 [N/16, K/32, 16, 32])──▶ [T, N] = bf16(x) @ bf16(W)^T
    ids [T]  ──engine Bf16Gather(the same tiles)─────────────────────▶ [T, K] = bf16(W)[ids]

For lm_head (`engine build --lm-head-dtype bfloat16`): at a decode step of a weight-only quantized engine its
float32 table is the largest single read (SmolLM2: 113 of ~220 MB a token at int8), and bfloat16 halves it. A tied
embedding gathers from the same table, so it is stored once. `pack` lays each tile of 16 columns out as AMX's B
tiles, chunk by chunk of 32 K values (the kernel's header draws it); it runs once, at build time.
"""
from __future__ import annotations

import numpy as np

from engine.plugins import native
from engine.plugins.quant_matmul import LANES, SUB, to_bfloat16

from .graph import ENGINE_DOMAIN, Graph

CHUNK = SUB   # K values per B tile


def supported(in_features: int) -> bool:
    """Whether a weight of `in_features` runs as Bf16MatMul here: K in whole chunks of 32, on a CPU with the
    AVX-512 BF16 dot products the kernel is written for (elsewhere it computes the same in plain loops, slower than
    ORT's float32 MatMul)."""
    return in_features % CHUNK == 0 and {"avx512_bf16", "avx512bw"} <= set(native._cpu_flags().split())


def stored_bytes(out_features: int, in_features: int) -> int:
    return -(-out_features // LANES) * LANES * in_features * 2


def bfloat16_bits(w: np.ndarray) -> np.ndarray:
    """float32 values -> their bfloat16 bits (nearest, ties even), uint16."""
    return (to_bfloat16(w).view(np.uint32) >> 16).astype(np.uint16)


def pack(w: np.ndarray) -> np.ndarray:
    """[N, K] float32 -> the tiles uint16 [N/16, K/32, 16, 32]: tile t, chunk c, row i holds column j's values at
    k = 32 c + 2 i, 32 c + 2 i + 1 in elements 2 j, 2 j + 1; zero columns fill the last tile."""
    n, k = w.shape
    assert k % CHUNK == 0, k
    tiles = -(-n // LANES)
    bits = np.zeros((tiles * LANES, k), dtype=np.uint16)
    bits[:n] = bfloat16_bits(w)
    # [tile, column j, chunk c, row i, e] -> [tile, chunk c, row i, column j, e]
    return np.ascontiguousarray(bits.reshape(tiles, LANES, k // CHUNK, CHUNK // 2, 2).transpose(0, 2, 3, 1, 4)
                                .reshape(tiles, k // CHUNK, CHUNK // 2, 2 * LANES))


def unpack(tiles: np.ndarray, n: int) -> np.ndarray:
    """pack's inverse: the bfloat16 weight [N, K] as float32."""
    t, chunks = tiles.shape[:2]
    bits = tiles.reshape(t, chunks, CHUNK // 2, LANES, 2).transpose(0, 3, 1, 2, 4).reshape(t * LANES, chunks * CHUNK)
    return (bits[:n].astype(np.uint32) << 16).view(np.float32)


def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What Bf16MatMul computes: x and W rounded to bfloat16, their products summed in float64 (the tests' reference
    lowering)."""
    return (to_bfloat16(x).astype(np.float64) @ to_bfloat16(w).astype(np.float64).T).astype(np.float32)


def bf16_linear(g: Graph, x: str, weight: np.ndarray | None, *, name: str, weight_name: str, n: int) -> str:
    """x @ bf16(W)^T -> [T, n]: `weight` [n, K] packed as initializer `weight_name`, or None where bf16_gather
    placed that table already (a tied embedding)."""
    table = weight_name if weight is None else g.weight(weight_name, pack(np.asarray(weight, dtype=np.float32)))
    return g.scope(name)("Bf16MatMul", [x, table], domain=ENGINE_DOMAIN, N=n)


def bf16_gather(g: Graph, table: np.ndarray, indices: str, *, name: str, weight_name: str) -> str:
    """Rows `indices` of bf16(`table`) [V, H] -> [T, H], the table packed as initializer `weight_name` for a
    following bf16_linear of the same name (tied lm_head) to read too."""
    packed = g.weight(weight_name, pack(np.asarray(table, dtype=np.float32)))
    return g.scope(name)("Bf16Gather", [packed, indices], domain=ENGINE_DOMAIN)
