"""Calibrated modes (int8_sq, fp8, int4_awq) on tiny models: the canonical torch model against transformers, logits
within the mode's tolerance of the float32 engine and against ModelOpt's own fake-quant model, the kernels and the
stored dtypes in the graph, the calibration data, and the errors of bad input."""
from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import pytest
import torch

from engine.builder.build import build_engine
from engine.builder.rank_tensors import rank_tensors
from engine.builder.onnxruntime_backend import op_counts
from engine.builder.reference import ReferenceEngine
from engine.core.artifacts import load_checkpoint_config
from engine.core.model_config import QuantConfig
from engine.core.errors import EngineError
from engine.quantization import modes
from engine.quantization.modelopt_calibration import CalibrationOptions, calibrated_model, read_calibration_tokens
from engine.quantization.calibrated_weights import pack_int4, quantize_weight
from engine.quantization.torch_model import CanonicalLM, KVCache
from engine.quantization.weight_only import QuantizedWeight, signed_values
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD, prompts, stored_float
from tests.builder.test_engine_dir import cli
from tests.tiny_models import TINY_CONFIGS, _CORPUS

from .calibrated_engines import CALIBRATED_TOLERANCE, TINY_CALIBRATION, calibrated_engine
from .engines import PROJECTION_OP, REPACKED, projections, relative_rms

MODES = list(CALIBRATED_TOLERANCE)
LLAMA, TIED, QWEN2 = "LlamaForCausalLM", "LlamaForCausalLM:llama3-rope-tied", "Qwen2ForCausalLM"


def _tensors(tiny, key):
    ckpt = tiny.checkpoint(key)
    config = load_checkpoint_config(ckpt)
    return ckpt, config, dict(rank_tensors(ckpt, config, 1, 0))


def _prefill(engine, batch):
    session = EngineSession(engine, num_blocks=64)
    return session.run([SeqChunk(ids, 0, list(range(8 * i, 8 * i + 8)), True) for i, ids in enumerate(batch)])


