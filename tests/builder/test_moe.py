"""Mixture-of-experts engines (Mixtral, Qwen2-MoE, Qwen3-MoE tiny models; parity with transformers is
test_parity.py's): a token's experts do not depend on its batch or its chunk, the graph holds one MoE node a sparse
layer with the kernels and none without, and int8 / int4 experts stay within the dense families' tolerances."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.builder.build import build_engine
from engine.builder.memory import memory_plan
from engine.builder.model_graph import build_graph
from engine.builder.onnxruntime_backend import op_counts
from engine.builder.rank_tensors import rank_tensors
from engine.core.artifacts import load_checkpoint_config
from engine.core.engine_format import engine_file
from engine.core.errors import EngineError
from engine.core.model_config import QuantConfig
from engine.core.parallel import check_expert_parallel
from engine.plugins import native
from engine.quantization import modes
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk
from tests.builder.engines import ALL_PLUGINS, NO_PLUGINS, TEST_BUILD, prompts
from tests.quantization.engines import LOGITS_RELATIVE_RMS, quant_engine, relative_rms
from tests.tiny_models import MOE_ARCHITECTURES
from tests.tolerances import assert_logits_close

KEYS = list(MOE_ARCHITECTURES)
TPB = 4  # tokens_per_block of the test engines


def blocks_for(tokens: int, first: int = 0) -> list[int]:
    return list(range(first, first + -(-tokens // TPB)))


@pytest.mark.parametrize("plugins", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("key", KEYS)
def test_batch_equals_each_alone(tiny, key, plugins):
    """Prefills, a chunk and decodes in one step: each sequence's logits as when it runs alone (its tokens reach
    the same experts, grouped with other sequences' tokens or not)."""
    session = EngineSession(tiny.engine(key, plugins=plugins), num_blocks=64)
    a, b, c, d = prompts(4, (3, 17, 9, 25), seed=3)
    session.run([SeqChunk(b[:16], 0, blocks_for(17, 10), False)])
    session.run([SeqChunk(d[:20], 0, blocks_for(25, 30), False)])
    chunks = [SeqChunk(a, 0, blocks_for(3, 0), True), SeqChunk(b[16:], 16, blocks_for(17, 10), True),
              SeqChunk(c, 0, blocks_for(9, 20), False), SeqChunk(d[20:], 20, blocks_for(25, 30), True)]
    together = session.run(chunks)
    alone = [session.run([ch])[0] for ch in chunks if ch.num_logits]
    for i, (x, y) in enumerate(zip(together, alone)):
        assert_logits_close(x, y, what=f"{key} sequence {i} in a batch vs alone")


