"""Quantized tiny engines, cached per test session, and the per-mode tolerances of their logits.

Tolerances bound the relative RMS difference of a quantized engine's logits from the float32 engine's on the
tiny random models (weights ~N(0, 0.02), hidden 64, where RTN error is large relative to the weights), at the
default accuracy_level 4 (int8 activations inside MatMulNBits): measured int8_wo 0.8-1.4%, int4_wo 7-14%.
A wrong scale, nibble order or layout gives errors near 100%; the exact check of the lowering is
MatMulNBits against the DequantizeLinear reference engine (test_engines.py).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from engine.builder.build import build_engine
from engine.core.model_config import QuantConfig
from engine.plugins import quant_matmul
from engine.quantization.accuracy import AccuracyOptions
from tests.builder.engines import ALL_PLUGINS, NO_PLUGINS, TEST_BUILD, TinyEngines, slug

LOGITS_RELATIVE_RMS = {"int8_wo": 0.03, "int4_wo": 0.25}
# Where the CPU has AVX-512 VNNI weight-only projections run as the engine's QuantMatMul, elsewhere as
# MatMulNBits (plugins/linear.py), and a tied embedding reads a quantized lm_head's table with the engine's
# QuantGather, elsewhere with GatherBlockQuantized.
REPACKED = quant_matmul.supported(32, 4)
PROJECTION_OP = "engine.QuantMatMul" if REPACKED else "com.microsoft.MatMulNBits"
GATHER_OP = "engine.QuantGather" if REPACKED else "com.microsoft.GatherBlockQuantized"
# QuantMatMul's fused forms, with the projections each holds: the residual add and norm after it folded in
# (plugins/rms_norm.py), a gated MLP's two projections in one node (plugins/gated_mlp.quant_mlp), the q|k|v
# projection inside the attention node (plugins/attention.py)
FUSED_PROJECTION_OPS = {"engine.QuantMatMulAddRMSNorm": 1, "engine.QuantMLP": 2, "engine.QuantMLPAddRMSNorm": 2,
                        **{f"engine.QuantRotaryPagedAttention{kv}": 1 for kv in ("", "Fp16", "Int8", "Fp8")}}


def projections(counts: dict[str, int], op: str = PROJECTION_OP) -> int:
    """The projections `op` computes in an engine of these op counts, those of QuantMatMul's fused forms included."""
    fused = FUSED_PROJECTION_OPS if op == "engine.QuantMatMul" else {}
    return counts.get(op, 0) + sum(n * counts.get(f, 0) for f, n in fused.items())


def stored_projection(inits: dict, stem: str, n: int, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """(q uint8 [N, K], scales [N, K/G]) of a weight-only projection as the engine stores it, either layout."""
    from onnx import numpy_helper
    from engine.quantization.weight_only import QuantizedWeight, unpack
    packed = numpy_helper.to_array(inits[f"{stem}.weight"])
    if REPACKED:
        values, scales, _ = quant_matmul.unpack_blocks(packed, n, bits, group, offsets=False)
        return values, scales
    scales = numpy_helper.to_array(inits[f"{stem}.weights_scaling_factor"])
    return unpack(QuantizedWeight(packed, scales, bits, group)), scales
NO_REPORT = AccuracyOptions(eval_tokens=0)


def quant_engine(tiny: TinyEngines, key: str, mode: str, *, plugins: bool = True, lm_head: bool = False,
                 accuracy_level: int = 4, opt_level: str = "all", group_size: int | None = None) -> Path:
    d = tiny.root / slug(key) / f"engine_{mode}_{'plugins' if plugins else 'reference'}_lm{int(lm_head)}" \
        f"_acc{accuracy_level}_{opt_level}_g{group_size}"
    if not d.exists():
        build = dataclasses.replace(TEST_BUILD, opt_level=opt_level)
        plugin_config = ALL_PLUGINS if plugins else dataclasses.replace(NO_PLUGINS,
                                                                        weight_only_quant_matmul_plugin=False)
        build_engine(tiny.checkpoint(key), d, build, plugin_config, accuracy=NO_REPORT,
                     quant=QuantConfig(mode=mode, quantize_lm_head=lm_head, accuracy_level=accuracy_level,
                                       group_size=group_size))
    return d


def relative_rms(actual: np.ndarray, expected: np.ndarray) -> float:
    assert actual.shape == expected.shape and np.isfinite(actual).all()
    return float(np.sqrt(np.mean((actual - expected) ** 2)) / np.sqrt(np.mean(expected ** 2)))
