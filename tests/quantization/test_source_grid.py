"""int4_wo and int4_awq on a checkpoint whose projections are already 4-bit blocks of 32 with a float offset (what a
GGUF Q4_1 file converts to): the blocks are kept exactly (quantization/weight_only.block_grid), so the int4 engine
computes what the float engine does; any other checkpoint is quantized by RTN / AWQ as before."""
from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch

from engine.builder.build import build_engine
from engine.builder.rank_tensors import rank_tensors
from engine.builder.onnxruntime_backend import op_counts
from engine.builder.model_graph import build_graph
from engine.builder.memory import memory_plan
from engine.core.artifacts import load_checkpoint_config
from engine.core.model_config import QuantConfig
from engine.recipes.convert import ConvertConfig, convert
from engine.recipes.sources import HFDirSource
from engine.runtime.engine_dir import load_engine_config
from engine.quantization.weight_only import WeightOnlyScheme, block_grid, dequantize, quantize
from tests.builder.engines import ALL_PLUGINS, NO_PLUGINS, TEST_BUILD, prompts
from tests.tiny_models import make_tiny_model

from .calibrated_engines import TINY_CALIBRATION
from .engines import NO_REPORT, REPACKED, projections, relative_rms
from .test_calibrated import _plan_matches_stored_bytes
from .test_engines import _logits


