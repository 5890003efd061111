"""Which quantized builds TensorRT takes, and how (builder/tensorrt_backend.py builds them). TensorRT networks are
strongly typed: reduced precision comes from explicit Q/DQ nodes with build-time constant, symmetric scales (TensorRT
"Working with Quantized Types", operators/Quantize.html; onnx-tensorrt's QuantizeLinear/DequantizeLinear importer).

    check_tensorrt_quant(mode)        int8_wo, int4_wo, int4_awq, fp8 or none; int8_sq refused (why below)
    tensorrt_quant(quant, model, tp)  the requested QuantConfig with int4 in TensorRT's blocks of 64 or 128
    tensorrt_precision(mode)          config.json's precision lines that differ from onnxruntime's
"""
from __future__ import annotations

import dataclasses

from engine.core.errors import EngineError
from engine.core.model_config import ModelConfig, QuantConfig
from engine.quantization.modes import quantized_in_features

# --dtype modes whose TensorRT flavour is explicit Q/DQ as TensorRT documents it: int8_wo, int4_wo and int4_awq as
# DequantizeLinear (no zero point) + MatMul, int4_awq after its prequant Mul; fp8 as QuantizeLinear (static
# per-tensor scale, e4m3 zero point: its type selects FP8 in the parser) -> DequantizeLinear, weights e4m3 ->
# DequantizeLinear, every scale an initializer (plugins/calibrated_linear.py, tests/tensorrt/test_calibrated_flavour.py).
TENSORRT_QUANT_MODES = (None, "int8_wo", "int4_wo", "fp8", "int4_awq")


def check_tensorrt_quant(mode: str | None) -> None:
    """Refuse a --dtype whose graph TensorRT cannot take. int8_sq quantizes activations with scales computed in the
    graph, one per token, to uint8 with zero point 128; TensorRT's Q/DQ takes a build-time constant scale, a zero
    point of 0 and signed INT8 (TensorRT operators/Quantize.html; onnx-tensorrt's QuantizeLinear importer refuses
    UINT8 and a scale of dynamic shape), and one static per-tensor scale measured +24% perplexity on SmolLM2-135M."""
    if mode in TENSORRT_QUANT_MODES:
        return
    if mode == "int8_sq":
        raise EngineError("--dtype int8_sq cannot be built with --backend tensorrt: its activation scales are computed "
                          "in the graph, one per token, and TensorRT's INT8 Q/DQ takes only constant, symmetric scales "
                          "(one static per-tensor scale measured +24% perplexity on SmolLM2-135M); use --dtype fp8, "
                          "int8_wo or int4_awq on TensorRT, or --backend onnxruntime", usage=True)
    raise EngineError(f"--dtype {mode} has no TensorRT flavour; use one of "
                      f"{', '.join(m for m in TENSORRT_QUANT_MODES if m)} on TensorRT, or --backend onnxruntime",
                      usage=True)


def tensorrt_precision(mode: str) -> dict:
    """The lines of config.json's precision record that differ on TensorRT for quantized `mode` (the onnxruntime
    ones name MatMulNBits and ORT's emulated fp8)."""
    if mode == "fp8":
        return {"note": "fp8 as QuantizeLinear/DequantizeLinear, which TensorRT fuses into FP8 GEMMs (GPUs of compute "
                        "capability 8.9 or later)"}
    return {"activations": "float32" + (" (AWQ input scale applied)" if mode == "int4_awq" else "")
                           + "; TensorRT dequantizes the weights (DequantizeLinear) into float32 GEMMs"}


INT4_BLOCKS = (128, 64)  # TensorRT's INT4 block sizes ("Quantization Schemes": "The supported block sizes are {64, 128}")


def tensorrt_quant(quant: QuantConfig, model: ModelConfig, tp: int) -> QuantConfig:
    """The requested QuantConfig as TensorRT takes it: a mode of TENSORRT_QUANT_MODES, and int4 in blocks of 64 or
    128 only (when no group is asked for, the largest dividing every quantized projection), so a checkpoint's 4-bit
    blocks of 32 (GGUF Q4_0/Q4_1) are quantized again instead of kept as they are on onnxruntime."""
    check_tensorrt_quant(quant.mode)
    if quant.mode not in ("int4_wo", "int4_awq"):
        return quant
    if quant.group_size is not None:
        if quant.group_size not in INT4_BLOCKS:
            raise EngineError(f"--group-size {quant.group_size} with --backend tensorrt: TensorRT's INT4 blocks are "
                              f"{' or '.join(map(str, sorted(INT4_BLOCKS)))}; pass one of them, or --backend "
                              "onnxruntime", usage=True)
        return quant
    features = quantized_in_features(model, tp, quant.quantize_lm_head).values()
    for group in INT4_BLOCKS:
        if all(k % group == 0 for k in features):
            return dataclasses.replace(quant, group_size=group)
    raise EngineError(f"--dtype {quant.mode} with --backend tensorrt: neither of TensorRT's INT4 block sizes "
                      f"({', '.join(map(str, sorted(INT4_BLOCKS)))}) divides the in features {sorted(set(features))} "
                      "of this model; use --dtype int8_wo or fp8 on TensorRT, or --backend onnxruntime", usage=True)
