"""RMSNorm, alone or fused with the residual add before it.

    y = x / sqrt(mean(x^2, last axis) + eps) * weight

Gemma's (1 + w) offset is folded into `weight` by the caller. The same op serves the per-head q/k norms
(Qwen3, Gemma3): a row [heads * head_dim] is normalized per head when len(weight) divides it:

    x [T, heads*hd] ──Reshape [T, heads, hd]──▶ norm over hd ──Reshape [T, heads*hd]──▶ y

Lowerings: `plugin=False` spells the formula in standard ops (Mul, ReduceMean, Add, Sqrt, Div, Mul);
`plugin=True` is the standard opset-23 RMSNormalization (one ORT kernel, 2x the reference; as fast as ORT's
contrib SimplifiedLayerNormalization and, unlike it, a standard op other backends parse). With the residual add
it is Add + RMSNormalization (ORT's fused SkipSimplifiedLayerNormalization measured slower: bench/plugin_lowerings.py), or
with `kernel=True` the engine's AddRMSNorm (plugins/kernels/add_rms_norm.cc): one node instead of two; and where x
is the output of the engine's QuantMatMul that nothing else reads (a quantized layer's o_proj and down_proj), no
node at all: that QuantMatMul becomes QuantMatMulAddRMSNorm, which adds and normalizes its own output (the same
arithmetic, plugins/kernels/add_rms_norm.h; one ORT dispatch fewer a norm, ~3 us at a decode step: NOTES 42).
"""
from __future__ import annotations

import numpy as np
from onnx import helper

from engine.core.errors import EngineError
from engine.plugins import quant_matmul

from .graph import ENGINE_DOMAIN, Graph, Scope


def rms_norm(g: Graph, x: str, weight: np.ndarray, eps: float, *, name: str, weight_name: str,
             plugin: bool, whole_rows: bool = False) -> str:
    """x [T, n * len(weight)] -> RMSNorm over each group of len(weight) values.

    The graph carries no static shapes, so by default x is viewed as [T, n, len(weight)] (a Reshape pair, which
    ORT runs as zero-copy views), correct for any n. `whole_rows=True` promises n == 1 and skips the pair."""
    _check(weight, weight_name)
    op = g.scope(name)
    w = g.weight(weight_name, np.asarray(weight, dtype=np.float32))
    if whole_rows:
        return _norm(g, op, x, w, eps, plugin)
    grouped = op("Reshape", [x, g.const([0, -1, len(weight)])])
    return op("Reshape", [_norm(g, op, grouped, w, eps, plugin), g.const([0, -1])])


def add_rms_norm(g: Graph, x: str, residual: str, weight: np.ndarray, eps: float, *, name: str,
                 weight_name: str, plugin: bool, kernel: bool = False) -> tuple[str, str]:
    """Returns (rms_norm(x + residual), x + residual); x, residual [T, len(weight)]."""
    _check(weight, weight_name)
    op = g.scope(name)
    w = g.weight(weight_name, np.asarray(weight, dtype=np.float32))
    if plugin and kernel:
        fused = _into_projection(g, x, residual, w, eps)
        if fused is not None:
            return fused
        normed, total = op("AddRMSNorm", [x, residual, w], outputs=2, domain=ENGINE_DOMAIN, epsilon=float(eps))
        return normed, total
    # ORT's fused com.microsoft SkipSimplifiedLayerNormalization measured 1.4-1.7x slower than Add followed by
    # RMSNormalization on its CPU provider (bench/plugin_lowerings.py), so the plugin is the two-kernel form.
    total = op("Add", [x, residual])
    return _norm(g, op, total, w, eps, plugin), total


# the engine's projection ops that add the residual and norm after them themselves (plugins/kernels/quant_matmul.cc)
_NORMED = {"QuantMatMul": "QuantMatMulAddRMSNorm", "QuantMLP": "QuantMLPAddRMSNorm"}


def _into_projection(g: Graph, x: str, residual: str, w: str, eps: float) -> tuple[str, str] | None:
    """(normed, total) of the engine QuantMatMul (or QuantMLP) that produced x, turned into its *AddRMSNorm op,
    when nothing else reads x (a later reader of the name would fail the build: the name is gone); else None."""
    producer = quant_matmul.foldable(g, x, 0, ops=tuple(_NORMED))
    if producer is None:
        return None
    producer.op_type = _NORMED[producer.op_type]
    producer.input.extend([residual, w])
    normed, total = f"{producer.name}/normed", f"{producer.name}/total"
    producer.output[:] = [normed, total]
    producer.attribute.append(helper.make_attribute("epsilon", float(eps)))
    return normed, total


def _check(weight: np.ndarray, weight_name: str) -> None:
    if weight.ndim != 1:
        raise EngineError(f"{weight_name} has shape {tuple(weight.shape)}; a norm weight must be 1-D: "
                          "re-run `engine convert`")


def _norm(g: Graph, op: Scope, x: str, w: str, eps: float, plugin: bool) -> str:
    if plugin:
        return op("RMSNormalization", [x, w], axis=-1, epsilon=float(eps))
    mean_sq = op("ReduceMean", [op("Mul", [x, x]), g.const([-1])], keepdims=1)
    rms = op("Sqrt", [op("Add", [mean_sq, g.const(eps, np.float32)])])
    return op("Mul", [op("Div", [x, rms]), w])
