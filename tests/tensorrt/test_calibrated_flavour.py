"""Calibrated modes on the TensorRT flavour of the graph (conftest.py): fp8 and int4_awq reach TensorRT as standard
ops with explicit Q/DQ whose scales are initializers, and, run by onnxruntime, compute what the onnxruntime engine of
the same mode and calibration computes; int8_sq, whose activation scales are computed in the graph, is refused
(builder/tensorrt_quant.check_tensorrt_quant). This checks the graph, not TensorRT."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from engine.builder.build import build_engine, resolve_quant
from engine.builder.tensorrt_backend import tensorrt_plugins
from engine.builder.tensorrt_quant import INT4_BLOCKS, TENSORRT_QUANT_MODES, check_tensorrt_quant, tensorrt_quant
from engine.core.artifacts import load_checkpoint_config
from engine.core.engine_format import engine_file
from engine.core.errors import EngineError
from engine.core.model_config import QuantConfig
from engine.quantization import modes
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD, prompts
from tests.quantization.calibrated_engines import TINY_CALIBRATION
from tests.quantization.engines import NO_REPORT
from tests.quantization.test_engines import _logits
from tests.quantization.test_source_grid import q4_1_checkpoint
from tests.tolerances import assert_logits_close

from .conftest import TRT_FLAVOUR_BUILD
from .test_graph import TRT10_PARSER_OPS

# Tied embeddings with a quantized lm_head: int4_awq's embedding then reads the lm_head's table (calibrated_gather).
KEY = "LlamaForCausalLM:llama3-rope-tied"
MODES = ("fp8", "int4_awq")


def _build(ckpt, out, mode: str, *, trt: bool):
    """The TensorRT flavour (trt) or the onnxruntime engine of `mode`, from the same calibration and with the
    quantization a TensorRT build resolves to (tensorrt_quant: int4 blocks of 64 or 128). int4_awq at accuracy
    level 0: MatMulNBits then computes in float32, as the TensorRT flavour's DequantizeLinear + MatMul."""
    if not out.exists():
        requested = QuantConfig(mode=mode, quantize_lm_head=True, accuracy_level=0 if mode == "int4_awq" else None)
        quant = (tensorrt_quant(requested, load_checkpoint_config(ckpt).model, 1) if mode in TENSORRT_QUANT_MODES
                 else requested)  # int8_sq: the graph TensorRT is refused, to show why
        build_engine(ckpt, out, TRT_FLAVOUR_BUILD if trt else TEST_BUILD,
                     tensorrt_plugins(ALL_PLUGINS) if trt else ALL_PLUGINS, accuracy=NO_REPORT,
                     calibration=TINY_CALIBRATION, quant=quant)
    return out


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrated_trt_flavour")
    return lambda mode, trt: _build(tiny.checkpoint(KEY), root / f"{mode}_{'trt' if trt else 'ort'}", mode, trt=trt)


def _model(engine) -> onnx.ModelProto:
    return onnx.load(str(engine / engine_file(0)))


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def check_tensorrt_qdq(model: onnx.ModelProto) -> None:
    """Only ops TensorRT 10.0's parser lists, in the standard domain; every Q/DQ scale and weight an initializer;
    no DequantizeLinear zero point; QuantizeLinear (fp8) with a zero e4m3 zero point, whose type makes the parser
    quantize to FP8 (onnx-tensorrt QuantDequantLinearHelper: no zero point and no output_dtype means INT8)."""
    inits = _initializers(model)
    for node in model.graph.node:
        assert node.domain in ("", "ai.onnx"), f"{node.name}: {node.domain}.{node.op_type} is not a standard op"
        assert node.op_type in TRT10_PARSER_OPS, f"{node.name}: {node.op_type} is not in TensorRT 10.0's parser"
        if node.op_type == "DequantizeLinear":
            assert len(node.input) == 2, f"{node.name}: DequantizeLinear with a zero point"
            assert node.input[1] in inits, f"{node.name}: scale {node.input[1]} is computed, not an initializer"
            assert (inits[node.input[1]] > 0).all(), f"{node.name}: TensorRT requires positive scales"
        if node.op_type == "QuantizeLinear":
            scale, zero = node.input[1], node.input[2]
            assert scale in inits and inits[scale].size == 1, f"{node.name}: not a static per-tensor scale"
            assert zero in inits and inits[zero].dtype == np.dtype("float8_e4m3fn") and float(inits[zero]) == 0, \
                f"{node.name}: zero point {zero} is not an e4m3 zero"


@pytest.mark.parametrize("mode", MODES)
def test_flavour_is_standard_qdq(built, mode):
    model = _model(built(mode, trt=True))
    check_tensorrt_qdq(model)
    ops = [n.op_type for n in model.graph.node]
    names = set(_initializers(model))
    # 2 layers x 4 projections + lm_head; int4_awq's tied embedding dequantizes the lm_head table once more
    assert ops.count("DequantizeLinear") == {"fp8": 2 * 9, "int4_awq": 10}[mode], ops.count("DequantizeLinear")
    assert ops.count("QuantizeLinear") == {"fp8": 9, "int4_awq": 0}[mode]
    if mode == "int4_awq":
        assert "lm_head.prequant_scaling_factor" in names and "layers.0.mlp.down.prequant_scaling_factor" in names


