"""The quantization modes `engine build --dtype` accepts (TensorRT-LLM / ModelOpt names), and their defaults.

    int8_wo    W8A16 weight-only, RTN, one scale per group of input features (per-channel where ORT allows)
    int4_wo    W4A16 weight-only, RTN, group-wise (16..256; default 32); a checkpoint whose layers are already
               4-bit blocks of 32 (a GGUF Q4_1 source) keeps them exactly (weight_only.block_grid), no RTN
    int8_sq    W8A8 SmoothQuant: per-channel int8 weights, int8 activations (dynamic, per token); ModelOpt-calibrated
    fp8        E4M3 weights and activations, per-tensor scales (static activation scale); ModelOpt-calibrated
    int4_awq   W4A16 AWQ: int4 weights per group (default 128, as ModelOpt; the largest that fits below it); a
               checkpoint already in 4-bit blocks of 32 keeps them as int4_wo does (group 32; AWQ on lm_head only)
    gguf       the weights a GGUF checkpoint keeps as blocks (engine convert --gguf) run exactly as the file stores
               them, each in its own kind (Q4_K, Q6_K, Q5_0, Q8_0, ...: plugins/gguf_tiles.py), activations rounded
               to int8 per block of 32 as llama.cpp rounds them; the rest float32
    w4a8_awq, nvfp4    named, refused until implemented
The KV cache's dtype is a separate build flag (--kv-cache-dtype, quantization/kv_cache.py), combinable with any mode.
Calibrated modes (quantization/modelopt_calibration.py) calibrate the whole model once; a tp > 1 build shards the
scales with the weights (quantization/calibrated_weights.shard_calibrated); int8_sq's per-token activation scale
takes the max over the ranks (core/engine_format.segment_reduces).

Group size of int8_wo: 32, or the largest supported group below it that divides every quantized weight's in
features. TensorRT-LLM's int8_wo is per-channel (one scale per output row); MatMulNBits takes block sizes 16..256
only (a power of two), and at accuracy level 4 it also rounds the activations to int8 in blocks of that size, so
the group sets both roundings. SmolLM2 on an AVX-512 VNNI CPU, perplexity on the build's sampled text: group 64
(the largest that divides 576 and 1536, the earlier default) +0.99 to +1.11% depending on the attention kernel's
last-bit rounding (over issue #5's 1%), group 32 +0.50%, group 16 +0.37%; group 32 costs ~4% of decode speed and
~9% of prefill against 64 (bench/NOTES.md 25).

accuracy_level (MatMulNBits: 0/1 = fp32 compute, true W8A16/W4A16; 4 = activations quantized to int8 per
block, int8 dot products). Measured on this CPU (2 threads, a busy machine: medians of interleaved runs):
  one [576 x 1536] projection, 1 token: fp32 MatMul 0.55 ms; int4 level 0 ~1.0 ms, level 4 ~0.35 ms;
  int8 level 0 ~5-7 ms (MLAS has no fast 8-bit kernel for fp32 activations), level 4 ~0.4 ms; at 512 tokens
  level 4 is ~1.5x slower than level 0.
  SmolLM2-135M, decode at batch 1 relative to fp32: int8 level 4 1.4x, level 0 0.15x; int4 level 4 1.6x,
  level 0 0.85x. Perplexity (GPL-3 text; fp32 24.93): int8 level 4 25.13 (+0.8%), level 0 25.03 (+0.4%);
  int4 group 32 level 4 30.94, level 0 30.86 (+24%: RTN moved this checkpoint's Q4_1 blocks; int4_wo now keeps
  them, weight_only.block_grid: +0.41% on the build's sampled text, where RTN measured +58%).
Level 0 makes the weight-only engines slower at decode than fp32, which defeats them; level 4 is the default
(as onnxruntime-genai's CPU int4 default), and the build's accuracy report measures what its activation
rounding costs. `--quant-accuracy-level 0` gives true weight-only arithmetic.
"""
from __future__ import annotations

from dataclasses import replace

from engine.core.errors import EngineError
from engine.core.model_config import DTYPES, ModelConfig, QuantConfig, parse_dtype
from engine.plugins import bf16_matmul

from .calibrated_weights import CALIBRATED
from .weight_only import BITS, GROUP_SIZES, check_group_size