@pytest.mark.parametrize("key", sorted(TINY_CONFIGS))
def test_torch_model_matches_transformers(tiny, key):
    """The calibration model is the builder's model: logits equal transformers', also through its KV cache."""
    _, config, tensors = _tensors(tiny, key)
    lm = CanonicalLM(config.model, tensors, 128).eval()
    ids = prompts(1, (30,), seed=1)[0]
    with torch.no_grad():
        ours = lm(torch.tensor([ids]))[0]
        ref = tiny.hf_model(key)(torch.tensor([ids])).logits[0]
        cache = KVCache(config.model, 1, len(ids))
        stepped = torch.cat([lm(torch.tensor([ids[:20]]), 0, cache), lm(torch.tensor([ids[20:]]), 20, cache)], 1)[0]
    scale = float(ref.abs().max())
    assert float((ours - ref).abs().max()) <= 1e-5 * scale
    assert float((stepped - ours).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("key", [LLAMA, QWEN2])
def test_logits_within_mode_tolerance_of_float32_engine(tiny, key, mode):
    batch = prompts(2, (7, 19), seed=2)
    ref = _prefill(tiny.engine(key), batch)
    quant = _prefill(calibrated_engine(tiny, key, mode), batch)
    assert relative_rms(quant, ref) <= CALIBRATED_TOLERANCE[mode]


@pytest.mark.parametrize("mode", ["fp8", "int4_awq"])
def test_engine_matches_modelopt_fake_quant_model(tiny, mode, tmp_path):
    """The engine computes what ModelOpt's calibrated fake-quant torch model computes (same calibration text, drawn
    by the same float reference engine as in the build; same scales): fp8 Q/DQ rounding and AWQ's int4 weights
    (MatMulNBits at accuracy level 0: float32 compute)."""
    ckpt, config, tensors = _tensors(tiny, QWEN2)
    quant = modes.resolve(QuantConfig(mode=mode, accuracy_level=0 if mode == "int4_awq" else None), config.model, 1)
    engine = calibrated_engine(tiny, QWEN2, mode, accuracy_level=quant.accuracy_level)
    with ReferenceEngine(ckpt, load_engine_config(engine), tmp_path) as reference:
        lm, _ = calibrated_model(config.model, tensors, quant, TINY_CALIBRATION, ckpt,
                                 config.generation.bos_token_id, TEST_BUILD.max_seq_len, reference.sample)
    batch = prompts(2, (7, 19), seed=3)
    with torch.no_grad():
        expected = np.stack([lm(torch.tensor([ids]))[0, -1].numpy() for ids in batch])
    float_error = relative_rms(_prefill(tiny.engine(QWEN2), batch), expected)
    error = relative_rms(_prefill(engine, batch), expected)
    assert error <= 2e-3 and error < float_error / 10, (error, float_error)


def test_int8_sq_kernel_matches_dequantize_reference(tiny):
    """MatMulInteger with per-token scales against QuantizeLinear + DequantizeLinear + float MatMul, unoptimized."""
    batch = prompts(2, (7, 19), seed=4)
    fused = _prefill(calibrated_engine(tiny, QWEN2, "int8_sq"), batch)
    reference = calibrated_engine(tiny, QWEN2, "int8_sq", plugins=False, opt_level="disable")
    counts = op_counts(reference / "rank0.onnx")
    assert counts["QuantizeLinear"] == 2 * 5 and "MatMulInteger" not in counts
    ref = _prefill(reference, batch)
    np.testing.assert_allclose(fused, ref, atol=1e-4 * np.abs(ref).max())


def test_int8_sq_activation_scales_are_per_token(tiny):
    """A sequence's logits do not depend on the other sequences of its step (a per-tensor activation scale would
    let a batch neighbour with large activations coarsen its quantization)."""
    engine = calibrated_engine(tiny, QWEN2, "int8_sq")
    ids = prompts(1, (11,), seed=6)[0]
    alone = _prefill(engine, [ids])[0]
    neighbours = _prefill(engine, [ids] + prompts(3, (5, 23, 9), seed=7))[0]
    np.testing.assert_allclose(neighbours, alone, atol=1e-5 * np.abs(alone).max())


# mode -> (stored dtype of a projection's weight, kernel op and its count per layer, bytes per weight element)
KERNELS = {"int8_sq": (onnx.TensorProto.UINT8, {"MatMulInteger": 4, "QuantizeLinear": 4}, 1.0),
           "fp8": (onnx.TensorProto.FLOAT8E4M3FN, {"QuantizeLinear": 4, "DequantizeLinear": 8}, 1.0),
           "int4_awq": (onnx.TensorProto.UINT8, {PROJECTION_OP: 4}, 0.5)}


@pytest.mark.parametrize("mode", MODES)
def test_stored_tensors_have_the_quantized_dtype_and_size(tiny, mode):
    engine = calibrated_engine(tiny, LLAMA, mode)
    config = load_engine_config(engine)
    assert config.quantization.mode == mode and config.quantization.calibration["sequences"] == 8
    assert config.quantization.calibration["data"].startswith("sampled from the float reference engine")
    model = onnx.load(str(engine / "rank0.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    dtype, kernels, per_element = KERNELS[mode]
    for i in range(2):
        for proj in ("attention.qkv", "attention.dense", "mlp.gate_up", "mlp.down"):
            w = inits[f"layers.{i}.{proj}.weight"]
            assert w.data_type == dtype
            assert (f"layers.{i}.{proj}.prequant_scaling_factor" in inits) == (mode != "fp8")
            if mode == "int4_awq" and REPACKED:   # QuantMatMul's blocks: 64 bytes of scales, then 16 x group x 4 bits
                assert w.dims[2] == 64 + 8 * config.quantization.group_size
                continue
            raw = len(onnx.numpy_helper.to_array(w).tobytes())
            elements = int(np.prod(w.dims)) * (2 if mode == "int4_awq" else 1)
            assert raw == elements * per_element
            assert f"layers.{i}.{proj}.weights_scaling_factor" in inits
    assert inits["vocab_embedding.weight"].data_type == onnx.TensorProto.FLOAT
    vocab = config.model.vocab_size   # lm_head float32: the tensor, or QuantMatMul's float32 tiles where it runs them
    assert stored_float(inits["lm_head.weight"], vocab).shape == (vocab, config.model.hidden_size)
    float_head = inits["lm_head.weight"].data_type == onnx.TensorProto.UINT8
    counts = op_counts(engine / "rank0.onnx")
    for op, per_layer in kernels.items():
        assert projections(counts, op) == 2 * per_layer + (float_head and op == "engine.QuantMatMul"), counts
    _plan_matches_stored_bytes(engine)


def _plan_matches_stored_bytes(engine):
    """The memory plan counts the weights at their stored precision: between the external weights file and that
    plus the .onnx file (which holds the graph and the initializers under 1 KiB: scales of the tiny models)."""
    data = (engine / "rank0.onnx.data").stat().st_size
    plan = load_engine_config(engine).memory.weight_bytes_per_rank[0]
    assert data <= plan <= data + (engine / "rank0.onnx").stat().st_size


@pytest.mark.parametrize("mode", MODES)
def test_quantized_lm_head_shares_its_table_with_a_tied_embedding(tiny, mode):
    engine = calibrated_engine(tiny, TIED, mode, lm_head=True)
    dtype, kernels, _ = KERNELS[mode]
    counts = op_counts(engine / "rank0.onnx")
    for op, per_layer in kernels.items():   # + the lm_head
        assert projections(counts, op) == 2 * per_layer + per_layer // 4, counts
    inits = {t.name: t for t in onnx.load(str(engine / "rank0.onnx"), load_external_data=False).graph.initializer}
    assert inits["lm_head.weight"].data_type == dtype
    # int8_sq / int4_awq: the embedding reads the lm_head's table; fp8: ONNX Gather takes no float8, it stays float32
    assert ("vocab_embedding.weight" in inits) == (mode == "fp8")
    batch = prompts(2, (7, 19), seed=5)
    tolerance = CALIBRATED_TOLERANCE[mode] * 1.5    # the embedding is rounded too
    assert relative_rms(_prefill(engine, batch), _prefill(tiny.engine(TIED), batch)) <= tolerance
    _plan_matches_stored_bytes(engine)


def test_quantize_weight_and_packing():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((6, 64)) * rng.uniform(0.1, 2, (6, 1))).astype(np.float32)
    amax = np.abs(w).max(axis=1)
    q = quantize_weight("int8_sq", w, amax)
    assert q.values.dtype == np.int8 and np.abs(q.dequantize() - w).max() <= amax.max() / 127 / 2 * 1.0001
    q4 = quantize_weight("int4_awq", w, np.abs(w.reshape(6, 4, 16)).max(-1), group_size=16)
    assert q4.values.min() >= -8 and q4.values.max() <= 7
    packed = QuantizedWeight(pack_int4(q4.values, 16), q4.weight_scale, 4, 16)
    np.testing.assert_array_equal(signed_values(packed), q4.values)   # weight_only's reader of MatMulNBits bytes
    f8 = quantize_weight("fp8", w, np.abs(w).max(), input_amax=3.0)
    assert f8.values.dtype.name == "float8_e4m3fn" and float(f8.input_scale) == pytest.approx(3.0 / 448)
    assert np.abs(f8.dequantize() - w).max() <= np.abs(w).max() * 2 ** -4


def test_calibration_files(tiny, tmp_path):
    ckpt = tiny.checkpoint(LLAMA)
    txt = tmp_path / "calib.txt"
    txt.write_text(_CORPUS, encoding="utf-8")
    seqs = read_calibration_tokens(txt, ckpt, CalibrationOptions(size=3, max_seq_len=10))
    assert len(seqs) == 3 and all(len(s) == 10 for s in seqs)
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text("\n".join([json.dumps({"text": "The capital of France is Paris."}), "",
                                json.dumps("The quick brown fox jumps over the lazy dog.")]), encoding="utf-8")
    seqs = read_calibration_tokens(jsonl, ckpt, CalibrationOptions(size=5, max_seq_len=6))
    assert len(seqs) == 2 and all(2 <= len(s) <= 6 for s in seqs)
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(EngineError, match="holds no text"):
        read_calibration_tokens(empty, ckpt, CalibrationOptions())
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x80" * 10)
    with pytest.raises(EngineError, match="cannot read calibration data"):
        read_calibration_tokens(binary, ckpt, CalibrationOptions())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"prompt": 3}\n', encoding="utf-8")
    with pytest.raises(EngineError, match="line 2 has no \"text\" string"):
        read_calibration_tokens(bad, ckpt, CalibrationOptions())


def test_bad_input(tiny, tmp_path, monkeypatch, capsys):
    ckpt = tiny.checkpoint(LLAMA)
    with pytest.raises(EngineError, match="'int3_sq' is unknown"):
        modes.split_dtype("int3_sq")
    with pytest.raises(EngineError, match="w4a8_awq is not implemented yet"):
        modes.split_dtype("w4a8_awq")
    model = load_checkpoint_config(ckpt).model
    with pytest.raises(EngineError, match="--group-size applies to weight-only and int4_awq"):
        modes.resolve(QuantConfig(mode="int8_sq", group_size=32), model, 1)
    for mode in ("int8_sq", "fp8"):   # sharded (tests/tp/test_calibrated_tp.py)
        assert modes.resolve(QuantConfig(mode=mode), model, 2).mode == mode
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(EngineError, match="holds no text"):
        build_engine(ckpt, tmp_path / "e", TEST_BUILD, ALL_PLUGINS, quant=QuantConfig(mode="fp8"),
                     calibration=CalibrationOptions(data=empty))
    assert not (tmp_path / "e").exists() and not list(tmp_path.glob(".e*"))
    # without ModelOpt the message names the extra to install
    monkeypatch.setitem(sys.modules, "modelopt.torch.quantization", None)
    with pytest.raises(EngineError, match=r"pip install 'engine\[quantization\]'"):
        build_engine(ckpt, tmp_path / "e", TEST_BUILD, ALL_PLUGINS, quant=QuantConfig(mode="int8_sq"))
    monkeypatch.undo()
    base = ["build", "--checkpoint-dir", str(ckpt), "--output-dir", str(tmp_path / "c")]
    code, _, err = cli(monkeypatch, capsys, *base, "--dtype", "int8_sq", "--calib-data", str(tmp_path / "missing"))
    assert code == 2 and "--calib-data" in err and "is not a file" in err
    code, _, err = cli(monkeypatch, capsys, *base, "--dtype", "int8_wo", "--calib-size", "4")
    assert code == 2 and "apply to calibrated builds" in err
    code, _, err = cli(monkeypatch, capsys, *base, "--kv-cache-dtype", "int4")
    assert code == 2 and "--kv-cache-dtype 'int4' is unknown" in " ".join(err.split())


def test_build_and_inspect_commands(tiny, tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "engine"
    calib = tmp_path / "calib.txt"
    calib.write_text(_CORPUS, encoding="utf-8")
    code, out, err = cli(monkeypatch, capsys, "build", "--checkpoint-dir", str(tiny.checkpoint(TIED)),
                         "--output-dir", str(out_dir), "--dtype", "fp8", "--calib-data", str(calib),
                         "--calib-size", "4", "--calib-max-seq-len", "16", "--eval-tokens", "64",
                         "--max-seq-len", "64")
    assert code == 0, err
    from engine.plugins import bf16_matmul   # a quantized build's defaults: float16 KV, a bfloat16 lm_head
    head = " + bfloat16 lm_head" if bf16_matmul.supported(64) else ""
    assert f"accuracy (fp8{head} + float16 KV cache): perplexity" in out
    config = load_engine_config(out_dir)
    assert config.quantization.calibration["data"] == f"file {calib}"
    assert config.quantization.calibration["sequences"] == 4 and config.quantization.calibration["max_seq_len"] == 16
    code, out, err = cli(monkeypatch, capsys, "inspect", "--engine-dir", str(out_dir))
    assert code == 0, err
    flat = " ".join(out.split())
    assert "QuantizeLinear" in flat and "DequantizeLinear" in flat and "float8 e4m3" in flat
    assert "emulated" in flat and "accuracy: quantized_ppl" in flat
