"""--kv-cache-dtype float16: the pools store K/V rounded to float16 (round to nearest even, saturated at +-65504), no
scales; attention computes in float32 over the widened values.

Tolerance: the relative RMS difference of a float16-KV engine's logits from the float32-KV engine's (same weights,
same tokens). float16 keeps 11 significant bits (relative rounding <= 2^-11 = 0.05%); measured on the tiny random
models: Llama 0.007%, Qwen2-sliding 0.009%, Qwen3 0.019%, Gemma2 0.020%, Gemma3 0.044%, Mistral-MQA 0.006%
(int8 KV: 0.35-1.8%, tests/quantization/test_kv_cache.py).
"""
from __future__ import annotations

import dataclasses
import os
import subprocess

import numpy as np
import onnx
import pytest

from engine.core.errors import EngineError
from engine.quantization.kv_cache import check_kv_cache_dtype
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.kv_budget import plan_kv_cache
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk
from tests.cli.engine_cli import ENGINE
from tests.plugins.runner import assert_close, run_op
from tests.plugins.test_attention import LOWERINGS, STEPS, make_step, reference, rotary_step
from tests.quantization.kv_engines import forced_logits, kv_engine, relative_rms
from tests.quantization.test_kv_cache import BLOCKS, FAMILIES, PROMPT, float_greedy
from tests.tolerances import assert_logits_close

FLOAT16_RELATIVE_RMS = 0.002


def as_float16(x: np.ndarray) -> np.ndarray:
    """What a float16 pool holds of x, widened back to float32."""
    return np.clip(x, -65504, 65504).astype(np.float16).astype(np.float32)


def float16_step(rng, steps: str, kv_heads: int, hd: int, heads: int):
    """A step whose pools are float16 and hold stale values, some K/V values beyond float16's range."""
    step = make_step(rng, STEPS[steps], kv_heads, hd, heads)
    f = step.feeds
    f["k"][0, :3] = [1e5, -7e4, 65519.0]   # saturate to +-65504; 65519 would round up to infinity
    f["kcache"], f["vcache"] = f["kcache"].astype(np.float16), f["vcache"].astype(np.float16)
    return step


@pytest.mark.parametrize("lowering", list(LOWERINGS))
@pytest.mark.parametrize("steps", ["mixed", "decode-one", "long-decode"])
def test_float16_write_and_attention_match_numpy(lowering, steps):
    from engine.plugins.attention import paged_attention, write_kv
    heads, kv_heads, hd, scale = 8, 2, 32, 32 ** -0.5
    step = float16_step(np.random.default_rng(21), steps, kv_heads, hd, heads)
    f = step.feeds

    def graph(g, q, k, v, kcache, vcache, slot_mapping, q_index, kv_slots, attn_mask, out_index):
        kc = write_kv(g, kcache, slot_mapping, k, name="/k_cache", kv_dtype="float16")
        vc = write_kv(g, vcache, slot_mapping, v, name="/v_cache", kv_dtype="float16")
        out = paged_attention(g, q, kc, vc, q_index=q_index, kv_slots=kv_slots, mask=attn_mask, out_index=out_index,
                              num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, scale=scale, softcap=None,
                              name="/attention", kv_dtype="float16", **LOWERINGS[lowering])
        op = g.scope("/pools")   # the runner's outputs are float
        return out, op("Cast", [kc], to=onnx.TensorProto.FLOAT)

    out, k_pool = run_op(graph, f)
    rounded = {**f, "k": as_float16(f["k"]), "v": as_float16(f["v"]), "kcache": f["kcache"].astype(np.float32),
               "vcache": f["vcache"].astype(np.float32)}
    np.testing.assert_array_equal(k_pool[f["slot_mapping"]], rounded["k"])
    assert k_pool.max() == 65504 and k_pool.min() == -65504
    expected = reference(dataclasses.replace(step, feeds=rounded), heads, kv_heads, hd, scale, None)
    assert_close(out, expected)