WEIGHT_ONLY = tuple(BITS)
GGUF = "gguf"
IMPLEMENTED = WEIGHT_ONLY + CALIBRATED + (GGUF,)
PLANNED = ("w4a8_awq", "nvfp4")
# int4_wo: 32, GGUF's Q4 block; a float32 scale per 32 weights (1/8 byte each) keeps the int4 engine under
# 0.18x the fp32 one. int8_wo: the largest group up to INT8_WO_MAX_GROUP_SIZE that fits (see above).
DEFAULT_GROUP_SIZE = {"int4_wo": 32}
INT8_WO_MAX_GROUP_SIZE = 32
AWQ_MAX_GROUP_SIZE = 128  # ModelOpt's INT4_AWQ_CFG block size
ACCURACY_LEVELS = (0, 1, 4)
DEFAULT_ACCURACY_LEVEL = 4
LM_HEAD_DTYPES = ("float32", "bfloat16", "int8")
INT8_HEAD_GROUP = 32   # an int8 lm_head's blocks: llama.cpp's Q8_0 (weight_only.quantize_q8_0)
# the blockers' message for --lm-head-dtype bfloat16 / int8 beside --quantize-lm-head
_BOTH_HEAD_FLAGS = " and --quantize-lm-head both set lm_head's precision; pass one of them"


def split_dtype(name: str) -> tuple[str, str | None]:
    """`--dtype` value -> (compute dtype, quantization mode or None). Weight-only modes compute in float32."""
    if name in IMPLEMENTED:
        return "float32", name
    if name in PLANNED:
        raise EngineError(f"--dtype {name} is not implemented yet; implemented quantized modes: "
                          f"{', '.join(IMPLEMENTED)}", usage=True)
    try:
        return parse_dtype(name), None
    except EngineError:
        raise EngineError(f"--dtype {name!r} is unknown; use one of auto, {', '.join(DTYPES)} or a quantized "
                          f"mode: {', '.join(IMPLEMENTED)}", usage=True) from None


