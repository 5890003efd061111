"""How far re-quantizing a GGUF file's weights to int4_wo / int8_wo (group 32) moves them from the file's values: what
building a GGUF mixture of experts costs, whose experts are dequantized at convert (docs/moe.md, bench/NOTES.md 61).

    .venv/bin/python -m bench.moe_requant

Real FFN tensors of Qwen2.5-Coder-1.5B Q4_K_M (its first Q4_K and Q6_K ones; gguf-py cannot write K-quants) and
random N(0, 0.02) weights written as Q4_0 and Q8_0; prints the relative RMS change of each.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize, quantize

from engine.quantization.weight_only import WeightOnlyScheme
from engine.quantization.weight_only import dequantize as wo_dequantize
from engine.quantization.weight_only import quantize as wo_quantize

from bench import real_models


def relative_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def requantized(values: np.ndarray) -> str:
    """'int4_wo X, int8_wo Y': how far each moves `values`."""
    moved = {bits: wo_dequantize(wo_quantize(values, WeightOnlyScheme(bits, 32))) for bits in (4, 8)}
    return ", ".join(f"int{bits}_wo {relative_rms(m, values):.4f}" for bits, m in moved.items())


def main() -> None:
    seen = set()
    for t in GGUFReader(str(real_models.gguf("qwen2.5-coder-1.5b"))).tensors:
        kind = GGMLQuantizationType(t.tensor_type).name
        if t.name.startswith("blk.") and ".ffn_" in t.name and kind in ("Q4_K", "Q6_K") and kind not in seen:
            seen.add(kind)
            values = dequantize(np.array(t.data), t.tensor_type).astype(np.float32)
            print(f"{t.name} {kind} {list(values.shape)}: {requantized(values)}")
    weights = (np.random.default_rng(0).standard_normal((1536, 2048)) * 0.02).astype(np.float32)
    for kind in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0):
        values = dequantize(quantize(weights, kind), kind).astype(np.float32)
        print(f"random N(0, 0.02) {kind.name} (file vs float {relative_rms(values, weights):.4f}): {requantized(values)}")


if __name__ == "__main__":
    main()
