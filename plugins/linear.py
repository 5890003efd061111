"""Dense projection: x [T, in] @ W^T (+ bias) -> [T, out], in float32 or with weight-only quantized weights.

Weights arrive in torch Linear layout [out_features, in_features]; they are transposed once here, at build time,
so the graph holds MatMul-ready [in, out] initializers and no Transpose node. Knows nothing of which projection
it builds; the caller names the initializers by their canonical tensor names.

    x [T, in] ──MatMul(W^T [in, out])──▶ [T, out] ──Add(bias [out])──▶ y     (Add only with a bias)

With the engine's kernels (`kernel`) on a CPU with their vector code, the float32 weight is stored as QuantMatMul's
float32 tiles instead (bits=32, plugins/quant_matmul.pack_float), one stream a projection at the memory's rate:

    x [T, in] ──engine QuantMatMul(tiles uint8 [out/16, 1, in * 64], bits=32)──▶ [T, out] ──▶ (+bias) y

Quantized (`scheme` given; quantization/weight_only.py quantizes, scales stored next to their weight as
"{stem}.weights_scaling_factor", TensorRT-LLM's name):

    plugin=True, kernel=True, accuracy level 4 on a CPU with AVX-512 VNNI or AVX2 (plugins/quant_matmul.supported):
                   x ──engine QuantMatMul(blocks [N/16, K/g, 64 + g*16*bits/8] uint8)──▶ (+bias) y
                   one pass over the weights, scales (and a kept block's offsets) inside the blocks; measured on
                   SmolLM2 at 2 threads: 1.7x MatMulNBits + BlockOffsets at one token, 2.5x at 512 on a Zen 4
                   (VNNI; bench/NOTES.md)
    plugin=True:   x ──com.microsoft MatMulNBits(packed [N, K/g, g*bits/8] uint8, scales [N, K/g])──▶ (+bias) y
    plugin=False:  DequantizeLinear(q [K, N] int4|int8, scales [K/g, N], axis=0, block_size=g) ──▶ W^T
                   x ──MatMul(W^T)──▶ (+bias) y          (the opset-21 blocked reference, dequantized per call)

Weights kept on their checkpoint's 4-bit grid carry a float offset per block (quantization/weight_only.block_grid),
added by both lowerings as a second product over the block sums of x:

    x ─Reshape [T, K/g, g]─▶ ReduceSum(-1) ─▶ [T, K/g] ─MatMul(offsets^T [K/g, N])─▶ Add to y
    kernel=True:   (x, y, offsets^T) ─engine BlockOffsets─▶ y + the same product, one node instead of four
                   (plugins/kernels/block_offsets.cc)

and MatMulNBits reads their float16 scales through a Cast, which ORT folds into a float32 initializer when the
session loads (the engine stores 2 bytes a block, not 4).

ORT's level-2 optimizer fuses that DequantizeLinear + MatMul back into MatMulNBits (at its session default
accuracy level 4), so the reference stays a reference only in a graph run unoptimized (tests do that).

`quantized_gather` reads rows of the same packed table (the engine's QuantGather of QuantMatMul's blocks, or ORT
GatherBlockQuantized of MatMulNBits' packing), so a tied embedding and a quantized lm_head share one initializer.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from onnx import TensorProto

from engine.core.errors import EngineError
from engine.plugins import quant_matmul
from engine.quantization.weight_only import QuantizedWeight, WeightOnlyScheme, quantize, signed_values

from .graph import ENGINE_DOMAIN, MS_DOMAIN, Graph, Scope


def _stem(weight_name: str) -> str:
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name


def bias_name_for(weight_name: str) -> str:
    """Canonical name of a weight's bias: "layers.0.attention.qkv.weight" -> "layers.0.attention.qkv.bias"."""
    return f"{_stem(weight_name)}.bias"


def scale_name_for(weight_name: str) -> str:
    """Canonical name of a quantized weight's scales: "...qkv.weight" -> "...qkv.weights_scaling_factor"."""
    return f"{_stem(weight_name)}.weights_scaling_factor"


def linear(g: Graph, x: str, weight: np.ndarray, bias: np.ndarray | None, *, name: str, weight_name: str,
           bias_name: str | None = None, scheme: WeightOnlyScheme | None = None, plugin: bool = True,
           kernel: bool = False) -> str:
    """MatMul with the transposed `weight` as initializer `weight_name`; plus Add of `bias` as initializer
    `bias_name` (default: `weight_name` with ".weight" replaced by ".bias"). With `scheme`, the weight is
    quantized and lowered as the module docstring draws (`plugin` picks MatMulNBits or the reference; `kernel` the
    engine's op for the offsets of kept blocks)."""
    if weight.ndim != 2:
        raise EngineError(f"{weight_name} has shape {tuple(weight.shape)}; a linear weight must be 2-D "
                          "[out_features, in_features]: re-run `engine convert`")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise EngineError(f"bias of {weight_name} has shape {tuple(bias.shape)}, expected ({weight.shape[0]},) "
                          "to match the weight's out_features: re-run `engine convert`")
    if scheme is not None:
        q = quantize(np.asarray(weight, dtype=np.float32), scheme, name=weight_name)
        return quantized_linear(g, x, q, bias, name=name, weight_name=weight_name, bias_name=bias_name,
                                accuracy_level=scheme.accuracy_level, plugin=plugin, kernel=kernel)
    op = g.scope(name)
    y = float_matmul(g, op, x, weight, weight_name, kernel=kernel)
    return _add_bias(g, op, y, bias, bias_name or bias_name_for(weight_name))


