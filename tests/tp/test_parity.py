"""tp=2 and tp=4 engines give the tp=1 engine's logits (float32 tolerance) and greedy tokens, for every family's tiny
model: 4 heads and 2 KV heads (1 for the MQA variant), so tp=4 replicates KV heads. Each TPSession spawns its
worker ranks as subprocesses (gloo on this CPU). Also: the whole runtime (scheduler, sampler) over a tp=2 engine."""
from __future__ import annotations

import dataclasses

import pytest

from engine.builder.build import build_engine
from engine.core.model_config import QuantConfig
from engine.plugins import bf16_matmul
from engine.runtime import LLM, SamplingParams
from engine.runtime.session import EngineSession
from engine.runtime.tp.session import TPSession
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD, prompts
from tests.tiny_models import TINY_CONFIGS
from tests.tp.parity import check_same_as_tp1

# tp=4 on a subset (four processes on this machine's two cores are slow): GQA with each KV head on two ranks, MQA
# with the one KV head on all four, and sliding + full layers with two rotary tables.
TP4 = ["LlamaForCausalLM", "MistralForCausalLM:mqa-no-window", "Gemma3ForCausalLM"]
CASES = [(key, 2) for key in TINY_CONFIGS] + [(key, 4) for key in TP4]


@pytest.mark.parametrize("key,tp", CASES, ids=[f"{k}-tp{tp}" for k, tp in CASES])
def test_tp_matches_tp1(tiny, key, tp):
    reference = EngineSession(tiny.engine(key), num_blocks=64)
    session = TPSession(tiny.engine(key, tp_size=tp), num_blocks=64)
    try:
        # Prompts shorter and longer than the sliding window (8), not block-aligned (4 tokens a block).
        check_same_as_tp1(reference, session, prompts(3, (5, 13, 30), seed=1), steps=6, what=f"{key} tp={tp}")
    finally:
        session.close()


def test_llm_over_tp2_engine_generates_what_tp1_does(tiny):
    """Continuous batching over the tensor-parallel session: several prompts of different lengths, greedy."""
    key = "Qwen2ForCausalLM:sliding"
    batch = prompts(3, (7, 19, 33), seed=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in LLM(tiny.engine(key), max_kv_tokens=512).generate(batch, params)]
    llm = LLM(tiny.engine(key, tp_size=2), max_kv_tokens=512)
    try:
        assert [o.token_ids for o in llm.generate(batch, params)] == expected
        llm.check_all_free()
    finally:
        llm.session.close()


def test_speculative_decoding_over_tp2_generates_what_tp1_does(tiny):
    """Prompt lookup over the tensor-parallel session: verification steps (several logits rows a sequence) cross the
    ranks' protocol, and the greedy tokens stay those of plain decoding at tp=1."""
    from tests.runtime.test_speculative import prompts as repeating
    key = "LlamaForCausalLM"
    batch = repeating(4, seed=0)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = [o.token_ids for o in LLM(tiny.engine(key), max_kv_tokens=512).generate(batch, params)]
    llm = LLM(tiny.engine(key, tp_size=2), max_kv_tokens=512,
              speculative_config={"method": "ngram", "prompt_lookup_min": 1, "max_batch_size": 8,
                                  "verify_cost": 0})
    try:
        assert [o.token_ids for o in llm.generate(batch, params)] == expected
        assert llm.core.speculator.stats.num_accepted_tokens > 0
        llm.check_all_free()
    finally:
        llm.session.close()


@pytest.mark.skipif(not bf16_matmul.supported(64), reason="this CPU has no AVX-512 BF16 dot products")
def test_bfloat16_lm_head_over_tp2_matches_tp1(tiny, tmp_path):
    """--lm-head-dtype bfloat16 on a tied model: tp=1 reads one table for the embedding and lm_head, each tp=2 rank
    its vocabulary shard of lm_head and a bfloat16 embedding table of its own; the same logits and greedy tokens."""
    key = "LlamaForCausalLM:llama3-rope-tied"
    engines = {}
    for tp in (1, 2):
        engines[tp] = tmp_path / f"tp{tp}"
        build_engine(tiny.checkpoint(key), engines[tp], dataclasses.replace(TEST_BUILD, tp_size=tp), ALL_PLUGINS,
                     quant=QuantConfig(lm_head_dtype="bfloat16"))
    session = TPSession(engines[2], num_blocks=64)
    try:
        check_same_as_tp1(EngineSession(engines[1], num_blocks=64), session, prompts(3, (5, 13, 30), seed=4),
                          steps=6, what=f"{key} bfloat16 lm_head tp=2", dtype="bfloat16_lm_head")
    finally:
        session.close()