def quantized_in_features(model: ModelConfig, tp: int, quantize_lm_head: bool, ep: int = 1) -> dict[str, int]:
    """In features of every quantized projection of one rank (row-parallel ones are split by tp; an expert's by
    tp / ep, --moe-ep-size ep)."""
    ks = {"attention.qkv": model.hidden_size, "attention.dense": model.q_size // tp}
    if not all(model.is_moe_layer(i) for i in range(model.num_layers)):   # Mixtral has no dense MLP
        ks.update({"mlp.gate_up": model.hidden_size, "mlp.down": model.intermediate_size // tp})
    if model.moe is not None:   # each expert's projections (and the shared expert's) quantized as a dense MLP's
        ks.update({"moe.experts.gate_up": model.hidden_size,
                   "moe.experts.down": model.moe.intermediate_size // (tp // ep)})
        if model.moe.shared_intermediate_size:
            ks.update({"moe.shared.gate_up": model.hidden_size,
                       "moe.shared.down": model.moe.shared_intermediate_size // tp})
    if quantize_lm_head:
        ks["lm_head"] = model.hidden_size
    return ks


def resolve(quant: QuantConfig, model: ModelConfig, tp: int, ep: int = 1) -> QuantConfig:
    """Fill in the defaults of a weight-only QuantConfig (group size, accuracy level) and check them against the
    model (split tp ways, its experts with --moe-ep-size `ep`); an unquantized config is returned as is."""
    if quant.mode is None:
        return quant
    split_dtype(quant.mode)  # raises the "not implemented yet" / "unknown" message
    if model.moe is not None and quant.mode == GGUF:
        # the MoE kernel reads QuantMatMul's int8 / int4 blocks, not GGUF's kinds (docs/moe.md, GGUF input)
        raise EngineError(f"--dtype gguf is not supported for mixture-of-experts models ({model.architecture}): the "
                          "experts of a GGUF file are dequantized at convert (3-D tensors are not kept as blocks); "
                          "build with --dtype int4_wo (re-quantized in blocks of 32), int8_wo or float32", usage=True)
    if model.moe is not None and quant.mode not in WEIGHT_ONLY:
        raise EngineError(f"--dtype {quant.mode} is not supported for mixture-of-experts models yet "
                          f"({model.architecture}); use {' or '.join(WEIGHT_ONLY)}, or float32", usage=True)
    if quant.mode in CALIBRATED:
        return _resolve_calibrated(quant, model, tp)
    if quant.mode == GGUF:
        return _resolve_gguf(quant, tp)
    level = DEFAULT_ACCURACY_LEVEL if quant.accuracy_level is None else quant.accuracy_level
    if level not in ACCURACY_LEVELS:
        raise EngineError(f"--quant-accuracy-level {level} is not one of {', '.join(map(str, ACCURACY_LEVELS))}",
                          usage=True)
    ks = quantized_in_features(model, tp, quant.quantize_lm_head, ep)
    group = quant.group_size or DEFAULT_GROUP_SIZE.get(quant.mode)
    if group is None:
        fitting = [s for s in GROUP_SIZES if s <= INT8_WO_MAX_GROUP_SIZE and all(k % s == 0 for k in ks.values())]
        if not fitting:
            raise EngineError(f"no supported group size ({', '.join(map(str, GROUP_SIZES))}) divides the in "
                              f"features {sorted(set(ks.values()))} of this model; it cannot be quantized with "
                              f"{quant.mode}")
        group = fitting[-1]
    for what, k in ks.items():
        check_group_size(group, k, f"{what} (tp {tp})" if tp > 1 else what)
    return replace(quant, group_size=group, accuracy_level=level)


def _resolve_gguf(quant: QuantConfig, tp: int) -> QuantConfig:
    """gguf keeps the file's own blocks: no group size, lm_head flag or accuracy level of its own to choose (the
    activations are int8 per block, level 4's rounding)."""
    for flag, value in (("--group-size", quant.group_size), ("--quantize-lm-head", quant.quantize_lm_head or None)):
        if value is not None:
            raise EngineError(f"{flag} does not apply to --dtype gguf, which keeps every weight as the GGUF file "
                              "quantized it; leave it out", usage=True)
    if quant.accuracy_level not in (None, DEFAULT_ACCURACY_LEVEL):
        raise EngineError(f"--quant-accuracy-level {quant.accuracy_level}: --dtype gguf rounds activations to int8 "
                          f"per block (level {DEFAULT_ACCURACY_LEVEL}), as llama.cpp does; leave it out", usage=True)
    if tp != 1:
        raise EngineError(f"--dtype gguf builds tp 1 engines for now (--tp {tp}); build --tp 1, or a weight-only "
                          f"--dtype ({' or '.join(WEIGHT_ONLY)}) for tp {tp}", usage=True)
    return replace(quant, accuracy_level=DEFAULT_ACCURACY_LEVEL)


def _resolve_calibrated(quant: QuantConfig, model: ModelConfig, tp: int) -> QuantConfig:
    """int8_sq / fp8 take no group size nor accuracy level; int4_awq takes both (MatMulNBits runs it)."""
    if quant.mode != "int4_awq":
        for flag, value in (("--group-size", quant.group_size), ("--quant-accuracy-level", quant.accuracy_level)):
            if value is not None:
                raise EngineError(f"{flag} applies to weight-only and int4_awq builds, not --dtype {quant.mode}; "
                                  "leave it out", usage=True)
        return quant
    level = DEFAULT_ACCURACY_LEVEL if quant.accuracy_level is None else quant.accuracy_level
    if level not in ACCURACY_LEVELS:
        raise EngineError(f"--quant-accuracy-level {level} is not one of {', '.join(map(str, ACCURACY_LEVELS))}",
                          usage=True)
    ks = quantized_in_features(model, tp, quant.quantize_lm_head)
    group = quant.group_size
    if group is None:
        fitting = [s for s in GROUP_SIZES if s <= AWQ_MAX_GROUP_SIZE and all(k % s == 0 for k in ks.values())]
        if not fitting:
            raise EngineError(f"no supported group size ({', '.join(map(str, GROUP_SIZES))}) divides the in "
                              f"features {sorted(set(ks.values()))} of this model; it cannot be quantized with "
                              "int4_awq")
        group = fitting[-1]
    for what, k in ks.items():
        check_group_size(group, k, f"{what} (tp {tp})" if tp > 1 else what)
    return replace(quant, group_size=group, accuracy_level=level)


def resolve_lm_head_dtype(quant: QuantConfig, model: ModelConfig, *, backend: str, kernels: bool) -> QuantConfig:
    """--lm-head-dtype: float32; bfloat16 as the engine's Bf16MatMul (plugins/bf16_matmul.py), which needs the
    engine's kernels on onnxruntime, lm_head's in features in whole chunks of 32 and a CPU with AVX-512 BF16; or int8
    in blocks of 32 on llama.cpp's Q8_0 rule (weight_only.quantize_q8_0), run as the layers' int8 projections are, for
    weight-only builds on onnxruntime. auto (the CLI's default), where each runs: int8 for int8_wo / int4_wo at
    accuracy level 4, whose layers already round their activations to int8 (llama.cpp keeps a quantized model's
    output tensor in Q8_0 or finer, onnxruntime-genai quantizes lm_head with the layers; a GGUF's Q8_0 table comes
    back exactly), bfloat16 for the calibrated modes, else float32. A quantized build's projections are already
    rounded, and a float32 lm_head was its largest read at a decode step (SmolLM2 int8_wo: 113 of ~230 MB a token);
    bfloat16 halves it, int8 quarters it, at no measured perplexity cost (bench/NOTES.md entries 32, 33).
    TensorRT-LLM keeps lm_head in the checkpoint's 16-bit dtype."""
    dtype = quant.lm_head_dtype
    if quant.mode == GGUF:   # lm_head stays what the file made it (blocks it keeps, else float32)
        if dtype not in ("auto", "float32"):
            raise EngineError(f"--lm-head-dtype {dtype} does not apply to --dtype gguf, which keeps lm_head as the "
                              "GGUF file stores it; leave it out", usage=True)
        return replace(quant, lm_head_dtype="float32")
    if dtype == "auto":
        level = DEFAULT_ACCURACY_LEVEL if quant.accuracy_level is None else quant.accuracy_level
        if level == 4 and _int8_head_blocker(quant, model, backend) is None:
            return replace(quant, lm_head_dtype="int8")
        runs = quant.mode is not None and _bf16_head_blocker(quant, model, backend, kernels) is None
        return replace(quant, lm_head_dtype="bfloat16" if runs else "float32")
    if dtype not in LM_HEAD_DTYPES:
        raise EngineError(f"--lm-head-dtype {dtype!r} is not one of auto, {', '.join(LM_HEAD_DTYPES)}", usage=True)
    blocker = (_bf16_head_blocker(quant, model, backend, kernels) if dtype == "bfloat16"
               else _int8_head_blocker(quant, model, backend) if dtype == "int8" else None)
    if blocker is not None:
        raise EngineError(f"--lm-head-dtype {dtype}{blocker}", usage=True)
    return quant


def head_quantization(quant: QuantConfig) -> tuple[int, int] | None:
    """(bits, group size) of a weight-only build's quantized lm_head (and the tied embedding that shares its table):
    the layers' with quantize_lm_head, int8 blocks of 32 with lm_head_dtype int8; None where lm_head is a float
    table. `quant` must be resolved."""
    if quant.lm_head_dtype == "int8":
        return 8, INT8_HEAD_GROUP
    if quant.quantize_lm_head and quant.mode in BITS:
        return BITS[quant.mode], quant.group_size
    return None


def _int8_head_blocker(quant: QuantConfig, model: ModelConfig, backend: str) -> str | None:
    """Why an int8 lm_head cannot be built here (the rest of the message after the flag), or None where it can."""
    if quant.quantize_lm_head:
        return _BOTH_HEAD_FLAGS
    if quant.mode not in WEIGHT_ONLY:
        return (f" is a weight-only lm_head and needs a weight-only --dtype ({' or '.join(WEIGHT_ONLY)}); this "
                f"build's is {quant.mode or 'float32'}: pass one, or --lm-head-dtype bfloat16 or float32")
    if backend != "onnxruntime":
        return (f" is built for onnxruntime; this build's backend is {backend}: use --quantize-lm-head for a "
                "quantized lm_head there, or leave it out")
    if model.hidden_size % INT8_HEAD_GROUP:
        return (f" needs lm_head's in features (hidden_size {model.hidden_size}) to be a multiple of "
                f"{INT8_HEAD_GROUP}; use --lm-head-dtype float32 for this model")
    return None


def _bf16_head_blocker(quant: QuantConfig, model: ModelConfig, backend: str, kernels: bool) -> str | None:
    """Why a bfloat16 lm_head cannot be built here (the rest of the message after the flag), or None where it can:
    auto takes it exactly where this is None."""
    if quant.quantize_lm_head:
        return _BOTH_HEAD_FLAGS
    if backend != "onnxruntime":
        return (f" is the engine's own onnxruntime kernel (Bf16MatMul); this build's backend is {backend}: build "
                "with --backend onnxruntime, or leave it out")
    if not kernels:
        return " runs as one of the engine's own kernels; it needs --engine-kernels-plugin enable"
    if model.hidden_size % bf16_matmul.CHUNK:
        return (f" needs lm_head's in features (hidden_size {model.hidden_size}) to be a multiple of "
                f"{bf16_matmul.CHUNK}; keep lm_head float32 for this model")
    if not bf16_matmul.supported(model.hidden_size):
        return (": this CPU has no AVX-512 BF16 dot products (flags: avx512_bf16, avx512bw), which the kernel is "
                "written for; keep lm_head float32 here")
    return None
