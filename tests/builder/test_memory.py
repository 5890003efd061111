"""The memory plan against what the built graphs really hold."""
from __future__ import annotations

import dataclasses

import pytest

from engine.builder.rank_tensors import rank_tensors
from engine.builder.memory import memory_plan, plan_rows
from engine.builder.model_graph import build_graph
from engine.core.artifacts import load_checkpoint_config
from engine.core.model_config import QuantConfig
from engine.core.parallel import kv_heads_per_rank
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD
from tests.tiny_models import TINY_CONFIGS


@pytest.mark.parametrize("mode", ["int8_wo", "int4_wo"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("key", ["LlamaForCausalLM", "LlamaForCausalLM:llama3-rope-tied"])
def test_planned_weights_with_an_int8_lm_head(tiny, key, tp, mode):
    """lm_head (a tied embedding at tp 1) as int8 blocks of 32 beside the layers' own bits and group."""
    from engine.quantization import modes
    ckpt_dir = tiny.checkpoint(key)
    ckpt = load_checkpoint_config(ckpt_dir)
    build = dataclasses.replace(TEST_BUILD, tp_size=tp)
    quant = modes.resolve(QuantConfig(mode=mode, lm_head_dtype="int8", group_size=16 if mode == "int4_wo" else None),
                          ckpt.model, tp)
    graph = build_graph(ckpt.model, rank_tensors(ckpt_dir, ckpt, tp, tp - 1), build, ALL_PLUGINS, tp, quant)
    actual = sum(len(t.raw_data) for t in graph.initializers if not t.name.startswith("/model/constants/"))
    assert memory_plan(ckpt.model, build, quant, ALL_PLUGINS).weight_bytes_per_rank == (actual,) * tp


@pytest.mark.parametrize("lm_head_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("key", sorted(TINY_CONFIGS))
def test_planned_weights_are_the_graph_initializers(tiny, key, tp, lm_head_dtype):
    ckpt_dir = tiny.checkpoint(key)
    ckpt = load_checkpoint_config(ckpt_dir)
    build = dataclasses.replace(TEST_BUILD, tp_size=tp)
    quant = QuantConfig(lm_head_dtype=lm_head_dtype)   # bfloat16: lm_head (a tied embedding at tp 1) as tiles
    graph = build_graph(ckpt.model, rank_tensors(ckpt_dir, ckpt, tp, tp - 1), build, ALL_PLUGINS, tp, quant)
    actual = sum(len(t.raw_data) for t in graph.initializers if not t.name.startswith("/model/constants/"))
    plan = memory_plan(ckpt.model, build, quant)
    assert plan.weight_bytes_per_rank == (actual,) * tp
    m = ckpt.model
    assert plan.kv_bytes_per_token == m.num_layers * 2 * kv_heads_per_rank(m, tp) * m.head_dim * 4
    assert plan.kv_bytes_per_block == plan.kv_bytes_per_token * build.tokens_per_block
    assert plan.activation_bytes > 0
    assert len(plan_rows(plan, build)) == tp + 4
