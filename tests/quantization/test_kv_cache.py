"""--kv-cache-dtype int8: int8 pools with calibrated per-KV-head scales (quantization/kv_cache.py).

Tolerance: the relative RMS difference of an int8-KV engine's logits from the float32-KV engine's (same weights, same
tokens: prefill, then teacher-forced decode steps). Measured on the tiny random models: Llama 0.42%, Qwen2-sliding
0.43%, Qwen3 0.79%, Gemma2 0.97%, Gemma3 1.8%, Mistral-MQA 0.35%, Phi3 0.58%; over int8_wo / int4_wo / fp8 / int8_sq /
int4_awq weights (Llama) 0.6 / 0.5 / 1.3 / 2.4 / 0.6%. A wrong or missing scale gives errors near 100%.
The invariances (chunked == one-shot prefill, cached == uncached, reference lowering == plugin, tp=2 == tp=1) hold to
float32 rounding (measured <= 1e-6): both sides quantize the same K/V with the same scales.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import numpy as np
import pytest

from engine.builder.build import check_build_config
from engine.builder.memory import memory_plan
from engine.core.engine_config import BuildConfig
from engine.core.errors import EngineError
from engine.quantization.kv_cache import check_kv_cache_dtype
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.kv_budget import plan_kv_cache
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk
from tests.builder.engines import prompts
from tests.cli.engine_cli import ENGINE, assert_one_line_error
from tests.quantization.kv_engines import forced_logits, kv_engine, relative_rms
from tests.tolerances import assert_logits_close

KV_RELATIVE_RMS = 0.04
# GQA, sliding + qkv bias, qk-norm with head_dim != hidden/heads, softcaps + sandwich norms, two rotary tables, MQA
FAMILIES = ["LlamaForCausalLM", "Qwen2ForCausalLM:sliding", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
            "Gemma3ForCausalLM", "MistralForCausalLM:mqa-no-window"]
PROMPT = prompts(1, (30,), seed=3)[0]       # not block-aligned (4 tokens a block), longer than the window (8)
BLOCKS = list(range(12))                    # 48 slots: the prompt and 8 decoded tokens


def float_greedy(session, steps: int = 8) -> list[int]:
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(forced_logits(session, PROMPT, tokens, BLOCKS)[-1].argmax()))
    return tokens


@pytest.mark.parametrize("plugin", [False, True])
def test_quantized_write_and_gather_match_numpy(plugin):
    """write_kv quantizes (round half to even, saturate), paged_attention attends over the dequantized context: both
    lowerings against the float64 reference of tests/plugins over the same dequantized pools, on a step mixing
    prefills, chunked prefills and decodes over an int8 pool full of stale values."""
    from engine.plugins.attention import paged_attention, write_kv
    from tests.plugins.runner import assert_close, run_op
    from tests.plugins.test_attention import STEPS, make_step, reference
    heads, kv_heads, hd, scale = 8, 2, 32, 32 ** -0.5
    rng = np.random.default_rng(11)
    step = make_step(rng, STEPS["mixed"], kv_heads, hd, heads)
    f = step.feeds
    ks, vs = (rng.uniform(0.01, 0.05, kv_heads * hd).astype(np.float32) for _ in range(2))
    for name, s in (("kcache", ks), ("vcache", vs)):
        f[name] = rng.integers(-128, 128, f[name].shape).astype(np.int8)
    feeds = {**f, "ks": ks, "vs": vs}

    def graph(g, q, k, v, kcache, vcache, slot_mapping, q_index, kv_slots, attn_mask, out_index, k_s, v_s):
        kc = write_kv(g, kcache, slot_mapping, k, name="/k_cache", scale=k_s)
        vc = write_kv(g, vcache, slot_mapping, v, name="/v_cache", scale=v_s)
        return paged_attention(g, q, kc, vc, q_index=q_index, kv_slots=kv_slots, mask=attn_mask, out_index=out_index,
                               num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, scale=scale, softcap=None,
                               name="/attention", plugin=plugin, k_scale=ks, v_scale=vs)

    ours = run_op(graph, feeds)
    qdq = lambda x, s: np.clip(np.rint(x / s), -128, 127) * s  # noqa: E731 - QuantizeLinear then DequantizeLinear
    dequantized = dataclasses.replace(step, feeds={**f, "k": qdq(f["k"], ks), "v": qdq(f["v"], vs),
                                                   "kcache": f["kcache"] * ks, "vcache": f["vcache"] * vs})
    assert_close(ours, reference(dequantized, heads, kv_heads, hd, scale, None))


@pytest.mark.parametrize("key", FAMILIES)
def test_int8_kv_logits_close_to_float_kv(tiny, key):
    reference = EngineSession(kv_engine(tiny, key, "float32"), num_blocks=64)
    tokens = float_greedy(reference)
    expected = forced_logits(reference, PROMPT, tokens, BLOCKS)
    session = EngineSession(kv_engine(tiny, key), num_blocks=64)
    actual = forced_logits(session, PROMPT, tokens, BLOCKS)
    err = relative_rms(actual, expected)
    assert 0 < err <= KV_RELATIVE_RMS, f"{key}: int8 KV logits differ by {err:.2%} RMS from float KV"


@pytest.mark.parametrize("key", ["LlamaForCausalLM", "Gemma2ForCausalLM"])
def test_invariances_hold_with_int8_kv(tiny, key):
    """Chunked prefill == one-shot; decode through the cache == prefill of the whole sequence (uncached); the
    reference lowering == the Attention plugin."""
    tokens = [7, 300, 41, 222, 5, 90]
    one_shot = forced_logits(EngineSession(kv_engine(tiny, key), num_blocks=64), PROMPT, tokens, BLOCKS)
    chunked = forced_logits(EngineSession(kv_engine(tiny, key), num_blocks=64), PROMPT, tokens, BLOCKS, chunk=7)
    assert_logits_close(chunked, one_shot, what=f"{key} int8 KV: chunked prefill")
    fresh = EngineSession(kv_engine(tiny, key), num_blocks=64)
    uncached = np.stack([fresh.run([SeqChunk(PROMPT + tokens[:k], 0, BLOCKS, True)])[0]
                         for k in range(len(tokens) + 1)])
    assert_logits_close(one_shot, uncached, what=f"{key} int8 KV: cached decode vs full prefill")
    reference = forced_logits(EngineSession(kv_engine(tiny, key, plugins=False), num_blocks=64), PROMPT, tokens,
                              BLOCKS)
    assert_logits_close(reference, one_shot, what=f"{key} int8 KV: reference lowering vs plugin")


@pytest.mark.parametrize("mode", ["int8_wo", "int4_wo", "fp8"])
def test_int8_kv_with_quantized_weights(tiny, mode):
    if mode == "fp8":
        pytest.importorskip("modelopt.torch.quantization", reason="fp8 weights are calibrated with nvidia-modelopt")
    key = "LlamaForCausalLM"
    tokens = [7, 300, 41, 222, 5, 90]
    expected = forced_logits(EngineSession(kv_engine(tiny, key, "float32", mode=mode), num_blocks=64), PROMPT,
                             tokens, BLOCKS)
    session = EngineSession(kv_engine(tiny, key, mode=mode), num_blocks=64)
    assert session.kv_pool[0][0].dtype == np.int8
    err = relative_rms(forced_logits(session, PROMPT, tokens, BLOCKS), expected)
    assert 0 < err <= KV_RELATIVE_RMS, f"{mode} weights: int8 KV logits differ by {err:.2%} RMS from float KV"


@pytest.mark.parametrize("key", ["LlamaForCausalLM", "MistralForCausalLM:mqa-no-window"])
def test_tp2_int8_kv_matches_tp1(tiny, key):
    """Each rank quantizes its own KV heads (MQA: a replicated head) with that head's scales."""
    from engine.runtime.tp.session import TPSession
    tokens = [7, 300, 41, 222]
    expected = forced_logits(EngineSession(kv_engine(tiny, key), num_blocks=64), PROMPT, tokens, BLOCKS)
    session = TPSession(kv_engine(tiny, key, tp=2), num_blocks=64)
    try:
        assert session.kv_pool[0][0].dtype == np.int8
        assert_logits_close(forced_logits(session, PROMPT, tokens, BLOCKS), expected, what=f"{key} tp=2 int8 KV")
    finally:
        session.close()