@pytest.mark.parametrize("plugins", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("key", KEYS)
def test_chunked_prefill_equals_one_shot(tiny, key, plugins):
    session = EngineSession(tiny.engine(key, plugins=plugins), num_blocks=64)
    ids = prompts(1, (30,), seed=5)[0]
    one_shot = session.run([SeqChunk(ids, 0, blocks_for(30), True)])
    table = blocks_for(30, 20)
    for start, end in ((0, 7), (7, 19)):
        session.run([SeqChunk(ids[start:end], start, table, False)])
    chunked = session.run([SeqChunk(ids[19:], 19, table, True)])
    assert_logits_close(chunked, one_shot, what=f"{key} chunked vs one-shot prefill")


@pytest.mark.parametrize("key", KEYS)
def test_one_moe_node_a_sparse_layer(tiny, key):
    model = load_engine_config(tiny.engine(key)).model
    sparse = sum(model.is_moe_layer(i) for i in range(model.num_layers))
    kernel = op_counts(tiny.engine(key) / engine_file(0))
    reference = op_counts(tiny.engine(key, plugins=False) / engine_file(0))
    assert kernel.get("engine.MoE", 0) == (sparse if native.has_int8_dot() else 0)
    assert not any(op.startswith("engine.") for op in reference)
    assert reference["TopK"] == reference["Softmax"] - model.num_layers == sparse   # attention has a Softmax each
    assert reference["ScatterND"] >= sparse * model.moe.num_experts


@pytest.mark.parametrize("plugins", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("mode", ["int8_wo", "int4_wo"])
@pytest.mark.parametrize("key", KEYS)
def test_quantized_experts_within_the_dense_tolerance(tiny, key, mode, plugins):
    batch = prompts(3, (5, 13, 30), seed=2)
    reference = _prefill(EngineSession(tiny.engine(key), num_blocks=64), batch)
    engine = quant_engine(tiny, key, mode, plugins=plugins)
    quantized = _prefill(EngineSession(engine, num_blocks=64), batch)
    assert relative_rms(quantized, reference) <= LOGITS_RELATIVE_RMS[mode]
    counts = op_counts(engine / engine_file(0))
    if plugins and native.has_int8_dot():
        assert counts.get("engine.MoE", 0) >= 1


@pytest.mark.parametrize("mode", ["int8_sq", "fp8", "int4_awq"])
def test_other_quantized_modes_are_refused(tiny, mode):
    model = load_engine_config(tiny.engine("MixtralForCausalLM")).model
    with pytest.raises(EngineError, match=f"--dtype {mode} is not supported for mixture-of-experts models yet"):
        modes.resolve(QuantConfig(mode=mode), model, 1)


def test_gguf_blocks_are_refused_with_what_to_build(tiny):
    model = load_engine_config(tiny.engine("MixtralForCausalLM")).model
    with pytest.raises(EngineError, match="--dtype gguf is not supported.*dequantized at convert.*--dtype int4_wo"):
        modes.resolve(QuantConfig(mode="gguf"), model, 1)


def test_tensorrt_is_refused_and_auto_builds_for_onnxruntime(tiny, monkeypatch, tmp_path):
    """Where TensorRT could build (faked here), --backend tensorrt is refused and auto keeps onnxruntime."""
    from engine.builder import build as build_module
    monkeypatch.setattr(build_module.trtb, "resolve_backend", lambda *args: "tensorrt")
    ckpt = tiny.checkpoint("Qwen3MoeForCausalLM")
    with pytest.raises(EngineError, match="--backend tensorrt does not build mixture-of-experts models yet"):
        build_engine(ckpt, tmp_path / "trt", dataclasses.replace(TEST_BUILD, backend="tensorrt"), ALL_PLUGINS)
    config = build_engine(ckpt, tmp_path / "auto", dataclasses.replace(TEST_BUILD, backend="auto"), ALL_PLUGINS)
    assert config.build.backend == "onnxruntime"


@pytest.mark.parametrize("plugins", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("mode", [None, "int8_wo", "int4_wo"])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("key", KEYS)
def test_planned_weights_are_the_graph_initializers(tiny, key, tp, ep, mode, plugins):
    """The memory plan counts each expert as the build stores it (stacked tiles or per-expert blocks), a rank's
    group of them with expert parallelism."""
    ckpt_dir = tiny.checkpoint(key)
    ckpt = load_checkpoint_config(ckpt_dir)
    build = dataclasses.replace(TEST_BUILD, tp_size=tp, moe_ep_size=ep)
    plugin_config = ALL_PLUGINS if plugins else NO_PLUGINS
    group = 16 if tp // ep == 2 and mode == "int4_wo" else None   # the experts' down has 16 in features a rank
    quant = modes.resolve(QuantConfig(mode=mode, group_size=group), ckpt.model, tp, ep)
    tensors = rank_tensors(ckpt_dir, ckpt, tp, tp - 1, ep)
    assert tensors["layers.1.moe.experts.down.weight"].shape[0] == ckpt.model.moe.num_experts // ep
    graph = build_graph(ckpt.model, tensors, build, plugin_config, tp, quant, tp - 1)
    actual = sum(len(t.raw_data) for t in graph.initializers if not t.name.startswith("/model/constants/"))
    assert memory_plan(ckpt.model, build, quant, plugin_config).weight_bytes_per_rank == (actual,) * tp


@pytest.mark.parametrize("key,tp,ep,match", [
    ("LlamaForCausalLM", 2, 2, "--moe-ep-size 2 splits the experts of a mixture-of-experts model"),
    ("MixtralForCausalLM", 8, 8, "--moe-ep-size 8 does not divide the 4 experts"),
    ("Qwen3MoeForCausalLM", 4, 3, "--moe-ep-size 3 must divide --tp 4"),
    ("Qwen3MoeForCausalLM", 128, 2, "--moe-tp-size 64 does not divide the experts' intermediate_size 32"),
])
def test_expert_parallel_that_does_not_fit_is_refused(tiny, key, tp, ep, match):
    with pytest.raises(EngineError, match=match):
        check_expert_parallel(load_checkpoint_config(tiny.checkpoint(key)).model, tp, ep)


def _prefill(session, batch) -> np.ndarray:
    return session.run([SeqChunk(ids, 0, blocks_for(len(ids), 10 * i), True) for i, ids in enumerate(batch)])
