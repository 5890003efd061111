"""Calibrated (ModelOpt) tiny engines, cached per test session, and the per-mode tolerances of their logits.

Tolerances bound the relative RMS difference of a calibrated engine's logits from the float32 engine's on the tiny
random models, calibrated on 8 self-sampled sequences of 32 tokens. Measured: int8_sq ~1.0%, fp8 ~4%, int4_awq
~9% (a wrong scale, layout or smoothing direction gives errors near 100%). The exact checks of the lowerings are
against ModelOpt's own fake-quant model (fp8, int4_awq) and against the DequantizeLinear reference (int8_sq).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.builder.build import build_engine
from engine.core.model_config import QuantConfig
from engine.quantization.modelopt_calibration import CalibrationOptions
from tests.builder.engines import ALL_PLUGINS, NO_PLUGINS, TEST_BUILD, TinyEngines, slug

from .engines import NO_REPORT

CALIBRATED_TOLERANCE = {"int8_sq": 0.03, "fp8": 0.08, "int4_awq": 0.2}
TINY_CALIBRATION = CalibrationOptions(size=8, max_seq_len=32)


def calibrated_engine(tiny: TinyEngines, key: str, mode: str, *, plugins: bool = True, lm_head: bool = False,
                      accuracy_level: int | None = None, opt_level: str = "all") -> Path:
    d = tiny.root / slug(key) / f"calibrated_{mode}_{'plugins' if plugins else 'reference'}_lm{int(lm_head)}" \
        f"_acc{accuracy_level}_{opt_level}"
    if not d.exists():
        build = dataclasses.replace(TEST_BUILD, opt_level=opt_level)
        plugin_config = ALL_PLUGINS if plugins else dataclasses.replace(NO_PLUGINS,
                                                                        weight_only_quant_matmul_plugin=False)
        build_engine(tiny.checkpoint(key), d, build, plugin_config, accuracy=NO_REPORT,
                     quant=QuantConfig(mode=mode, quantize_lm_head=lm_head, accuracy_level=accuracy_level),
                     calibration=TINY_CALIBRATION)
    return d
