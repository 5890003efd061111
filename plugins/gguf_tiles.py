"""GGUF block-quantized weights laid out for the engine's QuantMatMul and QuantGather, exactly (no value moves).

    quantization/gguf_blocks.Decoded ──pack──▶ (tiles uint8 [N/16, K/G, bytes], Format: QuantMatMul's attributes)

Each GGUF kind becomes the QuantMatMul format that holds its values and scales as they are (the kernel's header
comment, plugins/kernels/quant_matmul.cc, draws the bytes):

    kind          bits  group  offsets  scales  header of a tile's block
    Q4_0             4     32        0       0  float32 d[16]              (zero point 8 implied)
    Q8_0             8     32        0       0  float32 d[16]              (q + 128 stored, zero point 128)
    Q4_1             4     32        1       0  float16 d[16], m[16]
    Q5_0 / Q5_1      5     32        1       0  float16 d[16], m[16]       (Q5_0: m = -16 d, exact in float16)
    Q4_K / Q5_K   4, 5    256        1       1  float16 d[16], dmin[16]; uint8 sc[8][16], mn[8][16]
    Q6_K             6    256        0       2  float16 d[16], 32 zero bytes; int8 sc[16][16] (a scale per 16)

A sub-block of 32 K values holds their low 4 bits as the 4-bit tiles do, then 5 and 6 bits add one or two 64-byte
planes of the high bits (kernels/quant_tiles.h weight_at; quant_matmul.sub_block_bytes lays out every width); 8 bits
are bytes. The activations are rounded to int8 per block of the weights' (32, or a K-quant super-block of 256), as
llama.cpp rounds them to Q8_0 and Q8_K blocks: a super-block's integer sub-block scales then apply to integer dot
products, one float scale a super-block.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.errors import EngineError
from engine.quantization.gguf_blocks import Decoded, decode, dequantize
from engine.quantization.gguf_tensor import GGUFTensor

from .graph import ENGINE_DOMAIN, Graph, Scope
from .linear import _add_bias, bias_name_for
from .quant_matmul import HEADER, LANES, per_column, sub_block_bytes

SUB_SCALE_BYTES = 256  # the K-quant header's sub-block scales (and mins) of a tile and block


@dataclass(frozen=True)
class Format:
    """QuantMatMul's (and QuantGather's) attributes for one packed weight."""
    bits: int
    group_size: int
    offsets: int
    scales: int

    def attributes(self) -> dict[str, int]:
        return {"bits": self.bits, "group_size": self.group_size, "offsets": self.offsets, "scales": self.scales}

    def block_bytes(self) -> int:
        return HEADER + (SUB_SCALE_BYTES if self.scales else 0) + self.group_size * LANES * self.bits // 8


FORMATS = {
    "Q4_0": Format(4, 32, 0, 0), "Q8_0": Format(8, 32, 0, 0), "Q4_1": Format(4, 32, 1, 0),
    "Q5_0": Format(5, 32, 1, 0), "Q5_1": Format(5, 32, 1, 0),
    "Q4_K": Format(4, 256, 1, 1), "Q5_K": Format(5, 256, 1, 1), "Q6_K": Format(6, 256, 0, 2),
}


def stored_bytes(kind: str, out_features: int, in_features: int) -> int:
    """Bytes of one packed weight: whole tiles of 16 columns."""
    f = FORMATS[kind]
    return -(-out_features // LANES) * (in_features // f.group_size) * f.block_bytes()


def _header(dec: Decoded, f: Format, tiles: int, groups: int) -> np.ndarray:
    """The blocks' headers [tiles, groups, 64 (+ 256)] as uint8."""
    d = dec.d.astype(np.float16)
    if not f.offsets and not f.scales:   # Q4_0, Q8_0: float32 d
        return per_column(d.astype(np.float32), tiles, groups).view(np.uint8)
    if f.scales == 2:   # Q6_K: d, 32 spare bytes, int8 scales of the halves
        spare = np.zeros((tiles, groups, 32), dtype=np.uint8)
        sc = per_column(dec.sc.astype(np.int8), tiles, groups).view(np.uint8)
        return np.concatenate([per_column(d, tiles, groups).view(np.uint8), spare, sc], axis=-1)
    if dec.kind in ("Q5_0",):
        m = (-16 * d.astype(np.float32)).astype(np.float16)
        if not np.array_equal(m.astype(np.float32), -16 * d.astype(np.float32)):
            raise EngineError("a Q5_0 block scale is too large to hold its offset -16 d in float16; convert this "
                              "model with --dtype float32")
    else:
        m = dec.dmin.astype(np.float16)
    header = [per_column(d, tiles, groups).view(np.uint8), per_column(m, tiles, groups).view(np.uint8)]
    if f.scales == 1:   # Q4_K, Q5_K: the sub-blocks' 6-bit scales then mins
        header += [per_column(dec.sc.astype(np.uint8), tiles, groups), per_column(dec.mn.astype(np.uint8), tiles,
                                                                                      groups)]
    return np.concatenate(header, axis=-1)


