"""The engine's QuantMatMul (plugins/kernels/quant_matmul.cc): a quantized weight repacked for int8 dot products.

    x [T, K] ──engine QuantMatMul(blocks uint8 [N/16, K/G, 64 + G * 16 * bits / 8])──▶ [T, N]

It computes what MatMulNBits at accuracy level 4 computes (activations rounded to int8 per block of G), and adds a
kept Q4_1 block's offsets in the same pass: every block of a column holds d * q + m with q unsigned, so

    m = -zero_point * d            (RTN weights: quantization/weight_only.py; implied, not stored)
    m = offsets - zero_point * d   (kept blocks: their offsets are the block's value at q = zero_point; stored as
                                    the float16 it is, GGUF's Q4_1 m, beside the float16 d)

`pack_float` lays out a float32 weight for the same op (bits=32: a float32 engine's projections), each tile's K x 16
values in order, which the kernel reads as one stream (kernels/float_tiles.h).

`pack` lays out 16 columns (a tile) by one block: a 64-byte header of scales, then 256 (4-bit) or 512 (8-bit)
bytes per 32 K values, in the order vpdpbusd reads them (the kernel's header draws it). Each tile's blocks follow
one another, so a tile is one stream of bytes. It runs once, at build time.
"""
from __future__ import annotations

import numpy as np

from engine.plugins import native
from engine.quantization.weight_only import QuantizedWeight, dequantize, unpack

from .graph import ENGINE_DOMAIN, Graph, Scope

BF16_ROWS = 64   # calls of this many rows or more take the bfloat16 tiles where the CPU has AMX-BF16 (kBf16Rows)
LANES = 16  # columns per tile
SUB = 32    # K values per sub-block
HEADER = 64  # bytes of scales per tile and block
FLOAT_BITS = 32  # QuantMatMul's bits for float32 tiles (kernels/float_tiles.h)


def supported(group_size: int, accuracy_level: int) -> bool:
    """Whether weights in groups of `group_size` at `accuracy_level` run as QuantMatMul: it computes what
    MatMulNBits does at level 4 (activations rounded to int8) in blocks of whole sub-blocks, and only where the CPU
    has the int8 dot products it is written for, AVX-512 VNNI or AVX2 (elsewhere its plain loops would be slower
    than MatMulNBits)."""
    return accuracy_level == 4 and group_size % SUB == 0 and native.has_int8_dot()


def runs(group_size: int, accuracy_level: int, *, plugin: bool, kernel: bool) -> bool:
    """Whether a build with these switches (--weight-only-quant-matmul-plugin, --engine-kernels-plugin) lowers
    weight-only projections to QuantMatMul (plugins/linear.py; the memory plan asks the same)."""
    return plugin and kernel and supported(group_size, accuracy_level)


def foldable(g: Graph, value: str, readers: int, *, ops: tuple[str, ...] = ("QuantMatMul",), swiglu: bool = False):
    """The node of the engine's `ops` that made `value`, its last projection with (`swiglu`) or without SwiGLU,
    when `readers` nodes read `value` and no graph output is it: a projection another node may take in, removing
    one ORT dispatch (~3 us at a decode step: bench/NOTES.md 42; plugins/rms_norm.py, gated_mlp.py, attention.py);
    else None. The arithmetic of every fused form is the unfused nodes' (plugins/kernels/quant_matmul.cc)."""
    node = g.producer(value)
    if node is None or node.domain != ENGINE_DOMAIN or node.op_type not in ops:
        return None
    key = "down_swiglu" if node.op_type == "QuantMLP" else "swiglu"
    if any(a.name == key and a.i for a in node.attribute) != swiglu:
        return None
    if sum(value in n.input for n in g.nodes) != readers or any(o.name == value for o in g.outputs):
        return None
    return node


def float_runs(out_features: int, *, kernel: bool) -> bool:
    """Whether a float32 projection of `out_features` columns runs as QuantMatMul's float32 tiles (bits=32,
    kernels/float_tiles.h) in a build with the engine's kernels (--engine-kernels-plugin): where the CPU has the
    vector code they are written for (AVX-512, or AVX2 with FMA; plain loops would lose to MLAS) and the columns are
    whole tiles, so the engine stores exactly the float32 weight (the memory plan counts it so)."""
    return kernel and out_features % LANES == 0 and native.has_int8_dot()


