"""Quantized engines of tiny models: logits within the mode's tolerance of the float32 engine, MatMulNBits
against the DequantizeLinear reference, stored tensors at their precision and reproducible from the checkpoint,
the same logits on the kernels' own thread pool as on ONNX Runtime's."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors.numpy import load_file

from engine.builder.onnxruntime_backend import op_counts
from engine.core.errors import EngineError
from engine.runtime.engine_dir import load_engine_config
from engine.plugins import native, quant_matmul
from engine.runtime import session as session_module
from engine.runtime.perplexity import ScoringSession
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk
from engine.quantization.weight_only import rtn_scales
from tests.builder.engines import engine_greedy, prompts, stored_float

from .engines import GATHER_OP, LOGITS_RELATIVE_RMS, PROJECTION_OP, projections, quant_engine, relative_rms, stored_projection

KEYS = ["LlamaForCausalLM", "LlamaForCausalLM:llama3-rope-tied", "Qwen2ForCausalLM", "Gemma2ForCausalLM"]
MODES = ["int8_wo", "int4_wo"]


def _logits(engine, batch):
    """Prefill logits of each prompt's last token (one step), then 6 greedy decode steps of the first prompt
    through the paged cache: (prefill logits, decode tokens, decode logits)."""
    session = EngineSession(engine, num_blocks=64)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(batch))]
    prefill = session.run([SeqChunk(ids, 0, t, True) for ids, t in zip(batch, tables)])
    tokens, decode = engine_greedy(session, batch[0], 6, list(range(40, 48)))
    return prefill, tokens, decode


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key", KEYS)
def test_logits_within_mode_tolerance_of_float32_engine(tiny, key, mode):
    batch = prompts(2, (7, 19), seed=2)
    ref_prefill, _, _ = _logits(tiny.engine(key), batch)
    prefill, tokens, decode = _logits(quant_engine(tiny, key, mode), batch)
    assert relative_rms(prefill, ref_prefill) <= LOGITS_RELATIVE_RMS[mode]
    # the decode steps (one-token MatMulNBits) against the float engine's logits along the same tokens
    path = batch[0] + tokens[:-1]
    ref_decode = ScoringSession(tiny.engine(key), len(path)).logits(path)[len(batch[0]) - 1:]
    assert relative_rms(decode, ref_decode) <= LOGITS_RELATIVE_RMS[mode]


@pytest.mark.parametrize("mode", MODES)
def test_lm_head_quantized_tied_embedding_within_tolerance(tiny, mode):
    key = "LlamaForCausalLM:llama3-rope-tied"
    batch = prompts(2, (7, 19), seed=3)
    ref, _, _ = _logits(tiny.engine(key), batch)
    quant, _, _ = _logits(quant_engine(tiny, key, mode, lm_head=True), batch)
    assert relative_rms(quant, ref) <= LOGITS_RELATIVE_RMS[mode]
    counts = op_counts(quant_engine(tiny, key, mode, lm_head=True) / "rank0.onnx")
    assert counts.get(GATHER_OP) == 1
    assert projections(counts) == 2 * 4 + 1     # 4 projections a layer + lm_head


@pytest.mark.parametrize("mode", MODES)
def test_matmulnbits_engine_matches_dequantize_reference_engine(tiny, mode):
    """accuracy_level 0 (fp32 compute) MatMulNBits vs unoptimized DequantizeLinear + MatMul, all plugins off."""
    key = "Qwen2ForCausalLM"
    batch = prompts(2, (7, 19), seed=4)
    fused, _, fused_decode = _logits(quant_engine(tiny, key, mode, accuracy_level=0), batch)
    ref, _, ref_decode = _logits(quant_engine(tiny, key, mode, plugins=False, accuracy_level=0, opt_level="disable"),
                              batch)
    counts = op_counts(quant_engine(tiny, key, mode, plugins=False, accuracy_level=0, opt_level="disable")
                       / "rank0.onnx")
    assert counts["DequantizeLinear"] == 2 * 5 and "com.microsoft.MatMulNBits" not in counts  # gate, up separate
    np.testing.assert_allclose(fused, ref, atol=1e-4 * np.abs(ref).max())
    np.testing.assert_allclose(fused_decode, ref_decode, atol=1e-4 * np.abs(ref_decode).max())


@pytest.mark.parametrize("mode,bits,group", [("int8_wo", 8, 32), ("int4_wo", 4, 32)])
def test_stored_tensors_are_quantized_and_reproducible(tiny, mode, bits, group):
    key = "LlamaForCausalLM"
    engine = quant_engine(tiny, key, mode)
    config = load_engine_config(engine)
    assert (config.quantization.mode, config.quantization.group_size) == (mode, group)
    assert config.quantization.quantize_lm_head is False
    model = onnx.load(str(engine / "rank0.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    ckpt = load_file(str(tiny.checkpoint(key) / "rank0.safetensors"))
    for i in range(2):
        for proj in ("attention.qkv", "attention.dense", "mlp.gate_up", "mlp.down"):
            w = ckpt[f"layers.{i}.{proj}.weight"].astype(np.float32)
            n, k = w.shape
            assert inits[f"layers.{i}.{proj}.weight"].data_type == onnx.TensorProto.UINT8
            values, scales = stored_projection(inits, f"layers.{i}.{proj}", n, bits, group)
            assert values.shape == (n, k) and values.max() < 2**bits
            np.testing.assert_array_equal(scales, rtn_scales(w, bits, group))
            dequantized = (values.astype(np.float32) - 2 ** (bits - 1)).reshape(n, k // group, group)
            np.testing.assert_allclose((dequantized * scales[..., None]).reshape(n, k), w,   # one step: +zp clips
                                       atol=float(np.abs(scales).max()) * 1.0001)
    # embeddings and lm_head stay float32 by default: lm_head as QuantMatMul's float32 tiles where it runs them
    assert inits["vocab_embedding.weight"].data_type == onnx.TensorProto.FLOAT
    vocab = ckpt["lm_head.weight"].shape[0]
    np.testing.assert_array_equal(stored_float(inits["lm_head.weight"], vocab), ckpt["lm_head.weight"])
    float_head = inits["lm_head.weight"].data_type == onnx.TensorProto.UINT8
    assert float_head == quant_matmul.float_runs(vocab, kernel=True)
    counts = op_counts(engine / "rank0.onnx")
    assert projections(counts) == 2 * 4 + float_head
    # the memory plan counts weights at their stored precision
    data = (engine / "rank0.onnx.data").stat().st_size
    assert data <= config.memory.weight_bytes_per_rank[0] <= data * 1.05


def test_group_size_must_divide_in_features(tiny, tmp_path):
    from engine.builder.build import build_engine
    from engine.core.model_config import QuantConfig
    from tests.builder.engines import ALL_PLUGINS, TEST_BUILD
    with pytest.raises(EngineError, match="group size 128 does not divide the 64 input features of attention.qkv"):
        build_engine(tiny.checkpoint("LlamaForCausalLM"), tmp_path / "e", TEST_BUILD, ALL_PLUGINS,
                     quant=QuantConfig(mode="int4_wo", group_size=128))
    with pytest.raises(EngineError, match="w4a8_awq is not implemented yet"):
        build_engine(tiny.checkpoint("LlamaForCausalLM"), tmp_path / "e", TEST_BUILD, ALL_PLUGINS,
                     quant=QuantConfig(mode="w4a8_awq"))
    assert not (tmp_path / "e").exists()


# Gemma2's GeGLU (Split, Gelu, Mul) and logit soft-cap (Div, Tanh, Mul) are ORT nodes: it keeps ORT's pool
@pytest.mark.parametrize("key,kernels_only", [(k, not k.startswith("Gemma2")) for k in KEYS])
def test_engines_of_kernels_give_them_the_threads(tiny, key, kernels_only, monkeypatch):
    """A quantized engine whose parallel nodes are all the engine's kernels records thread_pool "engine": its
    session runs them on their own pool (plugins/kernels/spin_pool.h) and computes exactly what ORT's intra-op
    pool computes. A float32 lm_head is the engine's kernel too where it runs as QuantMatMul's float32 tiles (its
    columns whole tiles), else an ORT MatMul, which keeps ORT's pool."""
    engine = quant_engine(tiny, key, "int8_wo", lm_head=True)
    config = load_engine_config(engine)
    own_pool = kernels_only and PROJECTION_OP.startswith("engine.")
    assert config.thread_pool == ("engine" if own_pool else "onnxruntime"), op_counts(engine / "rank0.onnx")
    float_head = quant_matmul.float_runs(config.model.vocab_size, kernel=True)
    float_config = load_engine_config(quant_engine(tiny, key, "int8_wo"))
    assert float_config.thread_pool == ("engine" if own_pool and float_head else "onnxruntime")
    runs_own = own_pool and native.own_pool_supported(ort.__version__)
    assert session_module.kernel_pool_threads(config, 2) == (2 if runs_own else None)
    batch = prompts(3, (5, 9, 2))
    own = _logits(engine, batch)
    monkeypatch.setattr(session_module, "kernel_pool_threads", lambda config, threads: None)
    shared = _logits(engine, batch)
    assert own[1] == shared[1]
    np.testing.assert_array_equal(own[0], shared[0])
    np.testing.assert_array_equal(own[2], shared[2])
