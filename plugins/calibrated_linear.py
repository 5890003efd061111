"""Calibrated projections (quantization/calibrated_weights.py): x [T, in] -> [T, out] with int8_sq, fp8 or int4_awq
weights. Initializers are named by the canonical stem: "{stem}.weight", "{stem}.weights_scaling_factor",
"{stem}.activation_scaling_factor", "{stem}.prequant_scaling_factor".

    int8_sq (W8A8: per-channel int8 weights, int8 activations with one symmetric scale per token, at each call)
      per-token quantization (both lowerings):
        x ─Mul(prequant)─▶ xp ─Abs─▶ ReduceMax(axis -1) ─▶ s = max(amax, tiny) / 127 [T, 1]
        xq = QuantizeLinear(xp, s [T], zero point 128, axis 0): uint8 holding round(xp / s) + 128
      plugin=True:   MatMulInteger(xq, W^T+128 uint8 [K, N], 128, zero points [N] = 128) ─▶ int32 [T, N]
                     ─Cast─▶ * s [T, 1] ─▶ * scales [N] ─▶ (+bias)          (exact int32 accumulation)
      plugin=False:  DequantizeLinear(xq, s, 128, axis 0) ─┐
                     W^T+128 uint8 ─DequantizeLinear(scales, 128, axis=1)─▶ MatMul ─▶ (+bias)
      Per token, not per tensor: ORT's DynamicQuantizeMatMul (and DynamicQuantizeLinear) take one activation scale
      over all tokens of a step, and SmolLM2's outlier tokens (activations ~100x the rest) flatten every other
      token to a few int8 levels: +24% perplexity on SmolLM2-135M against +1.1% per token (tests/quantization/
      test_real_calibrated.py). MatMulIntegerToFloat cannot take it either (its activation scale is per tensor or
      per column of A). Measured on one 576x1536 projection (2 threads): 0.11 / 0.9 / 36 ms at 1 / 16 / 256
      tokens, the same as DynamicQuantizeMatMul.
      The weights are stored as uint8 with zero point 128, not as int8: MLAS's uint8 x int8 kernel saturates
      its 16-bit pair sums (measured: 0.5-0.8% error against exact arithmetic on one projection, 10% RMS on a tiny
      model's logits), its uint8 x uint8 kernel is exact (1e-7) and as fast.
    fp8 (e4m3 weights and activations, per-tensor scales; the activation scale is static, from calibration)
      x ─QuantizeLinear(a_scale, e4m3)─▶ DequantizeLinear ─┐
      W^T e4m3 [K, N] ─DequantizeLinear(w_scale)──────────▶ MatMul ─▶ (+bias)
      ORT's CPU provider runs these Q/DQ nodes emulated through float32 (there is no fp8 matmul on a CPU); TensorRT
      fuses the same pattern into an fp8 GEMM.
    int4_awq
      x ─Mul(prequant)─▶ plugins/linear.quantized_linear (MatMulNBits, or its DequantizeLinear reference)

The prequant Mul is the SmoothQuant / AWQ input scale (its inverse is folded into the weight); it is a cheap
elementwise op that ORT runs next to the norm that produces x.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx

from engine.quantization.calibrated_weights import CalibratedWeight, pack_int4
from engine.quantization.weight_only import QuantizedWeight

from .graph import Graph
from .linear import _add_bias, bias_name_for, quantized_gather, quantized_linear


def _int4(w: CalibratedWeight) -> QuantizedWeight:
    return QuantizedWeight(pack_int4(w.values, w.group_size), np.ascontiguousarray(w.weight_scale, np.float32), 4,
                           w.group_size)


def _place(g: Graph, w: CalibratedWeight, stem: str, weight_name: str) -> tuple[str, str, str | None]:
    """The table [K, N] (int8_sq: uint8 + 128; fp8: e4m3), its scales and (int8_sq) zero points, as initializers."""
    stored = (w.values.astype(np.int16) + 128).astype(np.uint8) if w.mode == "int8_sq" else w.values
    values = g.weight(weight_name, np.ascontiguousarray(stored.T))
    scales = g.weight(f"{stem}.weights_scaling_factor", np.asarray(w.weight_scale, np.float32))
    zero = g.weight(f"{stem}.weights_zero_point", np.full(w.shape[0], 128, np.uint8)) if w.mode == "int8_sq" \
        else None
    return values, scales, zero


def _quantize_per_token(g: Graph, op, x: str, token_amax=None) -> tuple[str, str, str, str]:
    """x [T, K] -> (uint8 round(x / s) + 128 [T, K], s [T, 1], s [T], zero points [T] = 128): symmetric, s = amax / 127
    of each row (a row of zeros gets a tiny scale and quantizes to 128). `token_amax(amax, name)`: x is this rank's
    slice of each token (a row-parallel projection at tp > 1), and the hook makes its amax the whole token's."""
    amax = op("ReduceMax", [op("Abs", [x]), g.const([-1])], keepdims=1)
    if token_amax is not None:
        amax = token_amax(amax, op.prefix)
    row_scale = op("Mul", [op("Max", [amax, g.const(1e-30, np.float32)]), g.const(1 / 127, np.float32)])
    flat = op("Reshape", [row_scale, g.const([-1])])
    row_zero = op("Expand", [g.const(128, np.uint8), op("Shape", [flat])])
    return op("QuantizeLinear", [x, flat, row_zero], axis=0), row_scale, flat, row_zero