@pytest.mark.parametrize("mode", MODES)
def test_same_scales_as_the_onnxruntime_engine(built, mode):
    """Both engines come from one calibration: every scale the TensorRT flavour holds, the onnxruntime engine holds
    too, equal (int4 weight scales transposed: [K/g, N] for DequantizeLinear, [N, K/g] for MatMulNBits)."""
    trt = _initializers(_model(built(mode, trt=True)))
    ort = _initializers(_model(built(mode, trt=False)))
    scales = sorted(n for n in trt if n.endswith("_scaling_factor"))
    # per projection: weight + activation scales (fp8) or weight + AWQ input scales (int4_awq)
    assert len(scales) == 2 * 9, scales
    for name in scales:
        expected = ort[name].T if mode == "int4_awq" and name.endswith("weights_scaling_factor") else ort[name]
        np.testing.assert_array_equal(trt[name], expected, err_msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_logits_match_the_onnxruntime_engine(built, mode):
    batch = prompts(2, (7, 19), seed=4)
    prefill, tokens, decode = _logits(built(mode, trt=True), batch)
    ref_prefill, ref_tokens, ref_decode = _logits(built(mode, trt=False), batch)
    assert_logits_close(prefill, ref_prefill, what=f"{mode} TensorRT flavour prefill")
    assert_logits_close(decode, ref_decode, what=f"{mode} TensorRT flavour greedy decode")
    assert tokens == ref_tokens


def test_int8_sq_flavour_has_what_tensorrt_refuses(built):
    """Why int8_sq is refused: its activation scales are tensors computed per token in the graph, and it quantizes
    to uint8 with zero point 128 (TensorRT: build-time constant scales, zero point 0, UINT8 unsupported)."""
    model = _model(built("int8_sq", trt=True))
    inits = _initializers(model)
    quantize = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    assert quantize and all(n.input[1] not in inits for n in quantize)
    assert {a.name: a.i for a in quantize[0].attribute}.get("axis") == 0  # one scale per token
    produced = {o: n for n in model.graph.node for o in n.output}
    assert all(produced[n.input[2]].op_type == "Expand" and inits[produced[n.input[2]].input[0]] == 128
               and inits[produced[n.input[2]].input[0]].dtype == np.uint8 for n in quantize)


# What TensorRT takes, written out here rather than read from TENSORRT_QUANT_MODES: the modes whose graph is explicit
# Q/DQ with constant scales (the plain float build: None).
TAKEN = (None, "int8_wo", "int4_wo", "fp8", "int4_awq")


@pytest.mark.parametrize("mode", (None, *modes.IMPLEMENTED, *modes.PLANNED))
def test_every_mode_is_taken_or_refused_by_name(mode):
    """Every --dtype mode either passes or is refused up front with a usage error that names it (gguf's tiles and the
    planned modes included), never handed to a TensorRT build that would fail later."""
    if mode in TAKEN:
        check_tensorrt_quant(mode)
        return
    with pytest.raises(EngineError) as e:
        check_tensorrt_quant(mode)
    assert e.value.usage and f"--dtype {mode} " in str(e.value)
    assert "--backend onnxruntime" in str(e.value)


def test_int8_sq_is_refused_on_tensorrt():
    with pytest.raises(EngineError) as e:
        check_tensorrt_quant("int8_sq")
    message = str(e.value)
    assert e.value.usage and "int8_sq" in message and "per token" in message and "+24%" in message
    assert all(alt in message for alt in ("fp8", "int8_wo", "int4_awq", "--backend onnxruntime"))


def test_unknown_mode_is_refused_on_tensorrt():
    with pytest.raises(EngineError, match="nvfp4 has no TensorRT flavour") as e:
        check_tensorrt_quant("nvfp4")
    assert e.value.usage


# ---- int4_awq on a checkpoint already in 4-bit blocks (tests/quantization/test_source_grid.py) -----------------

@pytest.fixture(scope="module")
def grid_checkpoint(tmp_path_factory):
    return q4_1_checkpoint(tmp_path_factory.mktemp("q4_1_trt"))


@pytest.mark.parametrize("mode", ["int4_wo", "int4_awq"])
def test_tensorrt_requantizes_4_bit_blocks_of_32(grid_checkpoint, mode):
    """TensorRT's INT4 blocks are 64 or 128 ("Quantization Schemes"), so the Q4_1 blocks of 32 that onnxruntime
    keeps exactly are quantized again on TensorRT; a group TensorRT cannot take is refused."""
    ckpt = load_checkpoint_config(grid_checkpoint)
    on_ort = resolve_quant(QuantConfig(mode=mode), grid_checkpoint, ckpt, 1)
    assert (on_ort.group_size, on_ort.source_grid) == (32, True)
    on_trt = resolve_quant(QuantConfig(mode=mode), grid_checkpoint, ckpt, 1, "tensorrt")
    assert on_trt.group_size in INT4_BLOCKS and not on_trt.source_grid
    with pytest.raises(EngineError, match="--group-size 32 with --backend tensorrt: TensorRT's INT4 blocks are"):
        resolve_quant(QuantConfig(mode=mode, group_size=32), grid_checkpoint, ckpt, 1, "tensorrt")


def test_no_tensorrt_block_divides(grid_checkpoint):
    model = dataclasses.replace(load_checkpoint_config(grid_checkpoint).model, hidden_size=96)
    assert tensorrt_quant(QuantConfig(mode="int8_wo"), model, 1) == QuantConfig(mode="int8_wo")
    with pytest.raises(EngineError, match=r"neither of TensorRT's INT4 block sizes \(64, 128\) divides .*96"):
        tensorrt_quant(QuantConfig(mode="int4_wo"), model, 1)
