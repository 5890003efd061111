"""SmolLM2-135M-Instruct with an int8 KV cache: it still knows the capital of France, its pool is int8, and the
perplexity increase over the float32-KV engine (runtime/perplexity.py, via the build's accuracy report on text the
model samples itself) stays within target.

Measured here (calibration: 16 sampled sequences of 256 tokens; 2040 held-out tokens the float model sampled):
perplexity 29.768 (float32 KV) -> 29.829 (int8 KV), +0.20%; the target below leaves 5x room for other machines' and
torch versions' sampled text.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.builder.build import build_engine
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.quantization.accuracy import AccuracyOptions
from engine.quantization.modelopt_calibration import CalibrationOptions
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.session import EngineSession
from tests.real_model import next_token_after_france

pytestmark = pytest.mark.slow

BUILD = BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=1024, max_num_tokens=1024, kv_cache_dtype="int8")
TARGET_PPL_INCREASE = 1.0   # percent


@pytest.fixture(scope="module")
def engine(smollm2_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2_kv") / "int8_kv"
    build_engine(smollm2_checkpoint, out, BUILD, PluginConfig(),
                 calibration=CalibrationOptions(size=16, max_seq_len=256),
                 accuracy=AccuracyOptions(max_ppl_increase=TARGET_PPL_INCREASE))
    return out


def test_int8_kv_knows_the_capital_of_france(engine):
    assert next_token_after_france(engine) == " Paris"


def test_int8_kv_perplexity_and_pool(engine):
    config = load_engine_config(engine)
    report = config.quantization.accuracy
    print(f"SmolLM2 int8 KV: perplexity {report['reference_ppl']} -> {report['quantized_ppl']} "
          f"({report['ppl_increase_pct']:+.2f}%) on {report['tokens']} tokens")
    assert report["ppl_increase_pct"] <= TARGET_PPL_INCREASE
    session = EngineSession(engine, num_blocks=4)
    m = config.model
    k = session.kv_pool[0][0]
    assert k.dtype == np.int8 and k.nbytes == 4 * BUILD.tokens_per_block * m.num_kv_heads * m.head_dim
