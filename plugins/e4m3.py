"""float8 e4m3fn values kept as their uint8 codes, for the fp8 KV pools (--kv-cache-dtype fp8).

ONNX Runtime's CPU provider can neither write nor read a float8 pool (its ScatterND and Gather take no float8
tensor) nor reinterpret float8 bits as uint8 (BitCast is not implemented): bench/NOTES.md entry 21. So the pools
hold the codes as uint8 and the graph converts with arithmetic and a table:

    encode  x [T, C] float ─QuantizeLinear(scale [C], float8 out)─Cast─▶ v, an exact e4m3 value (saturated, RNE)
            code = |v| 2^(3-e) - 8 (3 - e) + 72 (+128 when v < 0),  e = max(floor(log2 |v| + 1e-3), -6)
            ─Cast─▶ uint8 [T, C]        (e is the binade; e = -6 also covers the subnormals and 0)
    decode  codes uint8 ─Cast int32─▶ Gather(VALUES [256]) ─▶ the e4m3 value as float32 (unscaled)

With the engine's kernels (--engine-kernels-plugin) encode is one op, engine E4m3Encode
(plugins/kernels/e4m3_encode.cc), and the attention kernel decodes as it reads; the same codes either way.

A normal v = (1 + m/8) 2^e has code (e + 7) * 8 + m = 8e + 56 + (|v| 2^-e - 1) * 8, which is the formula; a
subnormal m/8 2^-6 has code m = |v| 2^9, the same formula at e = -6. Every step is exact in float32 (|v| 2^(3-e) is
an integer below 16), and the 1e-3 keeps floor(log2) off its float rounding at exact powers of two (the largest
mantissa sits 0.907 above its binade). Tested against ml_dtypes' codes for every e4m3 value and random inputs.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from onnx import TensorProto

from .graph import ENGINE_DOMAIN, Graph, Scope

# the value of every code; the two NaN codes (0x7F, 0xFF) are never written (QuantizeLinear saturates) and read as 0
VALUES = np.nan_to_num(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32), nan=0.0)


def encode(g: Graph, op: Scope, x: str, scale: str, channels: int, kernel: bool = False) -> str:
    """uint8 codes [T, C] of x / scale rounded to e4m3 (scale float32 [C], per channel)."""
    if kernel:
        return op("E4m3Encode", [x, scale], domain=ENGINE_DOMAIN)
    zero = g.const(np.zeros(channels), ml_dtypes.float8_e4m3fn)   # sets QuantizeLinear's output type
    v = op("Cast", [op("QuantizeLinear", [x, scale, zero], axis=-1)], to=TensorProto.FLOAT)
    a = op("Abs", [v])
    log2 = op("Add", [op("Mul", [op("Log", [a]), g.const(1 / math.log(2), np.float32)]), g.const(1e-3, np.float32)])
    shift = op("Sub", [g.const(3.0, np.float32), op("Max", [op("Floor", [log2]), g.const(-6.0, np.float32)])])
    code = op("Add", [op("Sub", [op("Mul", [a, op("Pow", [g.const(2.0, np.float32), shift])]),
                                 op("Mul", [shift, g.const(8.0, np.float32)])]), g.const(72.0, np.float32)])
    negative = op("Less", [v, g.const(0.0, np.float32)])
    code = op("Where", [negative, op("Add", [code, g.const(128.0, np.float32)]), code])
    return op("Cast", [code], to=TensorProto.UINT8)


def decode(g: Graph, op: Scope, codes: str) -> str:
    """The e4m3 values (float32, unscaled) of uint8 `codes`, any shape."""
    return op("Gather", [g.const(VALUES, np.float32), op("Cast", [codes], to=TensorProto.INT32)], axis=0)
