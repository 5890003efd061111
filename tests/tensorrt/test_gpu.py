"""TensorRT on a GPU: build the tiny models and the real one with `--backend tensorrt`, run them with TrtSession,
and compare with transformers; on two GPUs with TensorRT 11 and nccl4py, a tp=2 engine against the tp=1 one. Skipped where TensorRT or a CUDA GPU is missing, which includes every machine this
project has been developed and tested on so far: these tests have NEVER RUN. They need build.py's TensorRT wiring
(the `trt=` argument of build_engine)."""
from __future__ import annotations

import dataclasses

import pytest

from engine.builder.tensorrt_backend import TensorRTOptions, tensorrt_unavailable
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.core.serde import read_json
from engine.runtime.step_inputs import SeqChunk
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD, engine_greedy, hf_greedy, hf_last_logits, prompts
from tests.tiny_models import TINY_CONFIGS, is_moe
from tests.tolerances import assert_logits_close

# mixture-of-experts models have no TensorRT flavour yet (the build refuses them: docs/moe.md)
DENSE_KEYS = sorted(k for k in TINY_CONFIGS if not is_moe(k))

WHY = tensorrt_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"needs the `tensorrt` package and an NVIDIA GPU: {WHY}")
STEPS = 16


def build_trt(ckpt, out, build, tmp_path):
    from engine.builder.build import build_engine
    opts = TensorRTOptions(workspace_size=1 << 30, output_timing_cache=tmp_path / "timing.cache")
    return build_engine(ckpt, out, dataclasses.replace(build, backend="tensorrt"), ALL_PLUGINS, trt=opts)


@pytest.mark.parametrize("key", DENSE_KEYS)
def test_tiny_parity(tiny, key, tmp_path):
    from engine.core.engine_format import engine_file
    from engine.runtime.trt_session import TrtSession
    out = tmp_path / "engine"
    build_trt(tiny.checkpoint(key), out, TEST_BUILD, tmp_path)
    assert (out / engine_file(0, "tensorrt")).is_file()
    recorded = read_json(out / "config.json")
    assert recorded["build"]["backend"] == "tensorrt" and recorded["backend_device"]["compute_capability"]
    assert (tmp_path / "timing.cache").stat().st_size > 0
    session = TrtSession(out, num_blocks=64)
    model = tiny.hf_model(key)
    batch = prompts(3, (5, 13, 30), seed=1)
    tables, nxt = [], 0
    for ids in batch:
        n = -(-len(ids) // TEST_BUILD.tokens_per_block)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    logits = session.run([SeqChunk(ids, 0, t, True) for ids, t in zip(batch, tables)])
    for row, ids in zip(logits, batch):
        assert_logits_close(row, hf_last_logits(model, ids), what=f"TensorRT {key} prefill of {len(ids)} tokens")
    ids = batch[1]
    blocks = list(range(40, 40 + -(-(len(ids) + STEPS) // TEST_BUILD.tokens_per_block)))
    tokens, engine_logits = engine_greedy(session, ids, STEPS, blocks)
    ref_tokens, ref_logits = hf_greedy(model, ids, STEPS)
    assert_logits_close(engine_logits, ref_logits, what=f"TensorRT {key} greedy decode logits")
    assert tokens == ref_tokens


def test_input_timing_cache_is_reused(tiny, tmp_path):
    from engine.builder.build import build_engine
    ckpt = tiny.checkpoint("LlamaForCausalLM")
    build = dataclasses.replace(TEST_BUILD, backend="tensorrt")
    build_engine(ckpt, tmp_path / "a", build, PluginConfig(), trt=TensorRTOptions(output_timing_cache=tmp_path / "c"))
    build_engine(ckpt, tmp_path / "b", build, PluginConfig(), trt=TensorRTOptions(input_timing_cache=tmp_path / "c"))
    assert (tmp_path / "b" / "rank0.engine").is_file()


@pytest.mark.slow
def test_real_model_parity(smollm2_hf_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from engine.recipes.convert import ConvertConfig, convert
    from engine.recipes.sources import HFDirSource
    from engine.runtime.tokenizer import Tokenizer
    from engine.runtime.trt_session import TrtSession

    convert(HFDirSource(smollm2_hf_dir), ConvertConfig(output_dir=tmp_path / "ckpt"))
    build = BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=1024, max_num_tokens=1024)
    build_trt(tmp_path / "ckpt", tmp_path / "engine", build, tmp_path)
    session = TrtSession(tmp_path / "engine", num_blocks=256)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    ids = Tokenizer(tmp_path / "engine").encode("The capital of France is")
    tokens, logits = engine_greedy(session, ids, 32, list(range(2)))
    ref_tokens, ref_logits = hf_greedy(model, ids, 32)
    assert tokens == ref_tokens
    assert_logits_close(logits, ref_logits, what="TensorRT SmolLM2 greedy logits")


def two_gpus_with_nccl() -> str | None:
    """Why a tp=2 TensorRT engine cannot run here (None when it can)."""
    import importlib.util

    import torch
    if WHY is not None:
        return WHY
    if torch.cuda.device_count() < 2:
        return f"{torch.cuda.device_count()} GPU visible"
    if importlib.util.find_spec("nccl") is None:
        return "nccl4py is not installed"
    import tensorrt
    if not hasattr(tensorrt.INetworkDefinition, "add_dist_collective"):
        return f"TensorRT {tensorrt.__version__} has no DistCollective layer"
    return None


def test_tp2_matches_tp1(tiny, tmp_path):
    why = two_gpus_with_nccl()
    if why:
        pytest.skip(f"needs two GPUs, TensorRT 11 and nccl4py: {why}")
    from engine.runtime.trt_session import TrtSession
    from engine.runtime.tp.session import TPSession
    from tests.tp.parity import check_same_as_tp1

    key = "LlamaForCausalLM"
    build_trt(tiny.checkpoint(key), tmp_path / "tp1", TEST_BUILD, tmp_path)
    build_trt(tiny.checkpoint(key), tmp_path / "tp2", dataclasses.replace(TEST_BUILD, tp_size=2), tmp_path)
    session = TPSession(tmp_path / "tp2", num_blocks=64)
    try:
        check_same_as_tp1(TrtSession(tmp_path / "tp1", num_blocks=64), session, prompts(3, (5, 13, 30), seed=1),
                          steps=6, what="TensorRT tp=2")
    finally:
        session.close()
