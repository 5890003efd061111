"""KV cache dtypes (`engine build --kv-cache-dtype float16|int8|fp8`): which exist, and the calibrated scales of
the quantized ones, int8 and fp8 (float16 pools hold the values rounded, with no scales).

    calibration tokens (calibrate.calibration_tokens: --calib-data, or text the float reference engine samples)
        ──▶ CanonicalLM (torch_model.py) forward with a cache list: K after rotary (and q/k norms), V, per layer
        ──▶ absmax per layer and KV head over every calibration token          [num_layers, num_kv_heads], K and V
        ──▶ scale = absmax / 127 (int8, symmetric, zero point 0) or absmax / 448 (fp8: e4m3's largest value)
    config.json quantization.kv_cache: {dtype, granularity, method, data, k_scale, v_scale}   (the record)
    graph: layers.{i}.attention.kv_cache.{k,v}_scaling_factor, float32 [kv_heads_per_rank * head_dim], the rank's
        heads each repeated over head_dim, so QuantizeLinear / DequantizeLinear take them per axis (plugins/attention.py)

Why absmax from the torch twin and not ModelOpt's KV quantizer: ModelOpt attaches its k/v bmm quantizers to the
attention modules of Hugging Face classes it recognizes (and patches their forward); our canonical twin's attention is
not one of them. Its KV configs calibrate with the "max" calibrator, i.e. absmax over the calibration data, which is
what is computed here, per KV head instead of per tensor (one outlier head no longer coarsens all the others).

fp8 (float8 e4m3fn) pools hold the codes as uint8: onnxruntime 1.32's ScatterND and Gather accept no float8 tensor and
it implements no BitCast, so the graph encodes and decodes them itself (plugins/e4m3.py; bench/NOTES.md entry 21).
Knows neither ONNX nor the runtime.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np

from engine.core.errors import EngineError
from engine.core.model_config import ModelConfig

from .modelopt_calibration import CalibrationOptions, Sampler

KV_CACHE_DTYPES = ("float32", "float16", "int8", "fp8")   # the names --kv-cache-dtype knows
QUANTIZED = ("int8", "fp8")   # with calibrated scales; float16 pools store the values rounded, no scales
BYTES = {"float32": 4, "float16": 2, "int8": 1, "fp8": 1}
RANGE = {"int8": 127.0, "fp8": 448.0}          # the absmax a scale maps to
MIN_AMAX = 1e-6  # a head that stayed 0 over calibration keeps a finite scale (its values then saturate, never NaN)
# default calibration data of a KV cache alone (a calibrated --dtype uses its own, larger, default): absmax needs far
# fewer tokens than ModelOpt's weight calibration. SmolLM2: 16 x 256 sampled tokens already give +0.20% perplexity.
KV_CALIBRATION = CalibrationOptions(size=64, max_seq_len=256)
METHOD = "absmax of K (after rotary) and V per layer and KV head over the calibration tokens, torch twin"


def resolve_kv_cache_dtype(name: str, mode: str | None, backend: str) -> str:
    """--kv-cache-dtype after `auto` (the CLI's default): float16 for a quantized --dtype `mode` on onnxruntime,
    float32 otherwise. A quantized engine's weights are already rounded far coarser than float16 rounds K and V,
    and its decode step is then bound by the attention's reads of the pools: float16 halves them (SmolLM2 int8_wo
    decode after a 512-token prompt 1.13-1.23x, int4_wo 1.14-1.27x, perplexity +0.18% / +0.01% against +0.21% /
    -0.04% with float32 pools; bench/NOTES.md entry 32), as llama.cpp's f16 default and TensorRT-LLM's 16-bit KV
    cache do. A float32 build keeps float32 pools (the dtype it was asked for)."""
    if name != "auto":
        return name
    return "float16" if mode is not None and backend == "onnxruntime" else "float32"


def check_kv_cache_dtype(name: str, backend: str) -> None:
    """Refuse a KV dtype this backend cannot run, naming what can."""
    if name not in KV_CACHE_DTYPES:
        raise EngineError(f"--kv-cache-dtype {name!r} is unknown; use {', '.join(KV_CACHE_DTYPES)}", usage=True)
    if name != "float32" and backend == "tensorrt":
        raise EngineError(f"--kv-cache-dtype {name} is built for --backend onnxruntime only (the TensorRT engine "
                          f"ping-pongs float32 pools; {name} ones could not be verified without a GPU); pass "
                          "--backend onnxruntime or --kv-cache-dtype float32", usage=True)


def kv_absmax(lm, model: ModelConfig, batches: list[list[list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """Absmax of K (as the pool stores it: after norms and rotary) and of V, [num_layers, num_kv_heads] each, over
    every token of `batches` (runs of equal-length sequences) through `lm`, the CanonicalLM of the float checkpoint."""
    import torch

    k_max = np.zeros((model.num_layers, model.num_kv_heads), np.float32)
    v_max = np.zeros_like(k_max)
    from .torch_model import KVCache

    with torch.no_grad():
        for batch in batches:
            cache = KVCache(model, len(batch), len(batch[0]))
            lm(torch.tensor(batch), start=0, cache=cache)
            for i in range(model.num_layers):   # [B, L, kv_heads, hd]
                k_max[i] = np.maximum(k_max[i], cache.k[i].abs().amax(dim=(0, 1, 3)).numpy())
                v_max[i] = np.maximum(v_max[i], cache.v[i].abs().amax(dim=(0, 1, 3)).numpy())
    return k_max, v_max


def calibrate_kv_scales(model: ModelConfig, tensors: Mapping[str, np.ndarray], dtype: str, opts: CalibrationOptions,
                        tokenizer_dir: Path, start_token: int | None, max_positions: int, sample: Sampler) -> dict:
    """The config.json record of the KV scales (see the module docstring); `sample` as calibrate.calibration_tokens."""
    assert dtype in QUANTIZED, dtype
    from .modelopt_calibration import _batches, calibration_tokens
    from .torch_model import CanonicalLM

    lm = CanonicalLM(model, tensors, max_positions).eval()
    seqs, source = calibration_tokens(opts, tokenizer_dir, start_token if start_token is not None else 0,
                                      max_positions, sample)
    seqs = [s[:max_positions] for s in seqs]
    k_max, v_max = kv_absmax(lm, model, _batches(seqs, opts.batch_size))
    scale = lambda amax: (np.maximum(amax, MIN_AMAX) / RANGE[dtype]).astype(np.float32).tolist()  # noqa: E731
    return {"dtype": dtype, "granularity": "per KV head", "method": METHOD, "data": source, "sequences": len(seqs),
            "tokens": sum(len(s) for s in seqs), "k_scale": scale(k_max), "v_scale": scale(v_max)}


def rank_heads(model: ModelConfig, tp: int, rank: int) -> list[int]:
    """The KV heads rank `rank` holds (core/sharding.py: a slice, or one replicated head when tp > kv heads)."""
    if model.num_kv_heads >= tp:
        n = model.num_kv_heads // tp
        return list(range(rank * n, (rank + 1) * n))
    return [rank * model.num_kv_heads // tp]


def layer_scales(record: dict, model: ModelConfig, layer: int, tp: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V scales of one layer on one rank, float32 [kv_heads_per_rank * head_dim] (per axis of the pool row)."""
    heads = rank_heads(model, tp, rank)
    k, v = (np.repeat(np.asarray(record[key][layer], np.float32)[heads], model.head_dim)
            for key in ("k_scale", "v_scale"))
    return k, v


def describe(record: dict) -> str:
    """One line for config.json's precision table and `engine inspect`."""
    kind = "fp8 e4m3 (uint8 codes, emulated: converted in float32 on the CPU)" if record["dtype"] == "fp8" \
        else f"{record['dtype']} symmetric"
    return (f"{kind}, float32 scales {record['granularity']} ({record['method']}; "
            f"{record['tokens']} tokens, {record['data']})")
