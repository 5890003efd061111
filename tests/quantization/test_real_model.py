"""SmolLM2-135M-Instruct quantized at build: int8_wo and int4_wo engines know the capital of France, carry an
accuracy report within target, hold their weights at their precision, and run MatMulNBits.

The float32 engine's greedy answer "The capital of France is Paris." starts on a near-tie: "The" 25.33 against
"L" 25.24 (0.08 logits). Any rounding of the weights or activations moves logits by more than that; measured,
int8_wo (group 16..64, accuracy level 0 or 4) and int4_wo (its kept Q4_1 blocks, int8 activations) start
"L'Étoile, ..." free-running. So the answer is checked teacher-forced (after "The capital of France is" the engine
says " Paris").

Perplexity targets: on text the model samples itself, int8_wo (groups of 32) measured +0.50%, int4_wo +0.41%;
int8_wo with groups of 64 read +0.7% on a Zen 1 runner and +0.99 to +1.11% on a Zen 4 one (quantization/modes.py).
This checkpoint's layers are already Q4_1 blocks (the offline GGUF): int4_wo keeps them exactly
(quantization/weight_only.block_grid; what is left is accuracy_level 4's int8 activations), where RTN onto a second,
symmetric 4-bit grid measured +58%. Size: the kept blocks carry a float32 offset per 32 weights beside their float16
scale (5.5 bits per weight; Q4_1 itself has 5), so the int4 engine with lm_head int4 is 0.179x the float32 one (the
issue asks 0.18x).
"""
from __future__ import annotations

import pytest

from engine.builder.build import build_engine
from engine.builder.onnxruntime_backend import op_counts
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.core.model_config import QuantConfig
from engine.quantization.accuracy import AccuracyOptions
from tests.real_model import next_token_after_france

from .engines import GATHER_OP, REPACKED, projections

pytestmark = pytest.mark.slow

BUILD = BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=1024, max_num_tokens=1024)
# perplexity increase on text the model samples itself (the build's default held-out text), percent
TARGET = {"int8_wo": 1.0, "int4_wo": 1.0}
# engine weights relative to the float32 engine's, with lm_head and its tied embedding quantized
SIZE = {"int8_wo": 0.30, "int4_wo": 0.18}


@pytest.fixture(scope="module")
def engines(smollm2_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2_quant")
    build_engine(smollm2_checkpoint, root / "float32", BUILD, PluginConfig())
    for mode in TARGET:
        build_engine(smollm2_checkpoint, root / mode, BUILD, PluginConfig(), quant=QuantConfig(mode=mode),
                     accuracy=AccuracyOptions(max_ppl_increase=TARGET[mode]))
        build_engine(smollm2_checkpoint, root / f"{mode}_lm_head", BUILD, PluginConfig(),
                     quant=QuantConfig(mode=mode, quantize_lm_head=True), accuracy=AccuracyOptions(eval_tokens=0))
    build_engine(smollm2_checkpoint, root / "int4_wo_lm_int8", BUILD, PluginConfig(),
                 quant=QuantConfig(mode="int4_wo", lm_head_dtype="int8"),
                 accuracy=AccuracyOptions(max_ppl_increase=TARGET["int4_wo"]))
    return root


@pytest.mark.parametrize("mode", sorted(TARGET))
def test_knows_the_capital_of_france(engines, mode):
    assert next_token_after_france(engines / mode) == " Paris"


@pytest.mark.parametrize("mode", sorted(TARGET))
def test_accuracy_report_within_target(engines, mode):
    from engine.runtime.engine_dir import load_engine_config
    report = load_engine_config(engines / mode).quantization.accuracy
    assert report["tokens"] >= 2000 and report["reference_ppl"] > 1
    assert report["ppl_increase_pct"] <= TARGET[mode]


@pytest.mark.parametrize("mode", sorted(TARGET))
def test_weights_at_their_precision_and_kernels_in_the_graph(engines, mode):
    fp32 = (engines / "float32" / "rank0.onnx.data").stat().st_size
    quant = (engines / f"{mode}_lm_head" / "rank0.onnx.data").stat().st_size
    assert quant <= SIZE[mode] * fp32
    counts = op_counts(engines / mode / "rank0.onnx")
    # the tied lm_head float32: QuantMatMul's float32 tiles where the CPU runs QuantMatMul, its embedding their gather
    assert projections(counts) == 30 * 4 + REPACKED and counts.get("engine.QuantGather", 0) == REPACKED
    counts = op_counts(engines / f"{mode}_lm_head" / "rank0.onnx")
    assert projections(counts) == 30 * 4 + 1 and counts[GATHER_OP] == 1


def test_int8_lm_head_is_the_ggufs_q8_0_table_exactly(engines, smollm2_gguf):
    """The GGUF ships token_embd (the tied lm_head) as Q8_0 blocks; `--lm-head-dtype int8` (int4_wo's default in the
    CLI) stores exactly those integers and scales, where RTN's rule moves them (quantization/weight_only.py), and the
    engine still answers and scores within int4_wo's target."""
    import gguf
    import numpy as np
    import onnx
    from engine.runtime.engine_dir import load_engine_config
    from .engines import stored_projection
    engine = engines / "int4_wo_lm_int8"
    tensor = next(t for t in gguf.GGUFReader(str(smollm2_gguf)).tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
    blocks = np.asarray(tensor.data).reshape(-1, 34)   # Q8_0: a float16 d, then 32 int8 q
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
    q = blocks[:, 2:].copy().view(np.int8)
    m = load_engine_config(engine).model
    inits = {t.name: t for t in onnx.load(str(engine / "rank0.onnx")).graph.initializer}
    values, scales = stored_projection(inits, "vocab_embedding", m.vocab_size, 8, 32)
    np.testing.assert_array_equal(values.astype(np.int16) - 128, q.reshape(m.vocab_size, m.hidden_size))
    np.testing.assert_array_equal(scales, d.reshape(m.vocab_size, m.hidden_size // 32))
    assert next_token_after_france(engine) == " Paris"
    assert load_engine_config(engine).quantization.accuracy["ppl_increase_pct"] <= TARGET["int4_wo"]
