"""int4_wo on a checkpoint whose projections are already 4-bit blocks of 32 with a float offset (what a GGUF Q4_1
file converts to): the blocks are kept exactly (quantization/weight_only.block_grid), so the int4 engine computes
what the float engine does; any other checkpoint is quantized by RTN as before."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.builder.build import build_engine, rank_tensors
from engine.builder.model_graph import build_graph
from engine.builder.memory import memory_plan
from engine.core.artifacts import load_checkpoint_config
from engine.core.config import QuantConfig
from engine.recipes.convert import ConvertConfig, convert
from engine.recipes.sources import HFDirSource
from engine.runtime.engine_dir import load_engine_config
from engine.quantization.weight_only import WeightOnlyScheme, block_grid, dequantize, quantize
from tests.builder.engines import ALL_PLUGINS, NO_PLUGINS, TEST_BUILD, prompts
from tests.tiny_models import make_tiny_model

from .engines import NO_REPORT, relative_rms
from .test_engines import _logits


def snap_q4_1(w: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 of a [out, in] weight, dequantized: per block of 32 inputs, d = (max - min) / 15, m = min,
    w = d * round((w - m) / d) + m."""
    blocks = w.reshape(w.shape[0], -1, 32)
    low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    d = (high - low) / 15
    return (torch.round((blocks - low) / d) * d + low).reshape(w.shape)


@pytest.fixture(scope="module")
def grid_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("q4_1")
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
    assert block_grid(np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32), 32) is None
    with pytest.raises(Exception, match="not on the 4-bit grid"):
        quantize(np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32),
                 WeightOnlyScheme(4, 32, 4, keep_grid=True))


@pytest.mark.parametrize("plugins", [True, False], ids=["matmulnbits", "reference"])
def test_int4_engine_of_a_q4_1_checkpoint_equals_the_float_engine(grid_checkpoint, tmp_path, plugins):
    float_dir, int4_dir = tmp_path / "float32", tmp_path / "int4"
    build_engine(grid_checkpoint, float_dir, TEST_BUILD, ALL_PLUGINS)
    plugin_config = ALL_PLUGINS if plugins else NO_PLUGINS
    # accuracy level 0: float compute, so the only difference left would be the weights
    build_engine(grid_checkpoint, int4_dir, TEST_BUILD, plugin_config, accuracy=NO_REPORT,
                 quant=QuantConfig(mode="int4_wo", accuracy_level=0))
    config = load_engine_config(int4_dir)
    assert config.quantization.source_grid and "GGUF Q4_1" in config.precision["weights"]
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
    assert memory_plan(ckpt.model, TEST_BUILD, quant).weight_bytes_per_rank == (actual,)


def test_random_checkpoint_keeps_rtn(tiny, tmp_path):
    build_engine(tiny.checkpoint("LlamaForCausalLM"), tmp_path / "e", TEST_BUILD, ALL_PLUGINS, accuracy=NO_REPORT,
                 quant=QuantConfig(mode="int4_wo"))
    config = load_engine_config(tmp_path / "e")
    assert not config.quantization.source_grid and "RTN" in config.precision["weights"]
