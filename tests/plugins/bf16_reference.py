"""What QuantMatMul computes for a call of many rows on AMX-BF16 (plugins/kernels/quant_bf16.h), as the tests'
reference lowering of that path; the int8 path's is plugins/quant_matmul.reference."""
from __future__ import annotations

import numpy as np

from engine.plugins.quant_matmul import pack, to_bfloat16, unpack_blocks
from engine.quantization.weight_only import QuantizedWeight


def reference_bf16(x: np.ndarray, q: QuantizedWeight) -> np.ndarray:
    """The weights QuantMatMul stores, dequantized in float32 (d * q + m, or d * (q - zero_point)), and the
    activations, each rounded to bfloat16, their products summed in float64."""
    n, k = q.shape
    values, d, m = unpack_blocks(pack(q), n, q.bits, q.group_size, q.offsets is not None)
    values = values.astype(np.float64).reshape(n, -1, q.group_size)
    if m is None:
        w = (values - (1 << (q.bits - 1))) * d[:, :, None]
    else:
        w = values * d[:, :, None] + m[:, :, None]
    w = to_bfloat16(w.reshape(n, k).astype(np.float32)).astype(np.float64)
    return (to_bfloat16(x).astype(np.float64) @ w.T).astype(np.float32)
