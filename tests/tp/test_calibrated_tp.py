"""Calibrated modes (fp8, int8_sq, int4_awq) at tp 2 and 4: calibration runs once on the whole model and each rank
takes its slice of the scales (quantization/calibrated_weights.shard_calibrated), and int8_sq's per-token activation
scale at
a row-parallel projection takes the max over the ranks, so a tp=N engine gives the tp=1 engine's logits of the same
mode within float reassociation, and the same greedy tokens. Llama (2 KV heads, one a rank), Qwen2 (tied, biases;
lm_head quantized: vocabulary-parallel scales, and a tied embedding reading the whole quantized table), Mistral MQA
(1 KV head copied to every rank, with its int8 KV cache scales) and Gemma3 (head_dim 32, sandwich norms)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.builder.build import build_engine
from engine.core.model_config import QuantConfig
from engine.quantization.calibrated_weights import quantize_weight, shard_calibrated
from engine.runtime.session import EngineSession
from engine.runtime.tp.session import TPSession
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD, prompts, slug
from tests.quantization.calibrated_engines import TINY_CALIBRATION
from tests.quantization.engines import NO_REPORT
from tests.tp.parity import check_same_as_tp1

LLAMA, QWEN2, MQA, GEMMA3 = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM:mqa-no-window",
                             "Gemma3ForCausalLM")
# int4_awq at group 32 at both tp (the default group depends on tp: the largest dividing every rank's in features)
GROUP = {"fp8": None, "int8_sq": None, "int4_awq": 32}
# at tp 4 a row-parallel projection of the tiny models takes 64 / 4 = 16 input features
GROUP_TP4 = {**GROUP, "int4_awq": 16}
# (model, mode, lm_head quantized, tp): tp 4 on fewer cases (four processes on a two-core machine are slow)
CASES = [(LLAMA, "fp8", False, 2), (LLAMA, "int4_awq", False, 2), (LLAMA, "int8_sq", False, 2),
         (QWEN2, "fp8", True, 2), (QWEN2, "int4_awq", True, 2), (QWEN2, "int8_sq", True, 2),
         (GEMMA3, "int4_awq", False, 2), (GEMMA3, "int8_sq", False, 2),
         (MQA, "fp8", False, 4), (MQA, "int8_sq", False, 4), (LLAMA, "int4_awq", False, 4), (GEMMA3, "fp8", False, 4)]
# the MQA model's one KV head is copied to both ranks, and with it the scales of an int8 KV cache
KV_CACHE = {MQA: "int8"}


def _engine(tiny, key: str, mode: str, tp: int, lm_head: bool, group: int | None):
    d = tiny.root / slug(key) / f"calibrated_{mode}_g{group}_lm{int(lm_head)}_tp{tp}"
    if not d.exists():
        build = dataclasses.replace(TEST_BUILD, tp_size=tp, kv_cache_dtype=KV_CACHE.get(key, "float32"))
        build_engine(tiny.checkpoint(key), d, build, ALL_PLUGINS,
                     accuracy=NO_REPORT,  # tp 1 and tp N of a case calibrate once (--calib-cache)
                     calibration=dataclasses.replace(TINY_CALIBRATION, cache=tiny.root / "calibrations"),
                     quant=QuantConfig(mode=mode, group_size=group, quantize_lm_head=lm_head))
    return d


@pytest.mark.parametrize("key,mode,lm_head,tp", CASES,
                         ids=[f"{slug(k)}-{m}{'-lm_head' * h}-tp{t}" for k, m, h, t in CASES])
def test_calibrated_tp_matches_tp1(tiny, key, mode, lm_head, tp):
    group = (GROUP_TP4 if tp == 4 else GROUP)[mode]
    reference = EngineSession(_engine(tiny, key, mode, 1, lm_head, group), num_blocks=64)
    session = TPSession(_engine(tiny, key, mode, tp, lm_head, group), num_blocks=64)
    try:
        check_same_as_tp1(reference, session, prompts(3, (5, 13, 30), seed=5), steps=6, what=f"{key} {mode} tp={tp}",
                          decode_dtype="int8_activations" if mode == "int8_sq" else None)
    finally:
        session.close()


def test_shards_put_back_together_are_the_whole_model():
    """Column-parallel rows (q/k/v by heads, gate/up), row-parallel columns with their input scales, per-tensor
    scales replicated, a KV head copied where tp exceeds the KV heads."""
    from engine.core.model_config import ModelConfig
    model = ModelConfig(architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_layers=1,
                        num_heads=4, num_kv_heads=1, head_dim=16, vocab_size=10, norm_eps=1e-6,
                        max_position_embeddings=64)
    rng = np.random.default_rng(0)
    whole = {}
    shapes = {"layers.0.attention.qkv": (96, 64), "layers.0.mlp.down": (64, 128), "lm_head": (10, 64)}
    for stem, (n, k) in shapes.items():
        w = rng.normal(size=(n, k)).astype(np.float32)
        whole.update(quantize_weight("int4_awq", w, np.abs(w).reshape(n, -1, 32).max(-1), group_size=32,
                                     prequant=rng.uniform(0.5, 2, k)).tensors(stem))
    ranks = [shard_calibrated(whole, model, "int4_awq", 2, r) for r in range(2)]
    down = "layers.0.mlp.down"
    for suffix in ("weight", "weights_scaling_factor", "prequant_scaling_factor"):
        joined = np.concatenate([r[f"{down}.{suffix}"] for r in ranks], axis=-1)
        np.testing.assert_array_equal(joined, whole[f"{down}.{suffix}"])
    qkv = whole["layers.0.attention.qkv.weight"]
    for r, rank in enumerate(ranks):   # q heads 2r, 2r+1; the one KV head on both ranks
        np.testing.assert_array_equal(rank["layers.0.attention.qkv.weight"],
                                      np.concatenate([qkv[32 * r:32 * r + 32], qkv[64:96]]))
        np.testing.assert_array_equal(rank["layers.0.attention.qkv.prequant_scaling_factor"],
                                      whole["layers.0.attention.qkv.prequant_scaling_factor"])
    # int8_sq's per-output-channel scales of a row-parallel projection stay whole on every rank
    sq = quantize_weight("int8_sq", whole[f"{down}.weight"].astype(np.float32), np.full(64, 7.0),
                         prequant=np.ones(128)).tensors(down)
    for r in range(2):
        mine = shard_calibrated(sq, model, "int8_sq", 2, r)
        np.testing.assert_array_equal(mine[f"{down}.weights_scaling_factor"], sq[f"{down}.weights_scaling_factor"])
        np.testing.assert_array_equal(mine[f"{down}.weight"], sq[f"{down}.weight"][:, 64 * r:64 * r + 64])
    # vocabulary 10 over 2 ranks: 5 rows each, no padding; scales follow their rows
    np.testing.assert_array_equal(np.concatenate([r["lm_head.weights_scaling_factor"] for r in ranks]),
                                  whole["lm_head.weights_scaling_factor"])



@pytest.mark.parametrize("key,mode,lm_head", [(LLAMA, "fp8", False), (QWEN2, "int4_awq", True), (QWEN2, "fp8", True),
                                              (MQA, "int4_awq", False)])
def test_planned_weights_are_each_rank_s_initializers(tiny, key, mode, lm_head):
    """The memory plan of a tp 2 calibrated build holds one rank's slice (and a tied embedding's own table)."""
    from engine.builder.build import resolve_quant
    from engine.builder.memory import memory_plan
    from engine.builder.model_graph import build_graph
    from engine.builder.rank_tensors import rank_tensors
    from engine.core.artifacts import load_checkpoint_config
    from engine.quantization.modelopt_calibration import calibrate
    from engine.quantization.calibrated_weights import CalibratedTensors
    ckpt_dir = tiny.checkpoint(key)
    ckpt = load_checkpoint_config(ckpt_dir)
    build = dataclasses.replace(TEST_BUILD, tp_size=2)
    quant = resolve_quant(QuantConfig(mode=mode, group_size=GROUP[mode], quantize_lm_head=lm_head), ckpt_dir, ckpt, 2)
    whole = dict(rank_tensors(ckpt_dir, ckpt, 1, 0))
    sample = lambda n, length, seed, start: prompts(n, (length,) * n, seed=seed)   # noqa: E731
    scales, _ = calibrate(ckpt.model, whole, quant, TINY_CALIBRATION, ckpt_dir, 1, 32, sample)
    plan = memory_plan(ckpt.model, build, quant, ALL_PLUGINS).weight_bytes_per_rank
    for rank in range(2):
        tensors = CalibratedTensors(rank_tensors(ckpt_dir, ckpt, 2, rank),
                                    shard_calibrated(scales, ckpt.model, mode, 2, rank))
        graph = build_graph(ckpt.model, tensors, build, ALL_PLUGINS, 2, quant, rank)
        actual = sum(len(t.raw_data) for t in graph.initializers if not t.name.startswith("/model/constants/"))
        assert plan[rank] == actual, f"rank {rank}"
