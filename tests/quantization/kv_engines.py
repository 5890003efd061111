"""Tiny engines with a quantized (int8 or fp8) KV cache and their float-KV twins, cached per test session, and
teacher-forced decoding, so a quantized-KV engine and a float-KV engine are compared on the same tokens."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from engine.builder.build import build_engine
from engine.core.model_config import QuantConfig
from engine.quantization.modelopt_calibration import CalibrationOptions
from engine.runtime.step_inputs import SeqChunk
from tests.builder.engines import ALL_PLUGINS, NO_PLUGINS, TEST_BUILD, TinyEngines, slug
from tests.quantization.engines import NO_REPORT

# a few short sequences the model samples itself: enough for absmax scales on the tiny models, fast to build
KV_CALIBRATION = CalibrationOptions(size=8, max_seq_len=32)


def kv_engine(tiny: TinyEngines, key: str, kv: str = "int8", *, plugins: bool = True, mode: str | None = None,
              tp: int = 1) -> Path:
    """The tiny engine of `key` with --kv-cache-dtype `kv`, weights unquantized or in `mode`, at `tp`."""
    d = tiny.root / slug(key) / f"engine_kv{kv}_{mode}_{'plugins' if plugins else 'reference'}_tp{tp}"
    if not d.exists():
        plugin_config = ALL_PLUGINS if plugins else dataclasses.replace(NO_PLUGINS,
                                                                        weight_only_quant_matmul_plugin=False)
        build_engine(tiny.checkpoint(key), d, dataclasses.replace(TEST_BUILD, kv_cache_dtype=kv, tp_size=tp),
                     plugin_config, quant=QuantConfig(mode=mode), accuracy=NO_REPORT, calibration=KV_CALIBRATION)
    return d


def forced_logits(session, ids: list[int], forced: list[int], blocks: list[int], *, chunk: int | None = None
                  ) -> np.ndarray:
    """Prefill `ids` (in chunks of `chunk` tokens, else at once), then decode the `forced` tokens one per step:
    the logits after the prompt and after each forced token, [1 + len(forced), vocab]."""
    step = chunk or len(ids)
    for start in range(0, len(ids), step):
        part = ids[start:start + step]
        last = session.run([SeqChunk(part, start, blocks, True)])[0]
    logits = [last]
    for k, token in enumerate(forced):
        logits.append(session.run([SeqChunk([token], len(ids) + k, blocks, True)])[0])
    return np.stack(logits)


def relative_rms(actual: np.ndarray, expected: np.ndarray) -> float:
    assert actual.shape == expected.shape and np.isfinite(actual).all()
    return float(np.sqrt(np.mean((actual - expected) ** 2)) / np.sqrt(np.mean(expected ** 2)))
