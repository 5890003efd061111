"""Parity with transformers for every tiny model family: prefill logits and 16 greedy steps through the paged
cache, with the plugins enabled (fused kernels) and all disabled (reference lowerings)."""
from __future__ import annotations

import pytest

from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk
from tests.builder.engines import engine_greedy, hf_greedy, hf_last_logits, prompts
from tests.tiny_models import TINY_CONFIGS
from tests.tolerances import assert_logits_close

STEPS = 16


@pytest.mark.parametrize("plugins", [True, False], ids=["plugins", "reference"])
@pytest.mark.parametrize("key", sorted(TINY_CONFIGS))
def test_parity_with_transformers(tiny, key, plugins):
    session = EngineSession(tiny.engine(key, plugins=plugins), num_blocks=64)
    model = tiny.hf_model(key)
    # Prompts shorter and longer than the tiny models' sliding window (8), and not block-aligned.
    batch = prompts(3, (5, 13, 30), seed=1)
    tables, next_block = [], 0
    for ids in batch:
        n = -(-len(ids) // session.config.build.tokens_per_block)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    # All prompts prefilled in one step; logits of each one's last token.
    logits = session.run([SeqChunk(ids, 0, table, True) for ids, table in zip(batch, tables)])
    for row, ids in zip(logits, batch):
        assert_logits_close(row, hf_last_logits(model, ids), what=f"{key} prefill of {len(ids)} tokens")

    ids = batch[1]
    blocks = list(range(40, 40 + -(-(len(ids) + STEPS) // session.config.build.tokens_per_block)))
    tokens, engine_logits = engine_greedy(session, ids, STEPS, blocks)
    ref_tokens, ref_logits = hf_greedy(model, ids, STEPS)
    assert_logits_close(engine_logits, ref_logits, what=f"{key} greedy decode logits")
    assert tokens == ref_tokens
