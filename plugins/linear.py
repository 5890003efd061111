"""Dense projection: x [T, in] @ W^T (+ bias) -> [T, out].

Weights arrive in torch Linear layout [out_features, in_features]; they are transposed once here, at build time,
so the graph holds MatMul-ready [in, out] initializers and no Transpose node. Knows nothing of which projection
it builds; the caller names the initializers by their canonical tensor names.

    x [T, in] ──MatMul(W^T [in, out])──▶ [T, out] ──Add(bias [out])──▶ y     (Add only with a bias)
"""
from __future__ import annotations

import numpy as np

from engine.builder.graph import Graph
from engine.core.errors import EngineError


def bias_name_for(weight_name: str) -> str:
    """Canonical name of a weight's bias: "layers.0.attention.qkv.weight" -> "layers.0.attention.qkv.bias"."""
    stem = weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name
    return f"{stem}.bias"


def linear(g: Graph, x: str, weight: np.ndarray, bias: np.ndarray | None, *, name: str, weight_name: str,
           bias_name: str | None = None) -> str:
    """MatMul with the transposed `weight` as initializer `weight_name`; plus Add of `bias` as initializer
    `bias_name` (default: `weight_name` with ".weight" replaced by ".bias")."""
    if weight.ndim != 2:
        raise EngineError(f"{weight_name} has shape {tuple(weight.shape)}; a linear weight must be 2-D "
                          "[out_features, in_features]: re-run `engine convert`")
    op = g.scope(name)
    y = op("MatMul", [x, g.weight(weight_name, np.asarray(weight, dtype=np.float32).T)])
    if bias is None:
        return y
    if bias.shape != (weight.shape[0],):
        raise EngineError(f"bias of {weight_name} has shape {tuple(bias.shape)}, expected ({weight.shape[0]},) "
                          "to match the weight's out_features: re-run `engine convert`")
    b = g.weight(bias_name or bias_name_for(weight_name), np.asarray(bias, dtype=np.float32))
    return op("Add", [y, b])
