"""LoRA over a projection: y + s * B_i(A_i x) for each token's adapter i, adapters of a step mixed (core/lora.py has
the inputs' layout: a [S, R, K], b [S, R, N] with the scaling in b, slot 0 all zeros).

    kernel=True:   (y, x, index, a, b) ─engine LoraAdd(columns)─▶ out       plugins/kernels/lora.cc: each token's
                   rank rows only, each row block of b over its own columns only (LoraAddBf16: a, b in bfloat16)
    kernel=False:  the standard-ONNX reference, every slot's product masked to each token's own slot:
                   x ─Gemm(a as [S*R, K], transB)─▶ u [T, S*R] ─Reshape [T, S, R]─▶ Mul(one-hot of index [T, S, 1])
                     ─Reshape [T, S*R]─▶ MatMul(b as [S*R, N])─▶ Add y
                   (b's rows are zero outside their block's columns, so the full product adds the same terms;
                   bfloat16 a and b are Cast to float first)

The node sits after the projection, so a LoRA engine's projections are not folded into the nodes after them
(QuantMLP, *AddRMSNorm, QuantRotaryPagedAttention: those fold only a QuantMatMul they read directly).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from .graph import ENGINE_DOMAIN, Graph


def lora_add(g: Graph, y: str, x: str, index: str, a: str, b: str, *, columns: list[int], name: str,
             kernel: bool, bf16: bool = False) -> str:
    op = g.scope(name)
    if kernel:
        return op("LoraAddBf16" if bf16 else "LoraAdd", [y, x, index, a, b], domain=ENGINE_DOMAIN,
                  columns=[int(c) for c in columns])
    if bf16:
        a, b = op("Cast", [a], to=TensorProto.FLOAT), op("Cast", [b], to=TensorProto.FLOAT)
    shape = op("Shape", [a])                                             # [S, R, K]
    k_axis = op("Slice", [shape, g.const([2]), g.const([3])])
    u = op("Gemm", [x, op("Reshape", [a, op("Concat", [g.const([-1]), k_axis], axis=0)])], transB=1)
    slots = op("Slice", [shape, g.const([0]), g.const([1])])
    per_slot = op("Reshape", [u, op("Concat", [g.const([0]), op("Slice", [shape, g.const([0]), g.const([2])])],
                                     axis=0)])                          # [T, S, R]
    ids = op("Range", [g.const(0), op("Squeeze", [slots, g.const([0])]), g.const(1)])
    one_hot = op("Cast", [op("Equal", [op("Unsqueeze", [index, g.const([1])]),
                                        op("Unsqueeze", [ids, g.const([0])])])], to=1)   # [T, S] float
    masked = op("Mul", [per_slot, op("Unsqueeze", [one_hot, g.const([2])])])
    flat = op("Reshape", [masked, g.const([0, -1])])
    n_axis = op("Slice", [op("Shape", [b]), g.const([2]), g.const([3])])
    delta = op("MatMul", [flat, op("Reshape", [b, op("Concat", [g.const([-1]), n_axis], axis=0)])])
    return op("Add", [y, delta])


def lora_add_numpy(y: np.ndarray, x: np.ndarray, index: np.ndarray, a: np.ndarray, b: np.ndarray,
                   columns: list[int]) -> np.ndarray:
    """The op's meaning in NumPy, for tests: each token's rank rows, each row block over its own columns."""
    out = y.astype(np.float64)
    blocks = len(columns) // 2
    rank = a.shape[1] // blocks
    for t, s in enumerate(index):
        u = a[s].astype(np.float64) @ x[t]
        for m in range(blocks):
            rows, (c0, c1) = slice(m * rank, (m + 1) * rank), columns[2 * m: 2 * m + 2]
            out[t, c0:c1] += u[rows] @ b[s, rows, c0:c1]
    return out.astype(np.float32)