def float_matmul(g: Graph, op: Scope, x: str, weight: np.ndarray, weight_name: str, *, kernel: bool) -> str:
    """x @ weight^T for a float32 weight [N, K]: the engine's QuantMatMul over float32 tiles where `kernel` and the
    CPU run them (plugins/quant_matmul.float_runs), else MatMul of the transposed weight."""
    if quant_matmul.float_runs(weight.shape[0], kernel=kernel):
        return quant_matmul.float_node(op, x, g.weight(weight_name, quant_matmul.pack_float(weight)), *weight.shape)
    return op("MatMul", [x, g.weight(weight_name, np.asarray(weight, dtype=np.float32).T)])


def quantized_linear(g: Graph, x: str, q: QuantizedWeight, bias: np.ndarray | None, *, name: str,
                     weight_name: str, bias_name: str | None = None, accuracy_level: int = 0,
                     plugin: bool = True, shared: bool = False, kernel: bool = False) -> str:
    """x @ dequantize(q)^T (+ bias). `shared`: the packed table and scales are already initializers of `g`
    (placed by quantized_gather), so they are referenced, not added again."""
    n, k = q.shape
    op = g.scope(name)
    scales = scale_name_for(weight_name)
    if quant_matmul.runs(q.group_size, accuracy_level, plugin=plugin, kernel=kernel):
        blocks = weight_name if shared else g.weight(weight_name, quant_matmul.pack(q))
        y = op("QuantMatMul", [x, blocks], domain=ENGINE_DOMAIN, N=n, bits=q.bits, group_size=q.group_size,
               offsets=int(q.offsets is not None))
        return _add_bias(g, op, y, bias, bias_name or bias_name_for(weight_name))
    if plugin:
        if not shared:
            g.weight(weight_name, q.packed)
            g.weight(scales, q.scales.astype(np.float16) if q.half_scales else q.scales)
        if q.half_scales:  # widened when the session loads (ORT folds the Cast; builder/onnxruntime_backend.py)
            scales = op("Cast", [scales], to=TensorProto.FLOAT)
        y = op("MatMulNBits", [x, weight_name, scales], domain=MS_DOMAIN, K=k, N=n, bits=q.bits,
               block_size=q.group_size, accuracy_level=accuracy_level)
    else:
        w_t = _dequantize_node(g, op, q, weight_name, scales, shared)
        y = op("MatMul", [x, w_t])
    if q.offsets is not None:
        assert not shared, "a table read by GatherBlockQuantized has no offsets"
        offsets = g.weight(f"{_stem(weight_name)}.weights_offset", np.ascontiguousarray(q.offsets.T))
        if kernel:
            y = op("BlockOffsets", [x, y, offsets], domain=ENGINE_DOMAIN, group_size=q.group_size)
        else:
            sums = op("ReduceSum", [op("Reshape", [x, g.const([-1, k // q.group_size, q.group_size])]),
                                    g.const([-1])], keepdims=0)
            y = op("Add", [y, op("MatMul", [sums, offsets])])
    return _add_bias(g, op, y, bias, bias_name or bias_name_for(weight_name))


def quantized_gather(g: Graph, table: QuantizedWeight, indices: str, *, name: str, weight_name: str,
                     plugin: bool = True, kernel: bool = False, accuracy_level: int = 0) -> str:
    """Rows `indices` of the dequantized [V, H] `table` -> [T, H]; places the table's initializers, which a
    following quantized_linear(..., shared=True) of the same `weight_name`, `plugin`, `kernel` and
    `accuracy_level` reuses (tied lm_head): QuantMatMul's blocks read by the engine's QuantGather, or
    MatMulNBits' packing read by GatherBlockQuantized."""
    v, h = table.shape
    op = g.scope(name)
    scales = scale_name_for(weight_name)
    if quant_matmul.runs(table.group_size, accuracy_level, plugin=plugin, kernel=kernel):
        return op("QuantGather", [g.weight(weight_name, quant_matmul.pack(table)), indices], domain=ENGINE_DOMAIN,
                  bits=table.bits, group_size=table.group_size, offsets=int(table.offsets is not None))
    if plugin:
        g.weight(weight_name, table.packed)
        g.weight(scales, table.scales)
        # GatherBlockQuantized blocks along the quantize axis of the data as stored: the last axis of the 3-D
        # packed table, so its scales need a trailing unit axis; the result [T, K/g, g] is reshaped to [T, H].
        scales_3d = g.weight(f"{scales}.gather", table.scales[:, :, None])
        rows = op("GatherBlockQuantized", [weight_name, indices, scales_3d], domain=MS_DOMAIN, gather_axis=0,
                  quantize_axis=2, block_size=table.group_size, bits=table.bits)
        return op("Reshape", [rows, g.const([-1, h])])
    w_t = _dequantize_node(g, op, table, weight_name, scales, False)
    return op("Gather", [op("Transpose", [w_t], perm=[1, 0]), indices], axis=0)


def _dequantize_node(g: Graph, op, q: QuantizedWeight, weight_name: str, scales: str, shared: bool) -> str:
    """Reference: DequantizeLinear of the signed [K, N] integers, blocked along K -> float W^T [K, N]."""
    if not shared:
        values = signed_values(q).T
        g.weight(weight_name, values.astype(ml_dtypes.int4) if q.bits == 4 else values)
        g.weight(scales, np.ascontiguousarray(q.scales.T))
    return op("DequantizeLinear", [weight_name, scales], axis=0, block_size=q.group_size)


def _add_bias(g: Graph, op, y: str, bias: np.ndarray | None, bias_name: str) -> str:
    if bias is None:
        return y
    return op("Add", [y, g.weight(bias_name, np.asarray(bias, dtype=np.float32))])
