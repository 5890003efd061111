"""The TensorRT builder settings derived from the build flags, as plain functions (no TensorRT needed): sizes,
the optimization profile against the real graph inputs and real step inputs, backend choice, the graph flavour,
and the device stamp check that refuses an engine built elsewhere."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from engine.builder.tensorrt_backend import (TensorRTOptions, builder_settings, check_options,
                                             choose_backend, dim_ranges, graph_input_dims, max_slots, parse_size,
                                             profile_shapes, tensorrt_plugins)
from engine.core.engine_format import BuildConfig, PluginConfig, engine_file
from engine.core.errors import EngineError
from engine.runtime.step_inputs import SeqChunk, make_step_inputs
from engine.runtime.trt_session import DeviceStamp, check_device
from tests.tensorrt.conftest import TRT_FLAVOUR_BUILD


@pytest.mark.parametrize("text, expected", [("1024", 1024), ("512MiB", 512 << 20), ("4GiB", 4 << 30),
                                            ("4G", 4 << 30), ("64 kib", 64 << 10), ("7B", 7)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "0", "-1", "4TB", "1.5GiB", "GiB", "4 GiB extra"])
def test_parse_size_refuses(text):
    with pytest.raises(EngineError, match="--workspace-size") as info:
        parse_size(text)
    assert info.value.usage


def test_timing_cache_paths(tmp_path):
    with pytest.raises(EngineError, match="--input-timing-cache .*not a file"):
        check_options(TensorRTOptions(input_timing_cache=tmp_path / "missing.cache"))
    with pytest.raises(EngineError, match="--output-timing-cache .*directory does not exist"):
        check_options(TensorRTOptions(output_timing_cache=tmp_path / "no" / "such" / "dir.cache"))
    (tmp_path / "in.cache").write_bytes(b"cache")
    opts = TensorRTOptions(workspace_size=1 << 30, input_timing_cache=tmp_path / "in.cache",
                           output_timing_cache=tmp_path / "out.cache")
    settings = builder_settings({"input_ids": ("T",)}, BuildConfig(), opts)
    assert settings.workspace_bytes == 1 << 30
    assert (settings.input_timing_cache, settings.output_timing_cache) == (opts.input_timing_cache,
                                                                          opts.output_timing_cache)


def test_dim_ranges_follow_the_limits():
    build = BuildConfig(max_batch_size=16, max_input_len=300, max_seq_len=1000, max_num_tokens=512,
                        tokens_per_block=32)
    r = dim_ranges(build)
    assert r["T"] == (1, 16, 512)
    assert r["B"] == (1, 16, 16)
    assert r["Qmax"] == (1, 1, 512)
    assert r["Lmax"] == (1, 300, 1000)
    assert r["S"] == (0, 16, 16)
    # 1000 tokens need 32 blocks of 32: 16 sequences * 1024 slots
    assert max_slots(build) == 16 * 1024
    assert r["num_slots"] == (32, 16 * 1024, 16 * 1024)
    for lo, opt, hi in r.values():
        assert lo <= opt <= hi


@pytest.mark.parametrize("key", ["LlamaForCausalLM", "Gemma2ForCausalLM"])
def test_profile_covers_every_graph_input_and_every_step(tiny, key):
    """Every input of the real TensorRT-flavour graph gets a range of its rank, and the inputs of the largest
    steps the engine admits (a full batch of decodes at max_seq_len; one prefill chunk of max_num_tokens; all
    prefills with no logits wanted) lie inside it."""
    build = TRT_FLAVOUR_BUILD
    model = onnx.load(str(tiny.trt_flavour(key) / engine_file(0)), load_external_data=False)
    dims = graph_input_dims(model)
    profile = {r.name: r for r in profile_shapes(dims, build)}
    assert set(profile) == set(dims)
    for name, r in profile.items():
        assert len(r.min) == len(r.opt) == len(r.max) == len(dims[name]), name
        assert all(a <= b <= c for a, b, c in zip(r.min, r.opt, r.max)), name
    tpb, seq = build.tokens_per_block, build.max_seq_len
    per_seq = -(-seq // tpb)
    full_decode = [SeqChunk([5], seq - 1, list(range(b * per_seq, (b + 1) * per_seq)), True)
                   for b in range(build.max_batch_size)]
    one_chunk = [SeqChunk([5] * min(build.max_num_tokens, seq), 0, list(range(per_seq)), True)]
    no_logits = [SeqChunk([5] * 3, 0, [b], False) for b in range(build.max_batch_size)]
    sliding = 8 if "attn_mask_sliding" in dims else None
    for chunks in (full_decode, one_chunk, no_logits):
        inputs = make_step_inputs(chunks, tpb, sliding)
        inputs.update({name: np.zeros((max_slots(build), dims[name][1]), np.float32)
                       for name in dims if "cache" in name})
        assert set(inputs) == set(dims)
        for name, array in inputs.items():
            r = profile[name]
            assert all(lo <= n <= hi for lo, n, hi in zip(r.min, array.shape, r.max)), (name, array.shape, r)


def test_auto_and_explicit_backend_choice():
    assert choose_backend("auto", None) == "tensorrt"
    assert choose_backend("auto", "no CUDA GPU is visible") == "onnxruntime"
    assert choose_backend("onnxruntime", "the `tensorrt` package is not installed") == "onnxruntime"
    assert choose_backend("tensorrt", None) == "tensorrt"
    with pytest.raises(EngineError) as info:
        choose_backend("tensorrt", "no CUDA GPU is visible")
    message = str(info.value)
    assert "no CUDA GPU is visible" in message and "engine[tensorrt]" in message and "NVIDIA GPU" in message
    assert info.value.usage
    with pytest.raises(EngineError, match="--backend 'tvm' is unknown"):
        choose_backend("tvm", None)


def test_resolve_backend_here():
    """This machine has no TensorRT: auto is onnxruntime, an explicit tensorrt says why not."""
    from engine.builder.tensorrt_backend import resolve_backend, tensorrt_unavailable
    why = tensorrt_unavailable()
    if why is None:
        pytest.skip("TensorRT and a CUDA GPU are available here")
    assert resolve_backend("auto") == "onnxruntime"
    with pytest.raises(EngineError, match="tensorrt"):
        resolve_backend("tensorrt")


def test_tensorrt_flavour_plugins():
    flavour = tensorrt_plugins(PluginConfig())
    assert not (flavour.gpt_attention_plugin or flavour.rmsnorm_plugin or flavour.rotary_plugin
                or flavour.weight_only_quant_matmul_plugin)
    assert flavour.gemm_swiglu_plugin
    assert not tensorrt_plugins(PluginConfig(gemm_swiglu_plugin=False)).gemm_swiglu_plugin


def test_device_stamp_mismatch_says_rebuild(tmp_path):
    stamp = DeviceStamp(tensorrt_version="10.13.3", compute_capability="9.0", device_name="NVIDIA H200")
    check_device(stamp, "10.13.3", "9.0", "NVIDIA H200", tmp_path)
    with pytest.raises(EngineError, match=r"built with TensorRT 10\.13\.3 but TensorRT 11\.4\.0 .*rebuild"):
        check_device(stamp, "11.4.0", "9.0", "NVIDIA H200", tmp_path)
    with pytest.raises(EngineError, match=r"compute capability 9\.0 \(NVIDIA H200\).*has 8\.9.*rebuild"):
        check_device(stamp, "10.13.3", "8.9", "NVIDIA L4", tmp_path)


def test_auto_picks_onnxruntime_for_what_tensorrt_cannot_build(monkeypatch):
    """Where TensorRT and a GPU are there (simulated: the availability probe says so), `auto` still picks
    onnxruntime for int8_sq and a quantized KV cache; an explicit tensorrt is left to the build's refusal."""
    from engine.builder import tensorrt_backend
    from engine.builder.tensorrt_backend import resolve_backend
    monkeypatch.setattr(tensorrt_backend, "tensorrt_unavailable", lambda: None)
    assert resolve_backend("auto") == resolve_backend("auto", "fp8") == resolve_backend("auto", "int4_awq") == "tensorrt"
    assert resolve_backend("auto", "int8_sq") == resolve_backend("auto", None, "int8") == "onnxruntime"
    assert resolve_backend("tensorrt", "int8_sq") == "tensorrt"
    assert resolve_backend("onnxruntime") == "onnxruntime"


def test_config_records_the_gpu(tiny):
    """config.json's backend_version and backend_device are the DeviceStamp loading checks; an engine recording no
    GPU is refused with the rebuild command."""
    import dataclasses

    from engine.runtime.engine_dir import load_engine_config
    from engine.runtime.trt_session import stamp_of
    engine_dir = tiny.trt_flavour("LlamaForCausalLM")
    config = load_engine_config(engine_dir)
    with pytest.raises(EngineError, match=r"does not record the GPU .*engine build .*--backend tensorrt"):
        stamp_of(config, engine_dir)
    stamp = DeviceStamp(tensorrt_version="11.4.0", compute_capability="9.0", device_name="NVIDIA H200", max_slots=512)
    recorded = dataclasses.replace(config, backend_version="11.4.0", backend_device=stamp.record())
    assert stamp_of(recorded, engine_dir) == stamp
