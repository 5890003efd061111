"""A mixture-of-experts GGUF converted at --tp 2 (its experts split by intermediate features at convert, dequantized:
tests/tiny_gguf_moe.py's Qwen2-MoE, shared expert included) builds tp 2 engines, experts split (--moe-tp-size 2) or
divided between the ranks (--moe-ep-size 2, resharded at build), that give the tp 1 engine's logits and tokens."""
from __future__ import annotations

import dataclasses

import pytest

from engine.builder.build import build_engine
from engine.core.artifacts import load_checkpoint_config
from engine.recipes.convert import ConvertConfig, convert
from engine.recipes.gguf_source import GGUFSource
from engine.runtime.session import EngineSession
from engine.runtime.tp.session import TPSession
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD
from tests.tiny_gguf_moe import write_tiny_moe_gguf
from tests.tp.parity import check_same_as_tp1

BATCH = [[5, 17, 42, 99, 7], [250, 13, 64, 301, 8, 77, 3, 410, 21, 9, 188, 56, 12]]   # the GGUF's vocabulary: 418


@pytest.fixture(scope="module")
def gguf_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_moe_tp")
    write_tiny_moe_gguf(root / "m.gguf", "qwen2moe", "mix")
    for tp in (1, 2):
        with GGUFSource(root / "m.gguf") as source:
            convert(source, ConvertConfig(output_dir=root / f"ckpt_tp{tp}", tp=tp))
    build_engine(root / "ckpt_tp1", root / "engine_tp1", TEST_BUILD, ALL_PLUGINS)
    return root


@pytest.mark.parametrize("ep", [1, 2])
def test_tp2_gguf_checkpoint_matches_tp1(gguf_ckpts, ep):
    root = gguf_ckpts
    assert load_checkpoint_config(root / "ckpt_tp2").mapping.tp_size == 2
    build_engine(root / "ckpt_tp2", root / f"engine_tp2_ep{ep}",
                 dataclasses.replace(TEST_BUILD, tp_size=2, moe_ep_size=ep), ALL_PLUGINS)
    session = TPSession(root / f"engine_tp2_ep{ep}", num_blocks=64)
    try:
        check_same_as_tp1(EngineSession(root / "engine_tp1", num_blocks=64), session,
                          BATCH, steps=6, what=f"qwen2moe GGUF tp=2 ep={ep}")
    finally:
        session.close()
