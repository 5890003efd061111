"""Parity with transformers for every tiny model family: prefill logits and 16 greedy steps through the paged
cache, with the plugins enabled (fused kernels) and all disabled (reference lowerings)."""
from __future__ import annotations

import pytest

from engine.runtime.session import EngineSession
from tests.builder.engines import check_parity
from tests.tiny_models import TINY_CONFIGS

STEPS = 16


@pytest.mark.parametrize("plugins", [True, False], ids=["plugins", "reference"])
@pytest.mark.parametrize("key", sorted(TINY_CONFIGS))
def test_parity_with_transformers(tiny, key, plugins):
    session = EngineSession(tiny.engine(key, plugins=plugins), num_blocks=64)
    check_parity(session, tiny.hf_model(key), key, steps=STEPS, seed=1, decode_prompt=1)
