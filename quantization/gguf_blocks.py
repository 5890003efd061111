"""llama.cpp's GGUF block-quantized tensors decoded into their stored integers and scale fields, so that a weight can
be kept exactly (transcoded into another kernel layout) instead of dequantized. Knows nothing of ONNX or kernels.

A row of K values is K / block blocks of `type_size` bytes each; float16 fields are little-endian (llama.cpp's
ggml-common.h, gguf-py's quants.py). Element j of a block, by kind:

    Q4_0  18 B  d f16 | qs[16]                 q = qs[j%16] >> 4*(j//16) & 15           w = d * (q - 8)
    Q4_1  20 B  d f16 | m f16 | qs[16]         (as Q4_0)                                w = d * q + m
    Q5_0  22 B  d f16 | qh u32 | qs[16]        q = Q4_0's | (qh >> j & 1) << 4          w = d * (q - 16)
    Q5_1  24 B  d f16 | m f16 | qh u32 | qs[16]  (as Q5_0)                              w = d * q + m
    Q8_0  34 B  d f16 | qs int8[32]            q = qs[j] + 128                          w = d * (q - 128)
    Q4_K 144 B  d f16 | dmin f16 | scales[12] | qs[128]      sub-block s = j // 32 (8 of them):
                sc[s], mn[s] 6 bits each, packed as get_scale_min_k4; q = qs[32*(s//2) + j%32] >> 4*(s%2) & 15
                                                                                        w = d*sc[s] * q - dmin*mn[s]
    Q5_K 176 B  d f16 | dmin f16 | scales[12] | qh[32] | qs[128]   q = Q4_K's | (qh[j%32] >> s & 1) << 4   (as Q4_K)
    Q6_K 210 B  ql[128] | qh[64] | scales int8[16] | d f16   half h = j // 128, i = j % 128:
                q = (ql[64h + i%64] >> 4*(i//64) & 15) | (qh[32h + i%32] >> 2*(i//32) & 3) << 4
                                                                                        w = d*sc[j//16] * (q - 32)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.errors import EngineError

KEPT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")   # gguf.GGMLQuantizationType names

# kind -> (bits, zero, block, sub, type_size): the type sizes are gguf's GGML_QUANT_SIZES (a test checks them).
_LAYOUT = {
    "Q4_0": (4, 8, 32, 32, 18), "Q4_1": (4, 0, 32, 32, 20), "Q5_0": (5, 16, 32, 32, 22),
    "Q5_1": (5, 0, 32, 32, 24), "Q8_0": (8, 128, 32, 32, 34),
    "Q4_K": (4, 0, 256, 32, 144), "Q5_K": (5, 0, 256, 32, 176), "Q6_K": (6, 32, 256, 16, 210),
}
# Rows are decoded a slab of ~this many values at a time: the uint8 temporaries stay in cache and, on a
# memory-mapped file, only a slab's pages are read at once.
_SLAB = 1 << 18


@dataclass(frozen=True)
class Decoded:
    """A weight [N, K] as w[n, k] = scale[n, k // sub] * (q[n, k] - zero) + minimum[n, k // sub]  (float32 math),
    with scale and minimum factored as llama.cpp stores them: scale = d (K types: d * sc), minimum = m (Q4_1, Q5_1),
    -dmin * mn (Q4_K, Q5_K) or 0. `scales` folds zero into minimum; `dequantize` computes w as llama.cpp does."""
    kind: str               # "Q4_K", ...
    q: np.ndarray           # uint8 [N, K]: the unsigned stored values (Q8_0: the int8 value + 128)
    bits: int               # 4, 5, 6 or 8
    zero: int               # 8 (Q4_0), 16 (Q5_0), 128 (Q8_0), 32 (Q6_K), 0 for Q4_1, Q5_1, Q4_K, Q5_K
    block: int              # 32 for Q4_0..Q8_0, 256 for the K types (the super-block)
    sub: int                # the span of one scale: 32 for Q4_0..Q8_0, Q4_K, Q5_K; 16 for Q6_K
    d: np.ndarray           # float16 [N, K // block]: the block's d (super-block d for K types)
    sc: np.ndarray | None   # K types only: [N, K // sub] the sub-block scales: uint8 0..63 (Q4_K, Q5_K), int8 (Q6_K)
    dmin: np.ndarray | None # float16 [N, K // block]: Q4_1/Q5_1's m, Q4_K/Q5_K's dmin; None otherwise
    mn: np.ndarray | None   # uint8 [N, K // sub] 0..63: Q4_K/Q5_K's sub-block mins; None otherwise

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape


def _layout(kind: str) -> tuple[int, int, int, int, int]:
    if kind not in _LAYOUT:
        raise EngineError(f"GGUF tensor type {kind} cannot be kept as integer blocks; kept types: {', '.join(KEPT)}")
    return _LAYOUT[kind]


def row_bytes(kind: str, k: int) -> int:
    """Bytes of one row of `k` values (k a multiple of the kind's block)."""
    _, _, block, _, type_size = _layout(kind)
    if k <= 0 or k % block:
        raise EngineError(f"a {kind} row holds blocks of {block} values; {k} values are not a whole number of blocks")
    return k // block * type_size


def _half(b: np.ndarray, at: int) -> np.ndarray:
    """The little-endian float16 at byte `at` of each block: [..., type_size] uint8 -> [...] float16."""
    return np.ascontiguousarray(b[..., at:at + 2]).view("<f2")[..., 0].astype(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., m] bytes -> [..., 2m]: the low nibbles, then the high ones (every llama.cpp 4-bit layout)."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


def _bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[..., m] bytes -> [..., count * m]: bit 0 of every byte, then bit 1, ... (Q5_K's qh)."""
    shifts = np.arange(count, dtype=np.uint8)[:, None]
    return ((qh[..., None, :] >> shifts) & np.uint8(1)).reshape(*qh.shape[:-1], count * qh.shape[-1])


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 mins (llama.cpp's get_scale_min_k4): bytes 0-3 hold scales
    0-3 and the top bits of 4-7, bytes 4-7 the mins likewise, bytes 8-11 the low nibbles of scales/mins 4-7."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & np.uint8(63), (hi & np.uint8(15)) | ((lo >> np.uint8(2)) & np.uint8(48))], axis=-1)
    mn = np.concatenate([mid & np.uint8(63), (hi >> np.uint8(4)) | ((mid >> np.uint8(2)) & np.uint8(48))], axis=-1)
    return sc, mn


def _unpack(b: np.ndarray, kind: str) -> dict[str, np.ndarray]:
    """One slab of blocks [R, nb, type_size] uint8 -> the fields of Decoded, per block ([R, nb, ...])."""
    if kind == "Q8_0":
        return {"q": b[..., 2:] ^ np.uint8(128), "d": _half(b, 0)}
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        at = 4 if kind.endswith("_1") else 2          # _1 kinds carry m after d
        out = {"d": _half(b, 0), **({"dmin": _half(b, 2)} if at == 4 else {})}
        if kind.startswith("Q5"):
            high = np.unpackbits(b[..., at:at + 4], axis=-1, bitorder="little")   # qh as a little-endian u32
            out["q"] = _nibbles(b[..., at + 4:]) | (high << np.uint8(4))
        else:
            out["q"] = _nibbles(b[..., at:])
        return out
    if kind in ("Q4_K", "Q5_K"):
        sc, mn = _scale_min_k4(b[..., 4:16])
        qs = b[..., -128:]
        q = _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 256)
        if kind == "Q5_K":
            q |= _bits(b[..., 16:48], 8) << np.uint8(4)
        return {"q": q, "d": _half(b, 0), "dmin": _half(b, 2), "sc": sc, "mn": mn}
    # Q6_K: each 128-value half takes 64 ql bytes (nibbles) and 32 qh bytes (four 2-bit fields).
    lead = b.shape[:-1]
    low = _nibbles(b[..., :128].reshape(*lead, 2, 64))
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    q = low | ((qh & np.uint8(3)).reshape(*lead, 2, 128) << np.uint8(4))
    return {"q": q.reshape(*lead, 256), "d": _half(b, 208), "sc": b[..., 192:208].view(np.int8)}


def decode(raw: np.ndarray, kind: str, k: int) -> Decoded:
    """Decode N rows of `kind` blocks (raw: uint8 [N, row_bytes], or their flat bytes; a memory map is read a slab
    at a time) into integers and scale fields."""
    bits, zero, block, sub, type_size = _layout(kind)
    width = row_bytes(kind, k)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise EngineError(f"{kind} blocks are read as uint8 bytes; got an array of {raw.dtype}")
    if (raw.ndim == 2 and raw.shape[1] != width) or raw.ndim > 2 or raw.size % width:
        found = f"rows of {raw.shape[1]} bytes" if raw.ndim == 2 else f"{raw.size} bytes"
        raise EngineError(f"{kind} rows of {k} values take {width} bytes each; expected a whole number of such rows, "
                          f"found {found} (shape {tuple(raw.shape)})")
    n, nb = raw.size // width, k // block
    blocks = raw.reshape(n, nb, type_size)
    fields = {"q": np.empty((n, k), np.uint8), "d": np.empty((n, nb), np.float16)}
    if kind not in ("Q4_0", "Q5_0", "Q8_0", "Q6_K"):
        fields["dmin"] = np.empty((n, nb), np.float16)
    if block != sub:
        fields["sc"] = np.empty((n, k // sub), np.int8 if kind == "Q6_K" else np.uint8)
    if kind in ("Q4_K", "Q5_K"):
        fields["mn"] = np.empty((n, k // sub), np.uint8)
    step = max(1, _SLAB // k)
    for r in range(0, n, step):
        for name, part in _unpack(blocks[r:r + step], kind).items():
            dest = fields[name][r:r + step]
            dest[...] = part.reshape(dest.shape)
    return Decoded(kind=kind, bits=bits, zero=zero, block=block, sub=sub, **{
        "sc": None, "dmin": None, "mn": None, **fields})


def _factors(dec: Decoded, rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray | None]:
    """(scale, offset) float32 [R, K // sub] as llama.cpp computes them: w = scale * (q - zero) + offset;
    offset None where llama.cpp adds none (adding 0 would turn its -0.0 into +0.0)."""
    d = dec.d[rows].astype(np.float32)
    if dec.sc is None:                                   # Q4_0..Q8_0: one scale per block
        return d, None if dec.dmin is None else dec.dmin[rows].astype(np.float32)
    per = dec.block // dec.sub
    scale = np.repeat(d, per, axis=1) * dec.sc[rows].astype(np.float32)          # d1 = d * sc
    if dec.mn is None:                                   # Q6_K
        return scale, None
    dmin = np.repeat(dec.dmin[rows].astype(np.float32), per, axis=1)
    return scale, -(dmin * dec.mn[rows].astype(np.float32))                      # y = d1 * q - dmin * m


def scales(dec: Decoded) -> tuple[np.ndarray, np.ndarray]:
    """(scale, minimum) float32 [N, K // sub] with w = scale * q + minimum for the unsigned q (zero folded in):
    Q4_0/Q5_0/Q8_0 (d, -zero * d); Q4_1/Q5_1 (d, m); Q4_K/Q5_K (d * sc, -dmin * mn); Q6_K (d * sc, -32 * d * sc)."""
    scale, offset = _factors(dec)
    minimum = np.float32(-dec.zero) * scale     # exact: zero is a power of two or 0
    return scale, minimum if offset is None else minimum + offset


def dequantize(dec: Decoded) -> np.ndarray:
    """float32 [N, K], bit for bit what llama.cpp's dequantize_row_* (and gguf-py) compute."""
    n, k = dec.shape
    out = np.empty((n, k), np.float32)
    step = max(1, _SLAB // k)
    for r in range(0, n, step):
        rows = slice(r, r + step)
        scale, offset = _factors(dec, rows)
        q = dec.q[rows].reshape(scale.shape[0], -1, dec.sub)
        w = q.astype(np.float32) if dec.zero == 0 else (q.astype(np.int16) - np.int16(dec.zero)).astype(np.float32)
        w *= scale[..., None]
        if offset is not None:
            w += offset[..., None]
        out[rows] = w.reshape(-1, k)
    return out
