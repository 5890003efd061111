"""SmolLM2-135M-Instruct at tp=3 (9 heads, 3 KV heads: one KV head per rank) against tp=1: logits within the
float32 tolerance and the same greedy answer, which is the right one."""
from __future__ import annotations

import dataclasses

import pytest

from engine.builder.build import build_engine
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.runtime.session import EngineSession
from engine.runtime.tokenizer import Tokenizer
from engine.runtime.tp.session import TPSession
from tests.builder.engines import engine_greedy
from tests.tp.parity import check_same_as_tp1

BUILD = BuildConfig(max_batch_size=4, max_input_len=128, max_seq_len=256, max_num_tokens=256, tokens_per_block=16)


@pytest.mark.slow   # ~90 s here: two builds (the tp=3 one writes 3 x 61 segment graphs) and three processes
def test_smollm2_tp3_matches_tp1(smollm2_checkpoint, tmp_path):
    engines = {}
    for tp in (1, 3):
        engines[tp] = tmp_path / f"tp{tp}"
        build_engine(smollm2_checkpoint, engines[tp], dataclasses.replace(BUILD, tp_size=tp), PluginConfig())
    tokenizer = Tokenizer(engines[1])
    ids = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    reference = EngineSession(engines[1], num_blocks=64)
    session = TPSession(engines[3], num_blocks=64)
    try:
        check_same_as_tp1(reference, session, [ids, ids[:7]], steps=8, what="SmolLM2 tp=3")
        tokens, _ = engine_greedy(session, ids, 8, list(range(20, 30)))
        assert tokenizer.decode(tokens).startswith("The capital of France is Paris")
    finally:
        session.close()
