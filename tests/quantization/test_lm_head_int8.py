"""--lm-head-dtype int8: lm_head (and a tied embedding) in int8 blocks of 32 on llama.cpp's Q8_0 rule, beside
weight-only layers; the rule against a Q8_0 table, the stored table, logits against the float-head engine's, tp=2,
the auto default and the flag's errors."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from engine.builder.build import build_engine
from engine.builder.onnxruntime_backend import op_counts
from engine.core.errors import EngineError
from engine.core.model_config import QuantConfig
from engine.plugins import bf16_matmul
from engine.quantization import modes
from engine.quantization.weight_only import WeightOnlyScheme, dequantize, quantize, quantize_q8_0
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.session import EngineSession
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD, slug

from .engines import GATHER_OP, LOGITS_RELATIVE_RMS, NO_REPORT, projections, quant_engine, relative_rms, \
    stored_projection
from .test_engines import _logits

TIED, UNTIED = "LlamaForCausalLM:llama3-rope-tied", "LlamaForCausalLM"
BATCH = [[3, 17, 5, 99, 42, 7, 11], list(range(20, 39))]


def int8_head_engine(tiny, key: str, mode: str, tp: int = 1):
    d = tiny.root / slug(key) / f"engine_{mode}_lm_int8_tp{tp}"
    if not d.exists():
        build_engine(tiny.checkpoint(key), d, dataclasses.replace(TEST_BUILD, tp_size=tp), ALL_PLUGINS,
                     accuracy=NO_REPORT, quant=QuantConfig(mode=mode, lm_head_dtype="int8"))
    return d


def q8_0_table(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A table as a GGUF Q8_0 file holds it: per block of 32, d * q with d a float16 and q in -127..127 (the
    largest |q| is 127: Q8_0's d is the block's max |w| / 127)."""
    rng = np.random.default_rng(seed)
    d = (rng.uniform(1e-4, 1e-2, (rows, cols // 32))).astype(np.float16).astype(np.float32)
    q = rng.integers(-127, 128, (rows, cols // 32, 32))
    q[..., 0] = rng.choice([-127, 127], (rows, cols // 32))
    return (q * d[..., None]).reshape(rows, cols).astype(np.float32)


def test_the_q8_0_rule_keeps_a_q8_0_table_exactly_where_rtn_moves_it():
    table = q8_0_table(64, 96)
    np.testing.assert_array_equal(dequantize(quantize_q8_0(table, 32)), table)
    rtn = dequantize(quantize(table, WeightOnlyScheme(8, 32)))   # scale = extreme / -128: another grid
    assert np.abs(rtn - table).max() > 0
    assert quantize(table, WeightOnlyScheme(8, 32, q8_0=True)).scales.dtype == np.float32


def test_the_q8_0_rule_on_any_weight_is_within_half_a_step():
    w = np.random.default_rng(1).standard_normal((48, 64)).astype(np.float32)
    w[0, :32] = 0.0   # an all-zero block stays zero
    q = quantize_q8_0(w, 32)
    step = np.abs(w.reshape(48, 2, 32)).max(-1) / 127
    err = np.abs(dequantize(q) - w).reshape(48, 2, 32).max(-1)
    assert (err <= step * 0.5 * (1 + 1e-6)).all() and (dequantize(q)[0, :32] == 0).all()


@pytest.mark.parametrize("key, tied", [(TIED, True), (UNTIED, False)])
def test_one_int8_table_is_stored_on_the_q8_0_rule(tiny, key, tied):
    from safetensors.numpy import load_file
    engine = int8_head_engine(tiny, key, "int4_wo")
    inits = {t.name: t for t in onnx.load(str(engine / "rank0.onnx")).graph.initializer}
    counts = op_counts(engine / "rank0.onnx")
    stem = "vocab_embedding" if tied else "lm_head"
    ckpt = load_file(str(tiny.checkpoint(key) / "rank0.safetensors"))
    w = ckpt[f"{stem}.weight"].astype(np.float32)
    expected = quantize_q8_0(w, 32)
    values, scales = stored_projection(inits, stem, w.shape[0], 8, 32)
    np.testing.assert_array_equal(values, expected.packed.reshape(w.shape))
    np.testing.assert_array_equal(scales, expected.scales)
    assert projections(counts) == 2 * 4 + 1   # 4 int4 projections a layer + the int8 lm_head
    if tied:   # the embedding gathers from the same table; no float copy of it is left
        assert counts.get(GATHER_OP) == 1 and "lm_head.weight" not in inits
    else:
        assert inits["vocab_embedding.weight"].data_type == onnx.TensorProto.FLOAT and GATHER_OP not in counts
    config = load_engine_config(engine)
    assert config.quantization.lm_head_dtype == "int8" and "Q8_0" in config.precision["lm_head"]
    assert "lm_head int8 (Q8_0 blocks of 32)" in config.precision["weights"]
    data = (engine / "rank0.onnx.data").stat().st_size
    assert data <= config.memory.weight_bytes_per_rank[0] <= data * 1.05


@pytest.mark.parametrize("mode, key", [(m, k) for m in ("int8_wo", "int4_wo") for k in (TIED, UNTIED)]
                         + [("int4_wo", "Gemma2ForCausalLM"), ("int4_wo", "Qwen2ForCausalLM")])
def test_logits_are_the_float_head_engines_to_the_heads_rounding(tiny, key, mode):
    """Prefill and decode within the mode's tolerance of the float32 engine, and within the head's own rounding
    (int8 weights and activations per block: ~0.5% relative RMS on these tiny models; 2% on Gemma2, whose tied
    embedding, scaled by sqrt(hidden), carries the table's rounding into every layer) of the same mode's engine with
    a float32 lm_head; visibly not equal to it (the table really is int8). A wrong layout reads ~100%."""
    float_head = _logits(quant_engine(tiny, key, mode), BATCH)
    ref = _logits(tiny.engine(key), BATCH)
    prefill, tokens, decode = _logits(int8_head_engine(tiny, key, mode), BATCH)
    assert relative_rms(prefill, ref[0]) <= LOGITS_RELATIVE_RMS[mode]
    assert 1e-4 < relative_rms(prefill, float_head[0]) < 0.04
    assert 1e-4 < relative_rms(decode[:1], float_head[2][:1]) < 0.04


@pytest.mark.parametrize("key", [TIED, UNTIED])
def test_over_tp2_each_rank_holds_its_vocabulary_shard_and_matches_tp1(tiny, key):
    """tp=2: each rank quantizes its vocabulary shard of lm_head into the same Q8_0 blocks as tp=1 (the blocks run
    along the in features), and a tied embedding gathers from a whole int8 table of its own (tp=1 reads one table
    for both), so prefill and decode give tp=1's logits and tokens."""
    from engine.runtime.tp.session import TPSession
    from tests.tp.parity import check_same_as_tp1
    session = TPSession(int8_head_engine(tiny, key, "int4_wo", tp=2), num_blocks=64)
    try:
        check_same_as_tp1(EngineSession(int8_head_engine(tiny, key, "int4_wo"), num_blocks=64), session, BATCH,
                          steps=6, what=f"{key} int4_wo + int8 lm_head tp=2")
    finally:
        session.close()
    counts = op_counts(int8_head_engine(tiny, key, "int4_wo", tp=2) / "rank1.seg000.onnx")   # the embedding
    assert counts.get(GATHER_OP) == (1 if key == TIED else None)


def test_auto_is_int8_for_weight_only_modes_at_accuracy_level_4(tiny):
    from engine.core.artifacts import load_checkpoint_config
    model = load_checkpoint_config(tiny.checkpoint(UNTIED)).model
    bf16 = "bfloat16" if bf16_matmul.supported(model.hidden_size) else "float32"

    def resolved(mode="int4_wo", backend="onnxruntime", kernels=True, m=model, **q):
        quant = QuantConfig(mode=mode, lm_head_dtype="auto", **q)
        return modes.resolve_lm_head_dtype(quant, m, backend=backend, kernels=kernels).lm_head_dtype
    assert resolved() == resolved("int8_wo") == "int8"
    assert resolved(kernels=False) == "int8"          # MatMulNBits runs it too
    assert resolved("fp8") == bf16 and resolved(None) == "float32"   # calibrated modes: bfloat16
    assert resolved(accuracy_level=0) == bf16       # float32 activations: MLAS has no fast int8 kernel for them
    assert resolved(quantize_lm_head=True) == "float32"   # its own precision
    assert resolved(backend="tensorrt") == "float32"
    assert resolved(m=dataclasses.replace(model, hidden_size=48)) == "float32"


@pytest.mark.parametrize("quant, match", [
    (QuantConfig(lm_head_dtype="int8"), "needs a weight-only --dtype .* this build's is float32"),
    (QuantConfig(mode="int4_wo", quantize_lm_head=True, lm_head_dtype="int8"), "both set lm_head's precision"),
])
def test_bad_requests_fail_before_anything_is_written(tiny, tmp_path, quant, match):
    with pytest.raises(EngineError, match=match):
        build_engine(tiny.checkpoint(UNTIED), tmp_path / "e", TEST_BUILD, ALL_PLUGINS, quant=quant, accuracy=NO_REPORT)
    assert not (tmp_path / "e").exists()


def test_a_hidden_size_off_the_blocks_is_refused(tiny):
    from engine.core.artifacts import load_checkpoint_config
    model = dataclasses.replace(load_checkpoint_config(tiny.checkpoint(UNTIED)).model, hidden_size=48)
    with pytest.raises(EngineError, match="hidden_size 48.* multiple of 32"):
        modes.resolve_lm_head_dtype(QuantConfig(mode="int4_wo", lm_head_dtype="int8"), model,
                                    backend="onnxruntime", kernels=True)
    with pytest.raises(EngineError, match="built for onnxruntime; this build's backend is tensorrt"):
        modes.resolve_lm_head_dtype(QuantConfig(mode="int4_wo", lm_head_dtype="int8"),
                                    dataclasses.replace(model, hidden_size=64), backend="tensorrt", kernels=True)
