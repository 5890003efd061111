"""--kv-cache-dtype int8|fp8: int8 pools, or e4m3 codes in uint8 pools (plugins/e4m3.py), with calibrated per-KV-head
scales (quantization/kv_cache.py).

Tolerance: the relative RMS difference of a quantized-KV engine's logits from the float32-KV engine's (same weights,
same tokens: prefill, then teacher-forced decode steps). Measured on the tiny random models, int8: Llama 0.42%,
Qwen2-sliding 0.43%, Qwen3 0.79%, Gemma2 0.97%, Gemma3 1.8%, Mistral-MQA 0.35%, Phi3 0.58%; over int8_wo / int4_wo /
fp8 / int8_sq / int4_awq weights (Llama) 0.6 / 0.5 / 1.3 / 2.4 / 0.6%. fp8 (3 mantissa bits): Llama 1.00%,
Qwen2-sliding 1.06%, Qwen3 1.81%, Gemma2 2.26%, Gemma3 5.68%, Mistral-MQA 0.99%. A wrong or missing scale gives
errors near 100%.
The invariances (chunked == one-shot prefill, cached == uncached, reference lowering == plugin, tp=2 == tp=1) hold to
float32 rounding (measured <= 1e-6): both sides quantize the same K/V with the same scales.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess

import ml_dtypes
import numpy as np
import onnx
import pytest

from engine.builder.build import check_build_config
from engine.builder.memory import memory_plan
from engine.core.engine_format import BuildConfig
from engine.core.errors import EngineError
from engine.plugins import e4m3
from engine.quantization.kv_cache import check_kv_cache_dtype
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.kv_budget import plan_kv_cache
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk
from tests.builder.engines import prompts
from tests.cli.engine_cli import ENGINE, assert_one_line_error
from tests.quantization.kv_engines import forced_logits, kv_engine, relative_rms
from tests.tolerances import assert_logits_close

KV_RELATIVE_RMS = {"int8": 0.04, "fp8": 0.08}
POOL_DTYPE = {"int8": np.int8, "fp8": np.uint8}   # fp8: e4m3 codes
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


def _int8_pool(rng, shape):
    codes = rng.integers(-128, 128, shape).astype(np.int8)
    return codes, codes.astype(np.float32)


def _fp8_pool(rng, shape):
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    codes[_nan_code(codes)] = 0           # the NaN codes are never written
    return codes, e4m3.VALUES[codes]


def _nan_code(codes: np.ndarray) -> np.ndarray:
    return (codes & 0x7F) == 0x7F


def _to_e4m3(y: np.ndarray) -> np.ndarray:
    """ml_dtypes' e4m3 of y, saturated at 448 as QuantizeLinear to float8 does."""
    return np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn)