def test_pool_is_int8_and_the_plan_holds_4x_tokens(tiny):
    key = "LlamaForCausalLM"
    f32, int8 = load_engine_config(kv_engine(tiny, key, "float32")), load_engine_config(kv_engine(tiny, key))
    m = int8.model
    kv_size = m.num_kv_heads * m.head_dim
    assert int8.memory.kv_bytes_per_token == m.num_layers * 2 * kv_size          # 1 byte per element
    assert f32.memory.kv_bytes_per_token == 4 * int8.memory.kv_bytes_per_token
    budget = 32 * f32.memory.kv_bytes_per_block
    tokens = {c.build.kv_cache_dtype: plan_kv_cache(c, kv_cache_bytes=budget).num_tokens for c in (f32, int8)}
    assert tokens["int8"] == 4 * tokens["float32"]
    session = EngineSession(kv_engine(tiny, key), num_blocks=16)
    slots = 16 * int8.build.tokens_per_block
    for k, v in session.kv_pool:
        for pool in (k, v):
            assert pool.dtype == np.int8 and pool.shape == (slots, kv_size) and pool.nbytes == slots * kv_size
    session.run([SeqChunk(PROMPT, 0, BLOCKS, True)])
    k0 = session.kv_pool[0][0]
    # the calibrated absmax maps onto the int8 range: these prompt tokens (not calibration text) reach 122 of 127
    assert 64 <= np.abs(k0[:len(PROMPT)].astype(np.int32)).max() <= 127
    assert not k0[len(PROMPT):].any()
    assert memory_plan(m, int8.build).kv_bytes_per_block == int8.memory.kv_bytes_per_block