def pack_float(weight: np.ndarray) -> np.ndarray:
    """The float32 tiles uint8 [N/16, 1, K * 64] of a weight [N, K]: tile i holds columns 16 i .. 16 i + 15 as K rows
    of 16 values, one block of group_size K (kernels/quant_matmul.cc); zero columns fill the last tile."""
    n, k = weight.shape
    tiles = -(-n // LANES)
    values = padded(np.asarray(weight, dtype=np.float32), tiles).reshape(tiles, LANES, k).transpose(0, 2, 1)
    return np.ascontiguousarray(values).view(np.uint8).reshape(tiles, 1, k * LANES * 4)


def unpack_float(tiles: np.ndarray, n: int) -> np.ndarray:
    """What pack_float stored: the weight float32 [N, K]."""
    count, _, row_bytes = tiles.shape
    k = row_bytes // (LANES * 4)
    values = np.ascontiguousarray(tiles).view(np.float32).reshape(count, k, LANES)
    return values.transpose(0, 2, 1).reshape(count * LANES, k)[:n]


def float_node(op: Scope, x: str, tiles: str, n: int, k: int, **attributes) -> str:
    """x [T, K] @ W^T for a float32 weight [N, K] placed as its float32 tiles (pack_float) in initializer `tiles`:
    the engine's QuantMatMul with bits=32 (`attributes`: its others, e.g. swiglu=1)."""
    return op("QuantMatMul", [x, tiles], domain=ENGINE_DOMAIN, N=n, bits=FLOAT_BITS, group_size=k, offsets=0,
              **attributes)


def float_gather(op: Scope, tiles: str, indices: str, hidden: int) -> str:
    """Rows `indices` [T] of a float32 table [V, H] placed as its float32 tiles in initializer `tiles`, by the
    engine's QuantGather: a tied embedding reading the lm_head's tiles, stored once."""
    return op("QuantGather", [tiles, indices], domain=ENGINE_DOMAIN, bits=FLOAT_BITS, group_size=hidden, offsets=0)


def has_bf16_tiles() -> bool:
    """Whether this CPU runs QuantMatMul's calls of BF16_ROWS rows or more on AMX-BF16 (kernels/quant_bf16.h)."""
    return {"amx_tile", "amx_bf16", "avx512_bf16", "avx512_vnni", "avx512bw"} <= set(native._cpu_flags().split())


def stored_bytes(out_features: int, in_features: int, bits: int, group_size: int) -> int:
    """Bytes of one packed weight: whole tiles of 16 columns, a 4-byte scale (or two float16s) per column and block."""
    columns = -(-out_features // LANES) * LANES
    return columns * (in_features * bits // 8 + in_features // group_size * (HEADER // LANES))


def _half_offsets(q: QuantizedWeight) -> np.ndarray:
    """m = offsets - zero_point * d of kept blocks: the float16 values block_grid found (up to the float32 rounding
    of the offsets)."""
    m = q.offsets.astype(np.float64) - q.zero_point * q.scales.astype(np.float64)
    half = m.astype(np.float16)
    if not (np.abs(half.astype(np.float64) - m) <= np.abs(q.offsets.astype(np.float64)) * 2.0**-23).all():
        raise AssertionError("block_grid keeps only blocks whose minima are float16 values")
    return half


def pack(q: QuantizedWeight) -> np.ndarray:
    """The blocks uint8 [N/16, K/G, 64 + G * 16 * bits / 8] of `q` (module docstring)."""
    n, k = q.shape
    tiles, groups = -(-n // LANES), k // q.group_size
    if q.offsets is None:
        header = per_column(q.scales.astype(np.float32), tiles, groups)
    else:
        header = np.concatenate([per_column(q.scales.astype(np.float16), tiles, groups),
                                 per_column(_half_offsets(q), tiles, groups)], axis=-1)
    return np.concatenate([header.view(np.uint8), sub_block_bytes(unpack(q), q.bits, tiles, groups, q.group_size)],
                          axis=-1)


def unpack_blocks(blocks: np.ndarray, n: int, bits: int, group_size: int,
                  offsets: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """What `pack` stored: (q uint8 [N, K], d float32 [N, K/G], m float32 [N, K/G] of kept blocks or None)."""
    tiles, groups, _ = blocks.shape
    header = np.ascontiguousarray(blocks[:, :, :HEADER])
    body = blocks[:, :, HEADER:].reshape(tiles, groups, group_size // SUB, -1, LANES, 4)   # [t, b, s, i, j, e]
    if bits == 4:
        body = np.concatenate([body & 0x0F, body >> 4], axis=3)
    values = body.transpose(0, 4, 1, 2, 3, 5).reshape(tiles * LANES, -1)[:n]

    def columns(per_tile: np.ndarray) -> np.ndarray:   # [N/16, K/G, 16] -> [N, K/G]
        return per_tile.astype(np.float32).transpose(0, 2, 1).reshape(tiles * LANES, groups)[:n]

    if not offsets:
        return values, columns(header.view(np.float32)), None
    half = header.view(np.float16)
    return values, columns(half[..., :LANES]), columns(half[..., LANES:])


def padded(rows: np.ndarray, tiles: int) -> np.ndarray:
    """[N, ...] -> [16 * tiles, ...]: zero rows (columns of the weight) fill the last tile."""
    out = np.zeros((tiles * LANES, *rows.shape[1:]), dtype=rows.dtype)
    out[: rows.shape[0]] = rows
    return out


def per_column(values: np.ndarray, tiles: int, groups: int) -> np.ndarray:
    """[N, groups * m] per-(column, block, item) values -> [tiles, groups, m * 16]: a block's items, 16 columns each
    (a header's scales: m = 1), zero columns padding the last tile."""
    v = padded(values, tiles)
    return np.ascontiguousarray(v.reshape(tiles, LANES, groups, -1).transpose(0, 2, 3, 1)).reshape(tiles, groups, -1)


def sub_block_bytes(q: np.ndarray, bits: int, tiles: int, groups: int, group: int) -> np.ndarray:
    """The sub-blocks' bytes [tiles, groups, group / 32 * sub_bytes] of unsigned values q [N, K] of 4, 5, 6 or 8 bits
    (the kernel's header comment; 5 and 6 bits: the low 4 as 4-bit values, then one or two planes of the high bits,
    plugins/gguf_tiles.py)."""
    subs = group // SUB
    # [tile, column j, block, sub-block, register i, e], k = G block + 32 sub + 4 i + e -> [tile, block, sub, i, j, e]
    v = padded(q, tiles).reshape(tiles, LANES, groups, subs, 8, 4).transpose(0, 2, 3, 4, 1, 5)
    if bits == 8:
        return np.ascontiguousarray(v).reshape(tiles, groups, -1)
    low = v & 0x0F
    parts = [low[:, :, :, :4] | (low[:, :, :, 4:] << 4)]  # register l < 4: k = 4 l + e low, 16 + 4 l + e high
    high = (v >> 4).astype(np.uint8)
    if bits == 5:   # one plane: bit i of byte (j, e) is bit 4 of register i's value
        parts.append(sum((high[:, :, :, i] & 1) << i for i in range(8))[:, :, :, None].astype(np.uint8))
    elif bits == 6:   # plane P: bits 2 (i % 4), +1 of byte (j, e) are bits 4, 5 of register i = 4 P + i % 4
        parts += [sum((high[:, :, :, 4 * p + i] & 3) << (2 * i) for i in range(4))[:, :, :, None].astype(np.uint8)
                  for p in range(2)]
    return np.concatenate([p.reshape(tiles, groups, subs, -1) for p in parts], axis=-1).reshape(tiles, groups, -1)


def reference(x: np.ndarray, q: QuantizedWeight) -> np.ndarray:
    """What QuantMatMul computes, from its rounded activations and weight_only.dequantize's weights, summed in
    float64: the tests' reference lowering."""
    n, k = q.shape
    g = q.group_size
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, k // g, g)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    qa = np.rint(blocks * inv)
    da = (amax / np.float32(127)).astype(np.float32)
    w = dequantize(q).astype(np.float64).reshape(n, k // g, g)
    return np.einsum("tbg,nbg->tn", qa * da.astype(np.float64), w).astype(np.float32)


def to_bfloat16(a: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties even), as float32; a NaN stays a NaN, made quiet, as the
    kernels' own rounding keeps it (kernels/bf16_matmul.cc): the rounding carry would turn some into infinity."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    rounded = np.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits | 0x400000) & 0xFFFF0000, rounded)
    return rounded.astype(np.uint32).view(np.float32)