# per KV dtype: a pool of stale codes and its unscaled values; what QuantizeLinear then DequantizeLinear gives x / s
POOLS = {"int8": (_int8_pool, lambda x, s: np.clip(np.rint(x / s), -128, 127) * s),
         "fp8": (_fp8_pool, lambda x, s: _to_e4m3(x / s).astype(np.float32) * s)}


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("lowering", ["reference", "attention", "kernel"])
@pytest.mark.parametrize("steps", ["mixed", "decode-one"])
def test_quantized_write_and_gather_match_numpy(lowering, steps, kv):
    """write_kv quantizes (round half to even, saturate; fp8 as ml_dtypes' e4m3), paged_attention attends over the
    dequantized context: the three lowerings against the float64 reference of tests/plugins over the same dequantized
    pools, on a step mixing prefills, chunked prefills and decodes over a quantized pool full of stale values."""
    from engine.plugins.attention import paged_attention, write_kv
    from tests.plugins.runner import assert_close, run_op
    from tests.plugins.test_attention import LOWERINGS, STEPS, make_step, reference
    heads, kv_heads, hd, scale = 8, 2, 32, 32 ** -0.5
    rng = np.random.default_rng(11)
    step = make_step(rng, STEPS[steps], kv_heads, hd, heads)
    f = step.feeds
    ks, vs = (rng.uniform(0.01, 0.05, kv_heads * hd).astype(np.float32) for _ in range(2))
    make_pool, qdq = POOLS[kv]
    f["kcache"], k_values = make_pool(rng, f["kcache"].shape)
    f["vcache"], v_values = make_pool(rng, f["vcache"].shape)
    feeds = {**f, "ks": ks, "vs": vs}

    def graph(g, q, k, v, kcache, vcache, slot_mapping, q_index, kv_slots, attn_mask, out_index, k_s, v_s):
        kernel = LOWERINGS[lowering].get("kernel", False)
        kc = write_kv(g, kcache, slot_mapping, k, name="/k_cache", scale=k_s, kv_dtype=kv, channels=kv_heads * hd,
                      kernel=kernel)
        vc = write_kv(g, vcache, slot_mapping, v, name="/v_cache", scale=v_s, kv_dtype=kv, channels=kv_heads * hd,
                      kernel=kernel)
        return paged_attention(g, q, kc, vc, q_index=q_index, kv_slots=kv_slots, mask=attn_mask, out_index=out_index,
                               num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, scale=scale, softcap=None,
                               name="/attention", k_scale=ks, v_scale=vs, kv_dtype=kv, **LOWERINGS[lowering])

    ours = run_op(graph, feeds)
    dequantized = dataclasses.replace(step, feeds={**f, "k": qdq(f["k"], ks), "v": qdq(f["v"], vs),
                                                   "kcache": k_values * ks, "vcache": v_values * vs})
    assert_close(ours, reference(dequantized, heads, kv_heads, hd, scale, None))


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("steps", ["mixed", "decode-one"])
def test_fused_rotary_kernel_on_quantized_pools(steps, kv):
    """RotaryPagedAttention{Int8,Fp8}: the rotated k and the v stored as write_kv stores them (codes within one
    step of NumPy's: the kernel's float32 rotary may round a value on a code boundary the other way), the output
    as paged_attention's over the dequantized pools, against the float64 reference of tests/plugins."""
    from engine.plugins.attention import rotary_paged_attention
    from tests.plugins.runner import assert_close, run_op
    from tests.plugins.test_attention import STEPS, reference, rotary_step
    heads, kv_heads, hd, scale = 8, 2, 32, 32 ** -0.5
    rng = np.random.default_rng(12)
    step, feeds, _ = rotary_step(rng, STEPS[steps], heads, kv_heads, hd)
    f = step.feeds   # q and k rotated
    ks, vs = (rng.uniform(0.01, 0.05, kv_heads * hd).astype(np.float32) for _ in range(2))
    make_pool, qdq = POOLS[kv]
    feeds["kcache"], k_values = make_pool(rng, f["kcache"].shape)
    feeds["vcache"], v_values = make_pool(rng, f["vcache"].shape)

    def graph(g, qkv, positions, cos, sin, kcache, vcache, slot_mapping, q_index, kv_slots, attn_mask, out_index,
              k_s, v_s):
        out, kc, vc = rotary_paged_attention(g, qkv, positions, cos, sin, kcache, vcache, slot_mapping,
                                             q_index=q_index, kv_slots=kv_slots, mask=attn_mask,
                                             out_index=out_index, num_heads=heads, num_kv_heads=kv_heads,
                                             scale=scale, softcap=None, name="/attention", k_scale=k_s, v_scale=v_s,
                                             kv_dtype=kv)
        op = g.scope("/pools")   # the runner's outputs are float: the codes, cast (exactly)
        return out, op("Cast", [kc], to=onnx.TensorProto.FLOAT), op("Cast", [vc], to=onnx.TensorProto.FLOAT)

    out, k_pool, v_pool = run_op(graph, {**feeds, "ks": ks, "vs": vs})
    values = (lambda c: c) if kv == "int8" else (lambda c: e4m3.VALUES[c.astype(np.uint8)])
    k_expected, v_expected = k_values.copy(), v_values.copy()
    stored = {"int8": lambda x, s: np.clip(np.rint(x / s), -128, 127),
              "fp8": lambda x, s: _to_e4m3(x / s).astype(np.float32)}[kv]   # what qdq multiplies by s
    k_expected[f["slot_mapping"]], v_expected[f["slot_mapping"]] = stored(f["k"], ks), stored(f["v"], vs)
    for pool, expected in ((k_pool, k_expected), (v_pool, v_expected)):
        step_size = 1.0 if kv == "int8" else np.maximum(np.abs(expected) / 8, 2.0 ** -9)
        assert np.all(np.abs(values(pool) - expected) <= step_size * 1.001)
        assert np.mean(values(pool) == expected) > 0.99
    dequantized = dataclasses.replace(step, feeds={**f, "k": qdq(f["k"], ks), "v": qdq(f["v"], vs),
                                                   "kcache": k_values * ks, "vcache": v_values * vs})
    assert_close(out, reference(dequantized, heads, kv_heads, hd, scale, None), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kernel", [False, True], ids=["onnx", "kernel"])
def test_e4m3_codes_are_ml_dtypes_codes(kernel):
    """plugins/e4m3.encode gives every e4m3 value (at several scales) and random inputs over 8 decades the code
    ml_dtypes gives (saturated at 448; a negative zero may come out as +0), and decode reads them back."""
    from engine.plugins.e4m3 import decode, encode
    from tests.plugins.runner import run_op
    scale = np.array([1e-3, 0.01, 0.5, 1.0, 3.0, 100.0], np.float32)
    finite = e4m3.VALUES[~_nan_code(np.arange(256))]
    rng = np.random.default_rng(0)
    x = np.concatenate([finite[:, None] * scale,
                        rng.standard_normal((4000, 6)).astype(np.float32) * scale
                        * rng.choice([1e-4, 1e-2, 1.0, 1e2, 1e4], (4000, 1)).astype(np.float32)])

    def graph(g, x, s):
        codes = encode(g, g.scope("/encode"), x, s, 6, kernel=kernel)
        return g.node("Cast", [codes], name="/codes", to=onnx.TensorProto.FLOAT), decode(g, g.scope("/decode"), codes)

    codes, values = run_op(graph, {"x": x, "s": scale})
    codes = codes.astype(np.uint8)
    expected = _to_e4m3(x / scale)
    same = (codes == expected.view(np.uint8)) | ((e4m3.VALUES[codes] == 0) & (expected.astype(np.float32) == 0))
    assert same.all(), x[~same][:5]
    np.testing.assert_array_equal(values, expected.astype(np.float32))


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("key", FAMILIES)
def test_quantized_kv_logits_close_to_float_kv(tiny, key, kv):
    reference = EngineSession(kv_engine(tiny, key, "float32"), num_blocks=64)
    tokens = float_greedy(reference)
    expected = forced_logits(reference, PROMPT, tokens, BLOCKS)
    session = EngineSession(kv_engine(tiny, key, kv), num_blocks=64)
    actual = forced_logits(session, PROMPT, tokens, BLOCKS)
    err = relative_rms(actual, expected)
    assert 0 < err <= KV_RELATIVE_RMS[kv], f"{key}: {kv} KV logits differ by {err:.2%} RMS from float KV"


@pytest.mark.parametrize("key, kv", [("LlamaForCausalLM", "int8"), ("Gemma2ForCausalLM", "int8"),
                                     ("LlamaForCausalLM", "fp8")])
def test_invariances_hold_with_quantized_kv(tiny, key, kv):
    """Chunked prefill == one-shot; decode through the cache == prefill of the whole sequence (uncached); the
    reference lowering == the Attention plugin."""
    tokens = [7, 300, 41, 222, 5, 90]
    one_shot = forced_logits(EngineSession(kv_engine(tiny, key, kv), num_blocks=64), PROMPT, tokens, BLOCKS)
    chunked = forced_logits(EngineSession(kv_engine(tiny, key, kv), num_blocks=64), PROMPT, tokens, BLOCKS, chunk=7)
    assert_logits_close(chunked, one_shot, what=f"{key} {kv} KV: chunked prefill")
    fresh = EngineSession(kv_engine(tiny, key, kv), num_blocks=64)
    uncached = np.stack([fresh.run([SeqChunk(PROMPT + tokens[:k], 0, BLOCKS, True)])[0]
                         for k in range(len(tokens) + 1)])
    assert_logits_close(one_shot, uncached, what=f"{key} {kv} KV: cached decode vs full prefill")
    reference = forced_logits(EngineSession(kv_engine(tiny, key, kv, plugins=False), num_blocks=64), PROMPT, tokens,
                              BLOCKS)
    assert_logits_close(reference, one_shot, what=f"{key} {kv} KV: reference lowering vs plugin")


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
    assert 0 < err <= KV_RELATIVE_RMS["int8"], f"{mode} weights: int8 KV logits differ by {err:.2%} RMS from float KV"


@pytest.mark.parametrize("mode", ["int8_sq", "int4_awq"])
def test_kv_scales_are_the_float_model_s_whatever_the_weights(tiny, mode):
    """ModelOpt's smoothing and AWQ scale the torch model's weights in place: the KV cache is calibrated first, on
    the checkpoint's weights, so its scales are those of the engine whose weights are not quantized."""
    pytest.importorskip("modelopt.torch.quantization", reason="calibrated with nvidia-modelopt")
    key = "LlamaForCausalLM"
    expected = load_engine_config(kv_engine(tiny, key)).quantization.kv_cache
    assert load_engine_config(kv_engine(tiny, key, mode=mode)).quantization.kv_cache == expected


@pytest.mark.parametrize("key, kv", [("LlamaForCausalLM", "int8"), ("MistralForCausalLM:mqa-no-window", "int8"),
                                     ("MistralForCausalLM:mqa-no-window", "fp8")])
def test_tp2_quantized_kv_matches_tp1(tiny, key, kv):
    """Each rank quantizes its own KV heads (MQA: a replicated head) with that head's scales."""
    from engine.runtime.tp.session import TPSession
    tokens = [7, 300, 41, 222]
    expected = forced_logits(EngineSession(kv_engine(tiny, key, kv), num_blocks=64), PROMPT, tokens, BLOCKS)
    session = TPSession(kv_engine(tiny, key, kv, tp=2), num_blocks=64)
    try:
        assert session.kv_pool[0][0].dtype == POOL_DTYPE[kv]
        assert_logits_close(forced_logits(session, PROMPT, tokens, BLOCKS), expected, what=f"{key} tp=2 {kv} KV")
    finally:
        session.close()


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_pool_is_one_byte_and_the_plan_holds_4x_tokens(tiny, kv):
    key = "LlamaForCausalLM"
    f32, int8 = load_engine_config(kv_engine(tiny, key, "float32")), load_engine_config(kv_engine(tiny, key, kv))
    m = int8.model
    kv_size = m.num_kv_heads * m.head_dim
    assert int8.memory.kv_bytes_per_token == m.num_layers * 2 * kv_size          # 1 byte per element
    assert f32.memory.kv_bytes_per_token == 4 * int8.memory.kv_bytes_per_token
    budget = 32 * f32.memory.kv_bytes_per_block
    tokens = {c.build.kv_cache_dtype: plan_kv_cache(c, kv_cache_bytes=budget).num_tokens for c in (f32, int8)}
    assert tokens[kv] == 4 * tokens["float32"]
    session = EngineSession(kv_engine(tiny, key, kv), num_blocks=16)
    slots = 16 * int8.build.tokens_per_block
    for k, v in session.kv_pool:
        for pool in (k, v):
            assert pool.dtype == POOL_DTYPE[kv] and pool.shape == (slots, kv_size) and pool.nbytes == slots * kv_size
    session.run([SeqChunk(PROMPT, 0, BLOCKS, True)])
    k0 = session.kv_pool[0][0]
    # the calibrated absmax maps onto the quantized range: these prompt tokens (not calibration text) reach 122 of
    # int8's 127, and fp8 codes of e4m3 values above 448 / 4
    written = np.abs(k0[:len(PROMPT)].astype(np.int32)) if kv == "int8" else np.abs(e4m3.VALUES[k0[:len(PROMPT)]])
    assert {"int8": 64, "fp8": 112}[kv] <= written.max() <= {"int8": 127, "fp8": 448}[kv]
    assert not k0[len(PROMPT):].any()
    assert memory_plan(m, int8.build).kv_bytes_per_block == int8.memory.kv_bytes_per_block


@pytest.mark.parametrize("kv, described", [("int8", "int8 symmetric"), ("fp8", "fp8 e4m3 (uint8 codes, emulated")])
def test_config_records_the_scales_and_inspect_shows_them(tiny, kv, described):
    d = kv_engine(tiny, "Qwen3ForCausalLM", kv)
    config = load_engine_config(d)
    q, m = config.quantization, config.model
    assert config.build.kv_cache_dtype == q.kv_cache_dtype == kv and q.mode is None
    for key in ("k_scale", "v_scale"):
        scales = np.asarray(q.kv_cache[key])
        assert scales.shape == (m.num_layers, m.num_kv_heads) and (scales > 0).all()
    assert config.precision["kv_cache"].startswith(described)
    raw = json.loads((d / "config.json").read_text())
    assert raw["build"]["kv_cache_dtype"] == kv and raw["quantization"]["kv_cache"]["granularity"] == "per KV head"
    r = subprocess.run(ENGINE + ["inspect", "--engine-dir", str(d)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert f"kv_cache_dtype │ {kv}" in out and described in out and f"K+V, {kv}" in out


@pytest.mark.parametrize("flags, message", [
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype 'int4' is unknown; use float32, float16, int8, fp8"),
    (["--kv-cache-dtype", "float32", "--calib-size", "4"], "apply to calibrated builds"),
])
def test_bad_kv_flags_are_one_line_errors(tiny, tmp_path, flags, message):
    r = subprocess.run(ENGINE + ["build", "--checkpoint-dir", str(tiny.checkpoint("LlamaForCausalLM")),
                                 "--output-dir", str(tmp_path / "e"), *flags],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 2
    assert_one_line_error(r, message)
    assert not (tmp_path / "e").exists()


def test_backends_that_cannot_run_quantized_kv_are_refused(tiny):
    for kv in ("int8", "fp8"):
        with pytest.raises(EngineError, match="--backend onnxruntime only"):
            check_kv_cache_dtype(kv, "tensorrt")
        check_kv_cache_dtype(kv, "onnxruntime")
    model = load_engine_config(kv_engine(tiny, "LlamaForCausalLM")).model
    with pytest.raises(EngineError, match="--kv-cache-dtype int8 is built for --backend onnxruntime only"):
        check_build_config(model, BuildConfig(max_seq_len=128, max_input_len=64, backend="tensorrt",
                                              kv_cache_dtype="int8"))
    check_build_config(model, BuildConfig(max_seq_len=128, max_input_len=64, kv_cache_dtype="int8"))


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_cli_build_calibrates_and_reports(tiny, tmp_path, kv):
    """`engine build --kv-cache-dtype int8|fp8` with the default calibration (64 sampled sequences of up to 256
    tokens) and the accuracy report against the float32-KV engine; `engine run` then generates from the pool."""
    out = tmp_path / "e"
    r = subprocess.run(ENGINE + ["build", "--checkpoint-dir", str(tiny.checkpoint("LlamaForCausalLM")),
                                 "--output-dir", str(out), "--kv-cache-dtype", kv, "--max-seq-len", "128",
                                 "--eval-tokens", "128", "--max-ppl-increase", "5", "--no-progress"],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert f"accuracy ({kv} KV cache): perplexity" in " ".join(r.stdout.split())
    q = load_engine_config(out).quantization
    assert q.kv_cache["sequences"] == 64 and q.accuracy["ppl_increase_pct"] <= 5
    r = subprocess.run(ENGINE + ["run", "--engine-dir", str(out), "--max-kv-tokens", "512", "--input-text",
                                 "The capital of France", "--max-output-len", "8"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