def test_config_records_the_scales_and_inspect_shows_them(tiny):
    d = kv_engine(tiny, "Qwen3ForCausalLM")
    config = load_engine_config(d)
    q, m = config.quantization, config.model
    assert config.build.kv_cache_dtype == q.kv_cache_dtype == "int8" and q.mode is None
    for key in ("k_scale", "v_scale"):
        scales = np.asarray(q.kv_cache[key])
        assert scales.shape == (m.num_layers, m.num_kv_heads) and (scales > 0).all()
    assert config.precision["kv_cache"].startswith("int8 symmetric")
    raw = json.loads((d / "config.json").read_text())
    assert raw["build"]["kv_cache_dtype"] == "int8" and raw["quantization"]["kv_cache"]["granularity"] == "per KV head"
    r = subprocess.run(ENGINE + ["inspect", "--engine-dir", str(d)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "kv_cache_dtype │ int8" in out and "int8 symmetric" in out and "K+V, int8" in out


@pytest.mark.parametrize("flags, message", [
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype 'int4' is unknown; use float32 or int8"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 cannot run on onnxruntime"),
    (["--kv-cache-dtype", "float32", "--calib-size", "4"], "apply to calibrated builds"),
])
def test_bad_kv_flags_are_one_line_errors(tiny, tmp_path, flags, message):
    r = subprocess.run(ENGINE + ["build", "--checkpoint-dir", str(tiny.checkpoint("LlamaForCausalLM")),
                                 "--output-dir", str(tmp_path / "e"), *flags],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 2
    assert_one_line_error(r, message)
    assert not (tmp_path / "e").exists()


def test_backends_that_cannot_run_int8_kv_are_refused(tiny):
    with pytest.raises(EngineError, match="use --kv-cache-dtype int8"):
        check_kv_cache_dtype("fp8", "onnxruntime")
    with pytest.raises(EngineError, match="--backend onnxruntime only"):
        check_kv_cache_dtype("int8", "tensorrt")
    model = load_engine_config(kv_engine(tiny, "LlamaForCausalLM")).model
    with pytest.raises(EngineError, match="--kv-cache-dtype int8 is built for --backend onnxruntime only"):
        check_build_config(model, BuildConfig(max_seq_len=128, max_input_len=64, backend="tensorrt",
                                              kv_cache_dtype="int8"))
    check_build_config(model, BuildConfig(max_seq_len=128, max_input_len=64, kv_cache_dtype="int8"))


def test_cli_build_calibrates_and_reports(tiny, tmp_path):
    """`engine build --kv-cache-dtype int8` with the default calibration (64 sampled sequences of up to 256 tokens)
    and the accuracy report against the float32-KV engine; `engine run` then generates from the int8 pool."""
    out = tmp_path / "e"
    r = subprocess.run(ENGINE + ["build", "--checkpoint-dir", str(tiny.checkpoint("LlamaForCausalLM")),
                                 "--output-dir", str(out), "--kv-cache-dtype", "int8", "--max-seq-len", "128",
                                 "--eval-tokens", "128", "--max-ppl-increase", "5", "--no-progress"],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "accuracy (int8 KV cache): perplexity" in " ".join(r.stdout.split())
    q = load_engine_config(out).quantization
    assert q.kv_cache["sequences"] == 64 and q.accuracy["ppl_increase_pct"] <= 5
    r = subprocess.run(ENGINE + ["run", "--engine-dir", str(out), "--max-kv-tokens", "512", "--input-text",
                                 "The capital of France", "--max-output-len", "8"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