@pytest.mark.parametrize("steps", ["mixed", "decode-one", "tiles"])
def test_fused_rotary_kernel_on_float16_pools(steps):
    """RotaryPagedAttentionFp16: the rotated k and the v stored rounded to float16 (k within one float16 step of
    NumPy's rounding: the kernel's float32 rotary may round a value on a boundary the other way)."""
    from engine.plugins.attention import rotary_paged_attention
    heads, kv_heads, hd, scale = 9, 3, 64, 0.125
    rng = np.random.default_rng(22)
    step, feeds, (kcache, vcache) = rotary_step(rng, STEPS[steps], heads, kv_heads, hd)
    feeds["kcache"], feeds["vcache"] = feeds["kcache"].astype(np.float16), feeds["vcache"].astype(np.float16)

    def graph(g, qkv, positions, cos, sin, kc, vc, slot_mapping, q_index, kv_slots, attn_mask, out_index):
        out, kc, vc = rotary_paged_attention(g, qkv, positions, cos, sin, kc, vc, slot_mapping, q_index=q_index,
                                             kv_slots=kv_slots, mask=attn_mask, out_index=out_index,
                                             num_heads=heads, num_kv_heads=kv_heads, scale=scale, softcap=None,
                                             name="/attention", kv_dtype="float16")
        op = g.scope("/pools")
        return out, op("Cast", [kc], to=onnx.TensorProto.FLOAT), op("Cast", [vc], to=onnx.TensorProto.FLOAT)

    out, k_pool, v_pool = run_op(graph, feeds, threads=2)
    k_expected, v_expected = as_float16(kcache), as_float16(vcache)
    np.testing.assert_array_equal(v_pool, v_expected)
    assert np.all(np.abs(k_pool - k_expected) <= np.abs(k_expected) * 2.0 ** -10 + 1e-7)
    f = step.feeds
    rounded = {**f, "k": k_pool[f["slot_mapping"]], "v": as_float16(f["v"]), "kcache": k_pool, "vcache": v_pool}
    assert_close(out, reference(dataclasses.replace(step, feeds=rounded), heads, kv_heads, hd, scale, None))


@pytest.mark.parametrize("key", FAMILIES)
def test_float16_kv_logits_close_to_float_kv(tiny, key):
    reference_session = EngineSession(kv_engine(tiny, key, "float32"), num_blocks=64)
    tokens = float_greedy(reference_session)
    expected = forced_logits(reference_session, PROMPT, tokens, BLOCKS)
    session = EngineSession(kv_engine(tiny, key, "float16"), num_blocks=64)
    assert session.kv_pool[0][0].dtype == np.float16
    err = relative_rms(forced_logits(session, PROMPT, tokens, BLOCKS), expected)
    assert 0 < err <= FLOAT16_RELATIVE_RMS, f"{key}: float16 KV logits differ by {err:.3%} RMS from float KV"


def test_invariances_hold_with_float16_kv(tiny):
    """Chunked prefill == one-shot; cached decode == full prefill; reference lowering == kernels; tp=2 == tp=1."""
    from engine.runtime.tp.session import TPSession
    key, tokens = "LlamaForCausalLM", [7, 300, 41, 222, 5, 90]
    one_shot = forced_logits(EngineSession(kv_engine(tiny, key, "float16"), num_blocks=64), PROMPT, tokens, BLOCKS)
    chunked = forced_logits(EngineSession(kv_engine(tiny, key, "float16"), num_blocks=64), PROMPT, tokens, BLOCKS,
                            chunk=7)
    assert_logits_close(chunked, one_shot, what="float16 KV: chunked prefill")
    fresh = EngineSession(kv_engine(tiny, key, "float16"), num_blocks=64)
    uncached = np.stack([fresh.run([SeqChunk(PROMPT + tokens[:k], 0, BLOCKS, True)])[0]
                         for k in range(len(tokens) + 1)])
    assert_logits_close(one_shot, uncached, what="float16 KV: cached decode vs full prefill")
    plain = forced_logits(EngineSession(kv_engine(tiny, key, "float16", plugins=False), num_blocks=64), PROMPT,
                          tokens, BLOCKS)
    assert_logits_close(plain, one_shot, what="float16 KV: reference lowering vs kernels")
    session = TPSession(kv_engine(tiny, key, "float16", tp=2), num_blocks=64)
    try:
        assert session.kv_pool[0][0].dtype == np.float16
        assert_logits_close(forced_logits(session, PROMPT, tokens, BLOCKS), one_shot, what="float16 KV: tp=2")
    finally:
        session.close()


