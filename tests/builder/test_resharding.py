"""Resharding at build: the rank tensors made from a tp=1 checkpoint equal those `engine convert --tp N` wrote,
and a tp=N checkpoint merged back to tp=1 equals the tp=1 checkpoint."""
from __future__ import annotations

import numpy as np
import pytest

from engine.builder.rank_tensors import rank_tensors
from engine.core.artifacts import load_checkpoint_config

# Tied embeddings, one KV head (replicated across ranks), qkv bias: the cases resharding treats specially.
KEYS = ["LlamaForCausalLM:llama3-rope-tied", "MistralForCausalLM:mqa-no-window", "Qwen2ForCausalLM"]


def _arrays(tensors) -> dict[str, np.ndarray]:
    return {name: tensors[name] for name in list(tensors)}


@pytest.mark.parametrize("key", KEYS)
def test_resharded_ranks_equal_converted_ranks(tiny, key):
    tp1, tp2 = tiny.checkpoint(key), tiny.checkpoint(key, tp=2)
    ckpt1, ckpt2 = load_checkpoint_config(tp1), load_checkpoint_config(tp2)
    for rank in (0, 1):
        resharded = _arrays(rank_tensors(tp1, ckpt1, 2, rank))
        converted = _arrays(rank_tensors(tp2, ckpt2, 2, rank))
        assert sorted(resharded) == sorted(converted)
        for name in converted:
            np.testing.assert_array_equal(resharded[name], converted[name], err_msg=f"{name} of rank {rank}")
    merged = _arrays(rank_tensors(tp2, ckpt2, 1, 0))
    original = _arrays(rank_tensors(tp1, ckpt1, 1, 0))
    assert sorted(merged) == sorted(original)
    for name in original:
        np.testing.assert_array_equal(merged[name], original[name], err_msg=name)
