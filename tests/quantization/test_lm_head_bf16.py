"""--lm-head-dtype bfloat16: lm_head (and a tied embedding) as the engine's Bf16MatMul / Bf16Gather over one bfloat16
table; logits against the float32 engine's, what is stored, the auto default and the flag's errors."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from engine.builder.build import build_engine
from engine.builder.onnxruntime_backend import op_counts
from engine.core.errors import EngineError
from engine.core.model_config import QuantConfig
from engine.plugins import bf16_matmul
from engine.quantization import modes
from engine.runtime.engine_dir import load_engine_config
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD, slug

from .engines import LOGITS_RELATIVE_RMS, NO_REPORT, relative_rms
from .test_engines import _logits

pytestmark = pytest.mark.skipif(not bf16_matmul.supported(64), reason="this CPU has no AVX-512 BF16 dot products")

TIED, UNTIED = "LlamaForCausalLM:llama3-rope-tied", "LlamaForCausalLM"


def bf16_engine(tiny, key: str, mode: str | None = None):
    d = tiny.root / slug(key) / f"engine_{mode}_lm_bf16"
    if not d.exists():
        build_engine(tiny.checkpoint(key), d, TEST_BUILD, ALL_PLUGINS, accuracy=NO_REPORT,
                     quant=QuantConfig(mode=mode, lm_head_dtype="bfloat16"))
    return d


@pytest.mark.parametrize("key", [TIED, UNTIED])
def test_logits_are_the_float_engines_to_bfloat16_rounding(tiny, key):
    """Prefill and decode logits within bfloat16's rounding of the float32 engine's (its 8-bit mantissa on lm_head's
    weights and input: ~0.3% relative RMS here), and visibly not equal to them (the table really is 16-bit)."""
    batch = [[3, 17, 5, 99, 42, 7, 11], list(range(20, 39))]
    ref_prefill, ref_tokens, ref_decode = _logits(tiny.engine(key), batch)
    prefill, tokens, decode = _logits(bf16_engine(tiny, key), batch)
    for actual, expected in ((prefill, ref_prefill), (decode[:1], ref_decode[:1])):
        assert 1e-4 < relative_rms(actual, expected) < 0.01


@pytest.mark.parametrize("key, tied", [(TIED, True), (UNTIED, False)])
def test_one_bfloat16_table_is_stored(tiny, key, tied):
    engine = bf16_engine(tiny, key)
    inits = {t.name: t for t in onnx.load(str(engine / "rank0.onnx")).graph.initializer}
    counts = op_counts(engine / "rank0.onnx")
    table = inits["vocab_embedding.weight" if tied else "lm_head.weight"]
    assert table.data_type == onnx.TensorProto.UINT16 and counts.get("engine.Bf16MatMul") == 1
    m = load_engine_config(engine).model
    np.testing.assert_array_equal(bf16_matmul.unpack(numpy_helper.to_array(table), m.vocab_size).shape,
                                  (m.vocab_size, m.hidden_size))
    if tied:   # the embedding gathers from the same table; no float copy of it is left
        assert counts.get("engine.Bf16Gather") == 1 and "lm_head.weight" not in inits
    else:
        assert inits["vocab_embedding.weight"].data_type == onnx.TensorProto.FLOAT and "engine.Bf16Gather" not in counts
    config = load_engine_config(engine)
    assert config.quantization.lm_head_dtype == "bfloat16" and "Bf16MatMul" in config.precision["lm_head"]
    data = (engine / "rank0.onnx.data").stat().st_size
    assert data <= config.memory.weight_bytes_per_rank[0] <= data * 1.05


@pytest.mark.parametrize("mode", ["int8_wo", "int4_wo"])
def test_with_quantized_layers_within_the_modes_tolerance(tiny, mode):
    from .engines import quant_engine
    batch = [[3, 17, 5, 99, 42, 7, 11], list(range(20, 39))]
    float_head, _, _ = _logits(quant_engine(tiny, TIED, mode), batch)
    ref, _, _ = _logits(tiny.engine(TIED), batch)
    prefill, _, _ = _logits(bf16_engine(tiny, TIED, mode), batch)
    assert relative_rms(prefill, ref) <= LOGITS_RELATIVE_RMS[mode]
    assert relative_rms(prefill, float_head) < 0.01   # the head's rounding is small beside the layers'


def test_auto_is_bfloat16_for_calibrated_builds_where_it_runs(tiny):
    """(Weight-only modes take an int8 lm_head: test_lm_head_int8.py.)"""
    from engine.core.artifacts import load_checkpoint_config
    model = load_checkpoint_config(tiny.checkpoint(UNTIED)).model
    auto = QuantConfig(mode="fp8", lm_head_dtype="auto")

    def resolved(q=auto, backend="onnxruntime", kernels=True, m=model):
        return modes.resolve_lm_head_dtype(q, m, backend=backend, kernels=kernels).lm_head_dtype
    assert resolved() == "bfloat16"
    assert resolved(dataclasses.replace(auto, mode=None)) == "float32"             # a float32 build stays float32
    assert resolved(dataclasses.replace(auto, quantize_lm_head=True)) == "float32"  # its own precision
    assert resolved(backend="tensorrt") == "float32" and resolved(kernels=False) == "float32"
    assert resolved(m=dataclasses.replace(model, hidden_size=48)) == "float32"


@pytest.mark.parametrize("quant, plugins, match", [
    (QuantConfig(mode="int8_wo", lm_head_dtype="float16"), ALL_PLUGINS, "'float16' is not one of auto, float32"),
    (QuantConfig(mode="int8_wo", quantize_lm_head=True, lm_head_dtype="bfloat16"), ALL_PLUGINS,
     "both set lm_head's precision"),
    (QuantConfig(lm_head_dtype="bfloat16"), dataclasses.replace(ALL_PLUGINS, engine_kernels_plugin=False),
     "needs --engine-kernels-plugin enable"),
])
def test_bad_requests_fail_before_anything_is_written(tiny, tmp_path, quant, plugins, match):
    with pytest.raises(EngineError, match=match):
        build_engine(tiny.checkpoint(UNTIED), tmp_path / "e", TEST_BUILD, plugins, quant=quant, accuracy=NO_REPORT)
    assert not (tmp_path / "e").exists()
