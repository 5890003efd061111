"""Weight-only RTN quantization (int8_wo, int4_wo): a float [out, in] weight -> packed integers + scales.

Symmetric, group-wise round-to-nearest, as TensorRT-LLM's weight-only modes and ModelOpt's INT4 blocks: each
group of `group_size` consecutive input features of one output row shares one float32 scale, and

    scale = v / -2**(bits-1)    v: the element of largest magnitude in the group, sign kept
    q     = clip(round(w / scale) + zp, 0, 2**bits - 1)     zp = 2**(bits-1) (8 for int4, 128 for int8)
    w'    = (q - zp) * scale                                 (dequantize; the largest element maps exactly)

The packing is onnxruntime's own (its MLAS blockwise quantizer, which the MatMulNBits quantizer calls), so the
bytes are exactly what ORT's MatMulNBits and GatherBlockQuantized kernels read:

    packed [out, in / group_size, group_size * bits / 8] uint8   int4: two values a byte, low nibble first
    scales [out, in / group_size] float32                       no zero points: zp above is implied

`rtn_scales` recomputes the scales in NumPy from the float weight (they are reproducible from the checkpoint),
`dequantize` is the NumPy reference every lowering is tested against. Knows nothing of ONNX graphs.

Weights already on a 4-bit grid (`block_grid`): a checkpoint converted from a GGUF Q4_1 file holds, in every block
of 32 input features, at most 16 values d * q + m (q in 0..15, d and m float16 per block; `block_grid` checks
both). RTN onto any grid with
an integer zero point moves them (~8% RMS weight error on SmolLM2, +44-58% perplexity); `block_grid` keeps them
exactly:

    q, scale = d, offset = m + 8 d      so that   w = (q - 8) * scale + offset   (same packing, implied zp 8)

The scales d are stored as the float16 values they are (half_scales); the offsets m + 8 d are no float16 values and
stay float32. That is 16 + 2 + 4 bytes per block of 32 (0.69 byte a weight against float32's 4).

MatMulNBits takes no float offset at speed (its float zero points run a dequantizing fallback, measured 30x slower
at one token), so the lowering adds the offsets as a second, small product (plugins/linear.py):
x @ w^T = MatMulNBits(x) + blocksum(x) @ offset^T, blocksum(x) [T, K/32] the sums of x over each block.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.errors import EngineError

BITS = {"int8_wo": 8, "int4_wo": 4}
# MLAS quantizes and runs blocks of 16..256 elements (a power of two); measured: 512 is refused by the packer.
GROUP_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class WeightOnlyScheme:
    """How one linear weight is quantized and run: `accuracy_level` is MatMulNBits' (0: fp32 compute,
    4: int8 activations per block, see quantization/modes.py for the measured choice)."""
    bits: int
    group_size: int
    accuracy_level: int = 0
    keep_grid: bool = False   # the weights are on a 4-bit block grid already (block_grid): keep it, no RTN
    q8_0: bool = False        # 8 bits on llama.cpp's Q8_0 rule instead of RTN's (quantize_q8_0)


@dataclass(frozen=True)
class QuantizedWeight:
    packed: np.ndarray       # uint8 [N, K / group_size, group_size * bits / 8]
    scales: np.ndarray       # float32 [N, K / group_size]
    bits: int
    group_size: int
    offsets: np.ndarray | None = None   # float32 [N, K / group_size], added per block (block_grid), or none

    @property
    def half_scales(self) -> bool:
        """Whether the scales are float16 values, stored as such: a kept GGUF block grid's (block_grid)."""
        return self.offsets is not None

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features N, in_features K) of the float weight."""
        n, blocks, _ = self.packed.shape
        return n, blocks * self.group_size

    @property
    def zero_point(self) -> int:
        return 1 << (self.bits - 1)


def check_group_size(group_size: int, in_features: int, what: str) -> None:
    """A group must be a size the kernels run and must tile the input features exactly."""
    if group_size not in GROUP_SIZES:
        raise EngineError(f"group size {group_size} is not supported by ORT's MatMulNBits; use one of "
                          f"{', '.join(map(str, GROUP_SIZES))}", usage=True)
    if in_features % group_size:
        fits = [str(s) for s in GROUP_SIZES if in_features % s == 0]
        raise EngineError(f"group size {group_size} does not divide the {in_features} input features of {what}; "
                          f"use a group size that does: {', '.join(fits) or 'none of the supported sizes'}",
                          usage=True)


def quantize(weight: np.ndarray, scheme: WeightOnlyScheme, *, name: str = "weight") -> QuantizedWeight:
    """RTN-quantize a float [out, in] weight with onnxruntime's blockwise packer."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    if weight.ndim != 2:
        raise EngineError(f"{name} has shape {tuple(weight.shape)}; only 2-D [out, in] weights are quantized")
    if scheme.keep_grid:
        kept = block_grid(weight, scheme.group_size)
        if kept is None:
            raise EngineError(f"{name} is not on the 4-bit grid the rest of the checkpoint is on; convert the "
                              "model again, or build another --group-size")
        return kept
    if scheme.bits not in (4, 8):
        raise EngineError(f"{scheme.bits}-bit weights are not supported; use 4 or 8")
    n, k = weight.shape
    check_group_size(scheme.group_size, k, name)
    if scheme.q8_0:
        return quantize_q8_0(weight, scheme.group_size)
    blocks = k // scheme.group_size
    packed = np.zeros((n, blocks, scheme.group_size * scheme.bits // 8), dtype=np.uint8)
    scales = np.zeros((n, blocks), dtype=np.float32)
    zero_points = np.zeros((n, (blocks * scheme.bits + 7) // 8), dtype=np.uint8)  # unused: symmetric
    # The packer reads MatMul's B layout [K, N]: the transposed weight.
    kernel = quantize_matmul_4bits if scheme.bits == 4 else quantize_matmul_8bits
    kernel(packed, np.ascontiguousarray(weight.T, dtype=np.float32), scales, zero_points, scheme.group_size,
           n, k, True)
    return QuantizedWeight(packed, scales, scheme.bits, scheme.group_size)


def quantize_q8_0(weight: np.ndarray, group_size: int) -> QuantizedWeight:
    """int8 blocks on llama.cpp's Q8_0 rule: scale = max|w| / 127 per group, q = round(w / scale) in -127..127 (RTN's
    scale is the signed extreme / -128). The same bytes as RTN's int8 (implied zero point 128), so every int8
    kernel runs them; a table that is a GGUF's Q8_0 blocks (d * q, d a float16) comes back exactly, which RTN's
    rule would move by up to half a step. Used for an int8 lm_head (QuantConfig.lm_head_dtype) through `quantize`
    (WeightOnlyScheme.q8_0), which checks the weight's shape and the group size first."""
    w = np.asarray(weight, dtype=np.float32)
    n, k = w.shape
    groups = w.reshape(n, k // group_size, group_size)
    scales = (np.abs(groups).max(axis=-1) / np.float32(127)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.rint(groups / safe[..., None]), -127, 127).astype(np.int16) + 128
    return QuantizedWeight(q.astype(np.uint8), scales, 8, group_size)


def block_grid(weight: np.ndarray, group_size: int) -> QuantizedWeight | None:
    """`weight` [N, K] as 4-bit blocks of `group_size` with a float offset each (module docstring), when every
    block holds only values d * q + m (q 0..15, m its minimum, d a float16 as GGUF stores it); None otherwise."""
    w = np.asarray(weight, dtype=np.float32)
    n, k = w.shape
    if k % group_size:
        return None
    blocks = w.reshape(n, k // group_size, group_size).astype(np.float64)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    with np.errstate(over="ignore"):
        step = ((high - low) / 15).astype(np.float16).astype(np.float64)
    if not np.isfinite(step).all():
        return None
    safe = np.where(step > 0, step, 1.0)
    q = np.rint((blocks - low[..., None]) / safe[..., None])
    # on the grid up to the float32 rounding of the checkpoint's values (a d that is no float16 is off by ~1e-3 d)
    error = np.abs(q * step[..., None] + low[..., None] - blocks).max(initial=0.0)
    if q.max(initial=0) > 15 or error > 1e-3 * max(step.max(initial=0), 1e-30):
        return None
    if not (low.astype(np.float16).astype(np.float64) == low).all():   # GGUF's m is a float16 too
        return None
    q = q.astype(np.uint8).reshape(n, k // group_size, group_size)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    scales = step.astype(np.float32)
    offsets = (low + 8 * step).astype(np.float32)
    return QuantizedWeight(packed, scales, 4, group_size, offsets)


def unpack(q: QuantizedWeight) -> np.ndarray:
    """The unsigned integers [N, K] of `q` (0..2**bits-1), zero point not removed."""
    n, k = q.shape
    if q.bits == 8:
        return q.packed.reshape(n, k)
    return np.stack([q.packed & 0x0F, q.packed >> 4], axis=-1).reshape(n, k)


def signed_values(q: QuantizedWeight) -> np.ndarray:
    """The signed integers [N, K] (q - zp): int8 for both widths, in [-2**(bits-1), 2**(bits-1) - 1]."""
    return (unpack(q).astype(np.int16) - q.zero_point).astype(np.int8)


def dequantize(q: QuantizedWeight) -> np.ndarray:
    """NumPy reference: the float32 [N, K] weight the kernels compute with."""
    n, k = q.shape
    values = signed_values(q).astype(np.float32).reshape(n, -1, q.group_size)
    w = values * q.scales[:, :, None]
    if q.offsets is not None:
        w = w + q.offsets[:, :, None]
    return w.reshape(n, k)


def rtn_scales(weight: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """The scales [N, K / group_size] RTN gives `weight` (see the module docstring), computed in NumPy."""
    n, k = weight.shape
    groups = np.asarray(weight, dtype=np.float32).reshape(n, k // group_size, group_size)
    idx = np.abs(groups).argmax(axis=-1)[..., None]
    extreme = np.take_along_axis(groups, idx, axis=-1)[..., 0]
    return (extreme / np.float32(-(1 << (bits - 1)))).astype(np.float32)


def stored_bytes(out_features: int, in_features: int, bits: int, group_size: int, offsets: bool = False) -> int:
    """Bytes of one quantized weight as stored: packed integers plus float32 scales, or for a kept block grid
    (`offsets`) float16 scales and float32 offsets."""
    per_block = 2 + 4 if offsets else 4
    return out_features * in_features * bits // 8 + out_features * (in_features // group_size) * per_block
