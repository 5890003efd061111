"""Expert parallelism (--moe-ep-size): the experts divided among groups of ranks give the tp=1 engine's logits and
greedy tokens, for each mixture-of-experts family, with the engine's MoE kernel and with the reference lowering;
tp 4 as 2 groups of 2 ranks (each expert also split in two)."""
from __future__ import annotations

import pytest

from engine.runtime.engine_dir import load_engine_config
from engine.runtime.session import EngineSession
from engine.runtime.tp.session import TPSession
from tests.builder.engines import prompts
from tests.tiny_models import MOE_ARCHITECTURES
from tests.tp.parity import check_same_as_tp1

CASES = ([(key, 2, 2, True) for key in MOE_ARCHITECTURES] + [("Qwen2MoeForCausalLM", 2, 2, False),
                                                            ("Qwen3MoeForCausalLM", 4, 2, True)])


@pytest.mark.parametrize("key,tp,ep,plugins", CASES,
                         ids=[f"{k}-tp{tp}-ep{ep}-{'kernel' if p else 'reference'}" for k, tp, ep, p in CASES])
def test_expert_parallel_matches_tp1(tiny, key, tp, ep, plugins):
    reference = EngineSession(tiny.engine(key, plugins=plugins), num_blocks=64)
    engine = tiny.engine(key, plugins=plugins, tp_size=tp, moe_ep_size=ep)
    assert load_engine_config(engine).build.moe_ep_size == ep
    session = TPSession(engine, num_blocks=64)
    try:
        check_same_as_tp1(reference, session, prompts(3, (5, 13, 30), seed=1), steps=6,
                          what=f"{key} tp={tp} ep={ep}")
    finally:
        session.close()