def calibrated_linear(g: Graph, x: str, w: CalibratedWeight, bias: np.ndarray | None, *, name: str,
                      weight_name: str, bias_name: str | None = None, plugin: bool = True,
                      accuracy_level: int = 4, shared: bool = False, kernel: bool = False, token_amax=None) -> str:
    """x (* prequant) @ dequantize(w)^T (+ bias), lowered as the module docstring draws. `shared`: the table is
    already placed by calibrated_gather (a tied embedding), so its initializers are referenced, not added again.
    `token_amax`: int8_sq's per-token amax across ranks (see _quantize_per_token)."""
    stem = weight_name[: -len(".weight")]
    op = g.scope(name)
    bias_name = bias_name or bias_name_for(weight_name)
    if w.prequant is not None:
        pre = f"{stem}.prequant_scaling_factor"
        x = op("Mul", [x, pre if shared else g.weight(pre, w.prequant.astype(np.float32))])
    if w.mode == "int4_awq":
        return quantized_linear(g, x, _int4(w), bias, name=name, weight_name=weight_name, bias_name=bias_name,
                                accuracy_level=accuracy_level, plugin=plugin, shared=shared, kernel=kernel)
    if shared:
        values, scales = weight_name, f"{stem}.weights_scaling_factor"
        zero = f"{stem}.weights_zero_point" if w.mode == "int8_sq" else None
    else:
        values, scales, zero = _place(g, w, stem, weight_name)
    if w.mode == "int8_sq":
        xq, row_scale, flat_scale, row_zero = _quantize_per_token(g, op, x, token_amax)
        if plugin:
            acc = op("MatMulInteger", [xq, values, g.const(128, np.uint8), zero])
            y = op("Mul", [op("Mul", [op("Cast", [acc], to=onnx.TensorProto.FLOAT), row_scale]), scales])
        else:
            xd = op("DequantizeLinear", [xq, flat_scale, row_zero], axis=0)
            y = op("MatMul", [xd, op("DequantizeLinear", [values, scales, zero], axis=1)])
        return _add_bias(g, op, y, bias, bias_name)
    if w.mode == "fp8":
        a_scale = g.weight(f"{stem}.activation_scaling_factor", np.asarray(w.input_scale, np.float32))
        # the e4m3 zero point sets the output type; TensorRT's parser also reads it so (without one it quantizes
        # to INT8: onnx-tensorrt QuantDequantLinearHelper) and accepts it, as it never checks an FP8 zero point
        zero = g.const(0, ml_dtypes.float8_e4m3fn)
        xd = op("DequantizeLinear", [op("QuantizeLinear", [x, a_scale, zero]), a_scale])
        y = op("MatMul", [xd, op("DequantizeLinear", [values, scales])])
        return _add_bias(g, op, y, bias, bias_name)
    raise AssertionError(w.mode)


def calibrated_gather(g: Graph, w: CalibratedWeight, indices: str, *, name: str, weight_name: str,
                      plugin: bool = True, kernel: bool = False, accuracy_level: int = 0) -> str:
    """Rows `indices` of the float [V, H] table `w` quantizes (a tied embedding read from the quantized lm_head)
    -> [T, H]; places the table's initializers for a following calibrated_linear(..., shared=True).

        int8_sq:  table^T [H, V] ─Gather(axis 1)─▶ Transpose ─▶ (q - 128) * scales[ids] ─┐
        fp8:      table^T [H, V] ─Gather(axis 1)─▶ Transpose ─▶ DequantizeLinear(scale) ──┤─▶ * prequant ─▶ rows
        int4_awq: plugins/linear.quantized_gather (QuantGather or GatherBlockQuantized) ──┘
    The table holds W / prequant (SmoothQuant / AWQ moved the input scale into it), so rows are scaled back."""
    stem = weight_name[: -len(".weight")]
    op = g.scope(name)
    if w.mode == "int4_awq":
        rows = quantized_gather(g, _int4(w), indices, name=f"{name}/table", weight_name=weight_name, plugin=plugin,
                                kernel=kernel, accuracy_level=accuracy_level)
    else:
        values, scales, zero = _place(g, w, stem, weight_name)
        picked = op("Transpose", [op("Gather", [values, indices], axis=1)], perm=[1, 0])   # [T, H]
        if w.mode == "int8_sq":
            centered = op("Sub", [op("Cast", [picked], to=onnx.TensorProto.FLOAT), g.const(128.0, np.float32)])
            row_scales = op("Unsqueeze", [op("Gather", [scales, indices], axis=0), g.const([1])])
            rows = op("Mul", [centered, row_scales])
        else:
            rows = op("DequantizeLinear", [picked, scales])
    if w.prequant is not None:
        rows = op("Mul", [rows, g.weight(f"{stem}.prequant_scaling_factor", w.prequant.astype(np.float32))])
    return rows