def test_pool_is_two_bytes_and_the_plan_holds_2x_tokens(tiny):
    key = "LlamaForCausalLM"
    f32, f16 = (load_engine_config(kv_engine(tiny, key, kv)) for kv in ("float32", "float16"))
    m = f16.model
    assert f16.memory.kv_bytes_per_token == m.num_layers * 2 * m.num_kv_heads * m.head_dim * 2
    assert f32.memory.kv_bytes_per_token == 2 * f16.memory.kv_bytes_per_token
    assert f16.memory.weight_bytes_per_rank == f32.memory.weight_bytes_per_rank   # no scales
    budget = 32 * f32.memory.kv_bytes_per_block
    tokens = {c.build.kv_cache_dtype: plan_kv_cache(c, kv_cache_bytes=budget).num_tokens for c in (f32, f16)}
    assert tokens["float16"] == 2 * tokens["float32"]
    assert not f16.quantization.kv_cache and f16.precision["kv_cache"] == "float16"


def test_tensorrt_is_refused_float16_kv():
    with pytest.raises(EngineError, match="--kv-cache-dtype float16 is built for --backend onnxruntime only"):
        check_kv_cache_dtype("float16", "tensorrt")
    check_kv_cache_dtype("float16", "onnxruntime")


def test_cli_build_scores_and_runs(tiny, tmp_path):
    """`engine build --kv-cache-dtype float16` scores the engine against the float32-KV one (no calibration), and
    `engine run` generates from the float16 pool."""
    out = tmp_path / "e"
    r = subprocess.run(ENGINE + ["build", "--checkpoint-dir", str(tiny.checkpoint("LlamaForCausalLM")),
                                 "--output-dir", str(out), "--kv-cache-dtype", "float16", "--max-seq-len", "128",
                                 "--eval-tokens", "128", "--max-ppl-increase", "0.5", "--no-progress"],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "accuracy (float16 KV cache): perplexity" in " ".join(r.stdout.split())
    config = load_engine_config(out)
    assert config.build.kv_cache_dtype == "float16" and abs(config.quantization.accuracy["ppl_increase_pct"]) < 0.5
    r = subprocess.run(ENGINE + ["run", "--engine-dir", str(out), "--max-kv-tokens", "512", "--input-text",
                                 "The capital of France", "--max-output-len", "8"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_auto_is_float16_for_quantized_builds_on_onnxruntime():
    from engine.quantization.kv_cache import resolve_kv_cache_dtype
    assert resolve_kv_cache_dtype("auto", "int8_wo", "onnxruntime") == "float16"
    assert resolve_kv_cache_dtype("auto", None, "onnxruntime") == "float32"       # a float32 build
    assert resolve_kv_cache_dtype("auto", "int4_awq", "tensorrt") == "float32"    # float pools only there
    assert resolve_kv_cache_dtype("int8", None, "onnxruntime") == "int8"          # asked for: as it is


def test_cli_defaults_of_a_quantized_build(tiny, tmp_path):
    """`engine build --dtype int4_wo` with no KV or lm_head flag: float16 pools and an int8 lm_head; `--dtype
    float32` keeps both float32."""
    for dtype, kv, head in (("int4_wo", "float16", "int8"), ("float32", "float32", "float32")):
        out = tmp_path / dtype
        r = subprocess.run(ENGINE + ["build", "--checkpoint-dir", str(tiny.checkpoint("LlamaForCausalLM")),
                                     "--output-dir", str(out), "--dtype", dtype, "--max-seq-len", "128",
                                     "--eval-tokens", "0", "--no-progress"],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        config = load_engine_config(out)
        assert (config.build.kv_cache_dtype, config.quantization.lm_head_dtype) == (kv, head)