def pack(dec: Decoded) -> tuple[np.ndarray, Format]:
    """The tiles uint8 [N/16, K/G, block bytes] of a decoded GGUF weight and the format QuantMatMul reads them in."""
    f = FORMATS[dec.kind]
    n, k = dec.shape
    tiles, groups = -(-n // LANES), k // f.group_size
    values = sub_block_bytes(dec.q, f.bits, tiles, groups, f.group_size)
    blocks = np.concatenate([_header(dec, f, tiles, groups), values], axis=-1)
    assert blocks.shape == (tiles, groups, f.block_bytes()), blocks.shape
    return blocks, f


# Rows packed at a time: a table of 151936 rows packed whole made ~1.3 GB of uint8 temporaries (a 1.5B build's
# peak RSS 3.8 GB, bench/NOTES.md 53); a multiple of the tiles' 16 columns.
PACK_ROWS = 4096


def pack_tensor(t: GGUFTensor) -> tuple[np.ndarray, Format]:
    """pack(decode(t)), decoded and packed PACK_ROWS rows at a time into the one output array."""
    f = FORMATS[t.kind]
    n, k = t.shape
    blocks = np.empty((-(-n // LANES), k // f.group_size, f.block_bytes()), dtype=np.uint8)
    for r in range(0, n, PACK_ROWS):
        part, _ = pack(decode(t.raw[r:r + PACK_ROWS], t.kind, k))
        blocks[r // LANES:r // LANES + part.shape[0]] = part
    return blocks, f


def reference(x: np.ndarray, dec: Decoded) -> np.ndarray:
    """What QuantMatMul computes for these weights: x rounded to int8 per block of Format.group_size, times the exact
    weights (gguf_blocks.dequantize), summed in float64. The tests' reference lowering."""
    n, k = dec.shape
    g = FORMATS[dec.kind].group_size
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, k // g, g)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    qa = np.rint(blocks * inv) * (amax / np.float32(127)).astype(np.float32).astype(np.float64)
    return (qa.reshape(-1, k) @ dequantize(dec).astype(np.float64).T).astype(np.float32)


def gguf_linear(g: Graph, x: str, parts: list[GGUFTensor], bias: np.ndarray | None, *, name: str,
                weight_name: str, float_x: bool = False) -> str:
    """x @ W^T (+ bias) for a weight kept as GGUF blocks: one QuantMatMul over its tiles (initializer
    `weight_name`), or, for a stacked weight whose parts are of different kinds (a Q6_K v beside Q4_K q and k), one
    a part, concatenated. `float_x`: x stays float32 (gguf_node)."""
    op = g.scope(name)
    outputs = []
    for i, part in enumerate(parts):
        blocks, f = pack_tensor(part)
        tiles = g.weight(weight_name if len(parts) == 1 else f"{weight_name}.part{i}", blocks)
        outputs.append(gguf_node(op, x, tiles, part.shape[0], f, float_x=float_x))
    y = outputs[0] if len(outputs) == 1 else op("Concat", outputs, axis=-1)
    return _add_bias(g, op, y, bias, bias_name_for(weight_name))


def gguf_node(op: Scope, x: str, tiles: str, n: int, f: Format, *, float_x: bool = False) -> str:
    """x [T, K] @ W^T for the N columns whose tiles (pack) are initializer `tiles`: the engine's QuantMatMul, its
    activations rounded to int8 per block as llama.cpp rounds them, or with `float_x` kept float32 over the tiles'
    weights dequantized (the float32 engine of the same weights, at the gguf engine's size: its accuracy reference)."""
    extra = {"float_x": 1} if float_x else {}
    return op("QuantMatMul", [x, tiles], domain=ENGINE_DOMAIN, N=n, **f.attributes(), **extra)


def gguf_gather(g: Graph, table: GGUFTensor, indices: str, *, name: str, weight_name: str) -> tuple[str, Format]:
    """Rows `indices` of an embedding kept as GGUF blocks, dequantized as llama.cpp does (exactly: QuantGather)
    -> ([T, H], the tiles' format); the tiles are initializer `weight_name`, which a tied lm_head reads too."""
    blocks, f = pack_tensor(table)
    tiles = g.weight(weight_name, blocks)
    return g.scope(name)("QuantGather", [tiles, indices], domain=ENGINE_DOMAIN, **f.attributes()), f