def snap_q4_1(w: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 of a [out, in] weight, dequantized: per block of 32 inputs, d = (max - min) / 15 and m = min, both
    float16 as GGUF stores them, w = d * round((w - m) / d) + m."""
    blocks = w.reshape(w.shape[0], -1, 32)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d, m = ((high - low) / 15).half().float(), low.half().float()
    return (torch.clamp(torch.round((blocks - m) / d), 0, 15) * d + m).reshape(w.shape)


@pytest.fixture(scope="module")
def grid_checkpoint(tmp_path_factory):
    return q4_1_checkpoint(tmp_path_factory.mktemp("q4_1"))


def q4_1_checkpoint(root):
    """A tiny Llama checkpoint whose layer weights lie on GGUF Q4_1 blocks, as one converted from a Q4_1 file."""
    hf = make_tiny_model("LlamaForCausalLM", root / "hf")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.copy_(snap_q4_1(p))
    model.save_pretrained(hf)
    convert(HFDirSource(hf), ConvertConfig(output_dir=root / "ckpt"))
    return root / "ckpt"


def test_block_grid_is_exact_and_refuses_other_weights():
    w = snap_q4_1(torch.randn(48, 96) * 0.02).numpy()
    q = block_grid(w, 32)
    assert q is not None and q.offsets is not None and q.packed.shape == (48, 3, 16)
    np.testing.assert_allclose(dequantize(q), w, rtol=0, atol=1e-7)
    assert q.half_scales and np.array_equal(q.scales.astype(np.float16).astype(np.float32), q.scales)
    assert block_grid(np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32), 32) is None
    # a grid whose steps are no float16 values is no GGUF file's: its scales could not be stored in 2 bytes
    blocks = torch.randn(48, 3, 32) * 0.02
    low = blocks.amin(-1, keepdim=True)
    d = (blocks.amax(-1, keepdim=True) - low) / 15
    assert block_grid((torch.round((blocks - low) / d) * d + low).reshape(48, 96).numpy(), 32) is None
    with pytest.raises(Exception, match="not on the 4-bit grid"):
        quantize(np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32),
                 WeightOnlyScheme(4, 32, 4, keep_grid=True))


@pytest.mark.parametrize("mode", ["int4_wo", "int4_awq"])
@pytest.mark.parametrize("plugins", ["kernels", "matmulnbits", "reference"])
def test_int4_engine_of_a_q4_1_checkpoint_equals_the_float_engine(grid_checkpoint, tmp_path, plugins, mode):
    """kernels: MatMulNBits + the engine's BlockOffsets op; matmulnbits: the offsets in standard ops."""
    float_dir, int4_dir = tmp_path / "float32", tmp_path / "int4"
    build_engine(grid_checkpoint, float_dir, TEST_BUILD, ALL_PLUGINS)
    plugin_config = {"kernels": ALL_PLUGINS, "reference": NO_PLUGINS,
                     "matmulnbits": dataclasses.replace(ALL_PLUGINS, engine_kernels_plugin=False)}[plugins]
    # accuracy level 0: float compute, so the only difference left would be the weights
    build_engine(grid_checkpoint, int4_dir, TEST_BUILD, plugin_config, accuracy=NO_REPORT,
                 quant=QuantConfig(mode=mode, accuracy_level=0), calibration=TINY_CALIBRATION)
    config = load_engine_config(int4_dir)
    assert config.quantization.source_grid and config.quantization.group_size == 32
    assert "GGUF Q4_1" in config.precision["weights"]
    if plugins != "reference":  # the blocks' scales are stored as the float16 values they are, widened when the engine loads
        scales = {t.name: t.data_type for t in onnx_initializers(int4_dir)}["layers.0.mlp.down.weights_scaling_factor"]
        assert scales == onnx.TensorProto.FLOAT16
    if mode == "int4_awq":  # nothing left to calibrate: ModelOpt does not run
        assert "skipped" in config.quantization.calibration
    batch = prompts(2, (7, 19), seed=3)
    ref_prefill, ref_tokens, ref_decode = _logits(float_dir, batch)
    prefill, tokens, decode = _logits(int4_dir, batch)
    assert relative_rms(prefill, ref_prefill) < 1e-4 and relative_rms(decode, ref_decode) < 1e-4
    assert tokens == ref_tokens


def test_plan_counts_the_offsets(grid_checkpoint):
    ckpt = load_checkpoint_config(grid_checkpoint)
    quant = QuantConfig(mode="int4_wo", group_size=32, accuracy_level=4, source_grid=True)
    graph = build_graph(ckpt.model, rank_tensors(grid_checkpoint, ckpt, 1, 0), TEST_BUILD, ALL_PLUGINS, 1, quant)
    actual = sum(len(t.raw_data) for t in graph.initializers if not t.name.startswith("/model/constants/"))
    assert memory_plan(ckpt.model, TEST_BUILD, quant, ALL_PLUGINS).weight_bytes_per_rank == (actual,)


def test_random_checkpoint_keeps_rtn(tiny, tmp_path):
    build_engine(tiny.checkpoint("LlamaForCausalLM"), tmp_path / "e", TEST_BUILD, ALL_PLUGINS, accuracy=NO_REPORT,
                 quant=QuantConfig(mode="int4_wo"))
    config = load_engine_config(tmp_path / "e")
    assert not config.quantization.source_grid and "RTN" in config.precision["weights"]


def test_int4_awq_on_the_grid_calibrates_lm_head_only(grid_checkpoint, tmp_path):
    engine = tmp_path / "awq"
    build_engine(grid_checkpoint, engine, TEST_BUILD, ALL_PLUGINS, accuracy=NO_REPORT, calibration=TINY_CALIBRATION,
                 quant=QuantConfig(mode="int4_awq", quantize_lm_head=True))
    config = load_engine_config(engine)
    assert config.quantization.source_grid and config.quantization.calibration["sequences"] == 8
    assert "lm_head int4 with AWQ" in config.precision["weights"]
    inits = {t.name for t in onnx_initializers(engine)}
    assert "lm_head.prequant_scaling_factor" in inits             # AWQ's input scale of lm_head
    assert not any(n.startswith("layers.") and n.endswith("prequant_scaling_factor") for n in inits)
    # the layers' blocks, kept: their offsets beside them, or in QuantMatMul's blocks
    assert ("layers.0.attention.qkv.weights_offset" in inits) == (not REPACKED)
    assert projections(op_counts(engine / "rank0.onnx")) == 2 * 4 + 1
    _plan_matches_stored_bytes(engine)


def test_int4_awq_with_another_group_size_runs_awq(grid_checkpoint, tmp_path):
    engine = tmp_path / "awq64"
    build_engine(grid_checkpoint, engine, TEST_BUILD, ALL_PLUGINS, accuracy=NO_REPORT, calibration=TINY_CALIBRATION,
                 quant=QuantConfig(mode="int4_awq", group_size=64))
    config = load_engine_config(engine)
    assert not config.quantization.source_grid and config.quantization.calibration["sequences"] == 8
    assert "layers.0.attention.qkv.prequant_scaling_factor" in {t.name for t in onnx_initializers(engine)}


def onnx_initializers(engine):
    return onnx.load(str(engine / "rank0.onnx"), load_external_data=False).graph.initializer
