"""`engine build`: a checkpoint directory + BuildConfig -> an engine directory.

    check_build_config(model, BuildConfig)            every limit checked once, messages name the values
    for each rank (rank_job.py; in worker processes with --workers > 1):
        rank tensors (rank_tensors.py: lazy from rank{N}.safetensors, or resharded from a checkpoint of another tp)
        -> model_graph.build_graph -> rank{N}.raw.onnx -> ORT optimizes -> rank{N}.onnx + rank{N}.onnx.data
    tokenizer files, then config.json (EngineConfig) with its manifest: size and sha256 of every other file, the
    checkpoint's and the source's digests        all inside a temporary sibling, renamed when complete
    quantized (QuantConfig.mode): the projections are quantized while the graph is built (RTN at build, from the
        float checkpoint; int8_sq / fp8 / int4_awq are first calibrated with ModelOpt on a torch model of the checkpoint,
        quantization/modelopt_calibration.py); then an unquantized reference engine is built in a second temporary
        sibling, both are scored on held-out tokens (quantization/accuracy.py), the report goes into config.json, and
        --max-ppl-increase can fail the build before anything is renamed into place
"""
from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Callable

from engine.core.artifacts import (CheckpointConfig, atomic_output_dir, copy_tokenizer_files,
                                   load_checkpoint_config, save_config, save_sealed, verify_checkpoint)
from engine.core.model_config import DTYPES, Mapping, ModelConfig, QuantConfig
from engine.core.engine_format import BuildConfig, EngineConfig, PluginConfig, engine_file
from engine.core.errors import EngineError
from engine.core.parallel import check_expert_parallel, check_tp
from engine.plugins import native, quant_matmul
from engine.quantization import modes
from engine.quantization.accuracy import AccuracyOptions, check_gate
from engine.quantization.gguf_tensor import dequantized_note
from engine.quantization import calibrated_weights as calib
from engine.quantization import calibration_cache
from engine.quantization import kv_cache
from engine.quantization.modelopt_calibration import CalibrationOptions, calibrate
from engine.quantization.weight_only import BITS, block_grid
from engine.runtime.engine_dir import backend_version, toolchain_version
from engine.runtime.trt_session import import_tensorrt

from . import onnxruntime_backend as ortb
from . import tensorrt_backend as trtb
from . import tensorrt_collectives as trtc
from . import tensorrt_quant as trtq
from .lora_layers import check_lora_build
from .memory import memory_plan, runs_quant_matmul
from .rank_job import RankJob, build_rank
from .rank_tensors import rank_tensors
from .reference import ReferenceEngine

BACKENDS = ("auto", "onnxruntime", "tensorrt")


def check_build_config(model: ModelConfig, b: BuildConfig) -> None:
    """Refuse impossible or unsupported limits with a message naming the flag and its value."""
    for flag, value in (("--max-batch-size", b.max_batch_size), ("--max-input-len", b.max_input_len),
                        ("--max-seq-len", b.max_seq_len), ("--max-num-tokens", b.max_num_tokens),
                        ("--tokens-per-block", b.tokens_per_block), ("--tp", b.tp_size)):
        if value < 1:
            raise EngineError(f"{flag} {value} must be at least 1", usage=True)
    if b.max_input_len > b.max_seq_len:
        raise EngineError(f"--max-input-len {b.max_input_len} exceeds --max-seq-len {b.max_seq_len}; a prompt "
                          "must leave room in the sequence: lower --max-input-len or raise --max-seq-len", usage=True)
    if b.max_seq_len > model.max_position_embeddings:
        raise EngineError(f"--max-seq-len {b.max_seq_len} exceeds the model's max_position_embeddings "
                          f"{model.max_position_embeddings}; use at most {model.max_position_embeddings}", usage=True)
    if b.tokens_per_block & (b.tokens_per_block - 1):
        raise EngineError(f"--tokens-per-block {b.tokens_per_block} is not a power of two; use e.g. 16, 32 or 64",
                          usage=True)
    if b.max_num_tokens < b.max_batch_size:
        raise EngineError(f"--max-num-tokens {b.max_num_tokens} is below --max-batch-size {b.max_batch_size}: a "
                          "decode step of a full batch would not fit; raise --max-num-tokens", usage=True)
    if b.dtype not in DTYPES:
        hint = (f"; quantized modes are a QuantConfig(mode={b.dtype!r}) with a float32 compute dtype (the CLI's "
                f"--dtype {b.dtype} does this)" if b.dtype in modes.IMPLEMENTED + modes.PLANNED else "")
        raise EngineError(f"--dtype {b.dtype!r} is not a compute dtype; use one of {', '.join(DTYPES)}{hint}",
                          usage=True)
    kv_cache.check_kv_cache_dtype(b.kv_cache_dtype, b.backend)
    if b.opt_level not in ortb.OPT_LEVELS:
        raise EngineError(f"ORT optimization level {b.opt_level!r} is unknown; use one of "
                          f"{', '.join(ortb.OPT_LEVELS)}", usage=True)
    check_tp(model, b.tp_size)
    check_expert_parallel(model, b.tp_size, b.moe_ep_size)
    check_lora_build(model, b)


def precision_of(ckpt: CheckpointConfig, build: BuildConfig, quant: QuantConfig | None = None,
                 plugins: PluginConfig | None = None) -> dict:
    """What runs at which precision: the plugins lower float32 only, so float16/bfloat16 requests compute in
    float32 (ORT's CPU provider has no bfloat16 MatMul kernel at all)."""
    note = ("" if build.dtype == "float32" else
            f"--dtype {build.dtype} requested; the ONNX Runtime CPU lowerings compute in float32, so weights are "
            "stored and computed in float32")
    precision = {"checkpoint": ckpt.dtype, "weights": "float32", "activations": "float32",
                 "kv_cache": build.kv_cache_dtype, "logits": "float32", **({"note": note} if note else {})}
    tied = ckpt.model.tie_word_embeddings and build.tp_size == 1
    if quant is not None and quant.mode == modes.GGUF:
        kinds = sorted(set(quant.formats.values()))
        precision.update({
            "weights": f"the GGUF file's blocks kept exactly ({', '.join(kinds)}: {len(quant.formats)} tensors; "
                       "engine inspect lists them), the rest float32",
            "activations": "float32; int8 per block of 32 inside QuantMatMul (as llama.cpp's Q8 blocks)"})
        dequantized = dequantized_note(ckpt.source)
        if dequantized:
            precision["note"] = "; ".join(filter(None, [precision.get("note"), dequantized]))
    elif quant is not None and quant.mode in calib.CALIBRATED and not quant.source_grid:
        precision.update(calib.precision(quant.mode, quant.group_size, quant.accuracy_level, quant.quantize_lm_head))
    elif quant is not None and quant.mode is not None:   # weight-only, or int4_awq keeping the checkpoint's blocks
        bits = 4 if quant.source_grid else BITS[quant.mode]
        head = (f"int{bits}" + (" with AWQ" if quant.mode == "int4_awq" else "")) if quant.quantize_lm_head \
            else ("int8 (Q8_0 blocks of 32)" if quant.lm_head_dtype == "int8" else quant.lm_head_dtype)
        how = ("kept as the checkpoint's 4-bit blocks (GGUF Q4_1), float16 scales, float32 offsets"
               if quant.source_grid
               else "RTN, float32 scales") + ("; exact, so AWQ's search is not run on them"
                                              if quant.mode == "int4_awq" else "")
        precision.update({
            "weights": f"int{bits} weight-only ({quant.mode}, {how}, group {quant.group_size}) in "
                       f"the layers' projections; lm_head {head}; embeddings "
                       f"{head if tied else 'float32'}",
            "activations": "float32" if quant.accuracy_level in (0, 1) else _rounded_activations(quant, plugins)})
    if build.backend == "tensorrt" and quant is not None and quant.mode is not None:
        precision.update(trtq.tensorrt_precision(quant.mode))
    if quant is not None and quant.lm_head_dtype == "bfloat16":
        precision["lm_head"] = ("bfloat16 weights (the engine's Bf16MatMul), its input rounded to bfloat16, "
                                "products summed in float32" + ("; the tied embedding reads the same table"
                                                                 if tied else ""))
    elif quant is not None and quant.lm_head_dtype == "int8":
        precision["lm_head"] = ("int8 weights in blocks of 32 on llama.cpp's Q8_0 rule (scale max|w| / 127), its "
                                "input rounded as the layers' activations are" + ("; the tied embedding reads the "
                                                                                 "same table" if tied else ""))
    return precision


def _rounded_activations(quant: QuantConfig, plugins: PluginConfig | None) -> str:
    """The activations of weight-only projections at accuracy level 4: int8 per block in MatMulNBits or the engine's
    QuantMatMul, which on a CPU with AMX-BF16 (the engine's: it is built where it runs) rounds steps of many tokens
    to bfloat16 instead."""
    if not runs_quant_matmul(quant, plugins):
        return "float32; int8 per block inside MatMulNBits (accuracy_level 4)"
    bf16 = (f"; bfloat16 in steps of {quant_matmul.BF16_ROWS} tokens or more (this CPU has AMX-BF16)"
            if quant_matmul.has_bf16_tiles() else "")
    return f"float32; int8 per block inside QuantMatMul (accuracy_level 4){bf16}"


# ---- rank tensors -----------------------------------------------------------------------------------------

GRID_GROUP = 32   # the block of GGUF's Q4_0/Q4_1 formats
GRID_MODES = ("int4_wo", "int4_awq")


def _layers_on_block_grid(ckpt_dir: Path, ckpt: CheckpointConfig) -> bool:
    """Whether every projection of the layers (their 2-D tensors) holds 4-bit blocks of GRID_GROUP with a float
    offset, as a checkpoint converted from a GGUF Q4_1 file does: int4_wo / int4_awq then keep them exactly
    (quantization/weight_only.block_grid) instead of moving them onto an RTN or AWQ grid."""
    tensors = rank_tensors(ckpt_dir, ckpt, 1, 0)
    names = [n for n in tensors if n.startswith("layers.") and n.endswith(".weight")]
    for name in names:
        w = tensors[name]
        if w.ndim == 2 and block_grid(w, GRID_GROUP) is None:
            return False
    return bool(names)


def resolve_quant(requested: QuantConfig, ckpt_dir: Path, ckpt: CheckpointConfig, tp: int,
                  backend: str = "onnxruntime", kernels: bool = True, ep: int = 1) -> QuantConfig:
    """The requested QuantConfig with its defaults filled in (quantization.modes.resolve; on TensorRT first
    tensorrt_quant.tensorrt_quant). int4_wo and int4_awq at group 32 (asked for, or no group asked for) keep a
    checkpoint's 4-bit blocks when every layer holds them: they are exact, and neither RTN nor AWQ's scale search
    can come closer to the checkpoint than exact; int4_awq then calibrates lm_head only (with quantize_lm_head)."""
    if requested.mode == modes.GGUF:
        return _resolve_gguf(requested, ckpt_dir, ckpt, tp, backend, kernels)
    if backend == "tensorrt":
        requested = trtq.tensorrt_quant(requested, ckpt.model, tp)
    requested = modes.resolve_lm_head_dtype(requested, ckpt.model, backend=backend, kernels=kernels)
    quant = modes.resolve(requested, ckpt.model, tp, ep)
    if quant.mode not in GRID_MODES or requested.group_size not in (None, GRID_GROUP) or quant.source_grid:
        return quant
    if not _layers_on_block_grid(ckpt_dir, ckpt):
        return quant
    return dataclasses.replace(quant, group_size=GRID_GROUP, source_grid=True)


def _resolve_gguf(requested: QuantConfig, ckpt_dir: Path, ckpt: CheckpointConfig, tp: int, backend: str,
                  kernels: bool) -> QuantConfig:
    """--dtype gguf: the checkpoint's kept GGUF blocks, run on the engine's kernels (plugins/gguf_tiles.py)."""
    quant = modes.resolve(modes.resolve_lm_head_dtype(requested, ckpt.model, backend=backend, kernels=kernels),
                          ckpt.model, tp)
    if backend != "onnxruntime" or not kernels or not native.has_int8_dot():
        why = (f"the backend is {backend}" if backend != "onnxruntime" else
               "--engine-kernels-plugin is disabled" if not kernels else
               "this CPU has neither AVX-512 VNNI nor AVX2, which they are written for")
        raise EngineError(f"--dtype gguf runs the GGUF blocks on the engine's own onnxruntime kernels, and {why}; "
                          "build another --dtype (int4_wo, int8_wo, float32)", usage=True)
    formats = gguf_formats(ckpt_dir, ckpt)
    if not formats:
        raise EngineError(f"--dtype gguf keeps the quantized blocks of a checkpoint converted from a GGUF file "
                          f"(`engine convert --gguf FILE`, at --tp 1 and --dtype auto); {ckpt_dir} holds none: "
                          "convert the GGUF file so, or build another --dtype (int4_wo, int8_wo, float32)", usage=True)
    return dataclasses.replace(quant, formats=formats)


def gguf_formats(ckpt_dir: Path, ckpt: CheckpointConfig) -> dict[str, str]:
    """The checkpoint's tensors kept as GGUF blocks and their kinds (empty for a float checkpoint)."""
    if ckpt.mapping.tp_size != 1:
        return {}
    return rank_tensors(ckpt_dir, ckpt, 1, 0).gguf_kinds()


# ---- build ------------------------------------------------------------------------------------------------

def build_engine(ckpt_dir: Path, out_dir: Path, build: BuildConfig, plugins: PluginConfig, *,
                 force: bool = False, workers: int = 1, progress: Callable[[str], None] | None = None,
                 quant: QuantConfig | None = None, accuracy: AccuracyOptions | None = None,
                 trt: trtb.TensorRTOptions | None = None,
                 calibration: CalibrationOptions | None = None, build_flags: dict | None = None) -> EngineConfig:
    """Build every rank of the engine into `out_dir` (atomically) and return its config. `quant` with a mode
    quantizes at build; `accuracy` sets its report and gate (default: sampled held-out text, no gate);
    `build_flags` (the CLI's resolved flags) are recorded in config.json."""
    ckpt_dir = Path(ckpt_dir)
    ckpt = load_checkpoint_config(ckpt_dir)
    ckpt_digest = verify_checkpoint(ckpt_dir)  # hashes every file: a damaged checkpoint never becomes an engine
    accuracy = accuracy or AccuracyOptions()
    build, plugins, trt = _resolve_backend(ckpt, build, plugins, trt or trtb.TensorRTOptions(), quant, accuracy)
    if ckpt.quantization.mode is not None:
        raise EngineError(f"checkpoint {ckpt_dir} is quantized ({ckpt.quantization.mode}); engines are quantized at "
                          "build from a float checkpoint: convert without quantization and pass --dtype "
                          f"{ckpt.quantization.mode} to `engine build`")
    quant = resolve_quant(quant or QuantConfig(), ckpt_dir, ckpt, build.tp_size, build.backend,
                          plugins.engine_kernels_plugin, build.moe_ep_size)
    config = EngineConfig(
        model=ckpt.model, build=build, build_flags=dict(build_flags or {}), plugins=plugins,
        mapping=Mapping(world_size=build.tp_size, tp_size=build.tp_size, pp_size=1),
        quantization=quant, generation=ckpt.generation, memory=memory_plan(ckpt.model, build, quant, plugins),
        precision=precision_of(ckpt, build, quant, plugins), toolchain_version=toolchain_version(),
        backend_version=backend_version(build.backend))
    with atomic_output_dir(out_dir, force=force) as tmp, ReferenceEngine(ckpt_dir, config, tmp.parent) as reference:
        config, calibrated = _calibrate(ckpt_dir, ckpt, config, calibration, reference, ckpt_digest)
        jobs = [RankJob(ckpt_dir, tmp, r, build, plugins, config.quantization, trt, calibrated=calibrated)
                for r in range(build.tp_size)]
        _build_ranks(jobs, workers, progress)
        config = _record_placement(config, tmp)
        copy_tokenizer_files(ckpt_dir, tmp)
        # last: the manifest lists every other file (the accuracy report below changes config.json only)
        config = save_sealed(tmp, config, source_digest=ckpt.manifest.source_digest, checkpoint_digest=ckpt_digest)
        config = _score(config, tmp, accuracy, reference)
    return config


def _resolve_backend(ckpt: CheckpointConfig, build: BuildConfig, plugins: PluginConfig, trt: trtb.TensorRTOptions,
                     quant: QuantConfig | None, accuracy: AccuracyOptions
                     ) -> tuple[BuildConfig, PluginConfig, trtb.TensorRTOptions]:
    """The build, plugins and TensorRT options for the backend that `build.backend` (perhaps auto) resolves to,
    checked against the model."""
    mode = quant.mode if quant else None
    backend = trtb.resolve_backend(build.backend, mode, build.kv_cache_dtype)
    if ckpt.model.moe is not None and backend == "tensorrt":
        if build.backend == "tensorrt":   # auto picks onnxruntime: the MoE graph is not one TensorRT's parser takes
            raise EngineError(f"--backend tensorrt does not build mixture-of-experts models yet "
                              f"({ckpt.model.architecture}); use --backend onnxruntime", usage=True)
        backend = "onnxruntime"
    build = dataclasses.replace(build, backend=backend)
    check_build_config(ckpt.model, build)
    if build.backend != "tensorrt":
        return build, plugins, trt
    trtc.check_tensorrt_tp(import_tensorrt(), build.tp_size)
    trtb.check_options(trt)
    if mode is not None and accuracy.max_ppl_increase:
        raise EngineError("--max-ppl-increase is not supported with --backend tensorrt yet (the accuracy report "
                          "scores engines with onnxruntime); leave it out", usage=True)
    # TensorRT optimizes; no ORT level applies
    return dataclasses.replace(build, opt_level="disable"), trtb.tensorrt_plugins(plugins), trt


def _calibrate(ckpt_dir: Path, ckpt: CheckpointConfig, config: EngineConfig, calibration: CalibrationOptions | None,
               reference: ReferenceEngine, checkpoint_digest: str) -> tuple[EngineConfig, dict | None]:
    """Calibrate a calibrated --dtype (ModelOpt, quantization/modelopt_calibration.py; or reuse its --calib-cache
    entry, calibration_cache.py) and a quantized KV cache (K/V absmax, quantization/kv_cache.py), both on a torch model
    of the float checkpoint; returns the config that records them and the calibrated projections by canonical name
    (None when no mode is calibrated)."""
    quant, build = config.quantization, config.build
    kv_quantized = build.kv_cache_dtype in kv_cache.QUANTIZED
    if quant.mode not in calib.CALIBRATED and not kv_quantized:
        return config, None
    opts = calibration or CalibrationOptions()
    float_tensors = functools.cache(lambda: dict(rank_tensors(ckpt_dir, ckpt, 1, 0)))  # not read on a cache hit
    # the KV cache first: ModelOpt's smoothing (int8_sq) and AWQ scale the torch model's weights in place, and
    # they share memory with float_tensors
    if kv_quantized:
        record = kv_cache.calibrate_kv_scales(ckpt.model, float_tensors(), build.kv_cache_dtype,
                                              calibration or kv_cache.KV_CALIBRATION, ckpt_dir,
                                              ckpt.generation.bos_token_id, build.max_seq_len, reference.sample)
        quant = dataclasses.replace(quant, kv_cache_dtype=build.kv_cache_dtype, kv_cache=record)
        config = dataclasses.replace(config, quantization=quant,
                                     precision={**config.precision, "kv_cache": kv_cache.describe(record)})
    calibrated = None
    if quant.mode in calib.CALIBRATED:
        def run() -> tuple[dict, dict]:
            return calibrate(ckpt.model, float_tensors(), quant, opts, ckpt_dir, ckpt.generation.bos_token_id,
                             build.max_seq_len, reference.sample)
        if opts.cache is None:
            calibrated, record = run()
        else:
            entry = calibration_cache.key(
                checkpoint_digest, quant, opts, min(opts.max_seq_len, build.max_seq_len),
                {"engine": toolchain_version(), "plugins": dataclasses.asdict(config.plugins),
                 "opt_level": build.opt_level})
            calibrated, record = calibration_cache.cached(opts.cache, entry, run)
        quant = dataclasses.replace(quant, calibration=record)
        config = dataclasses.replace(config, quantization=quant)
    return config, calibrated


def _build_ranks(jobs: list[RankJob], workers: int, progress: Callable[[str], None] | None) -> None:
    """Build every rank, in `workers` worker processes when there are several ranks; `progress` hears of each."""
    if workers > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=get_context("spawn")) as pool:
            for rank in pool.map(build_rank, jobs):
                if progress:
                    progress(engine_file(rank, jobs[0].build.backend))
        return
    for job in jobs:
        build_rank(job)
        if progress:
            progress(engine_file(job.rank, job.build.backend))


def _record_placement(config: EngineConfig, engine_dir: Path) -> EngineConfig:
    """The config with where the built graph runs: the GPU a TensorRT engine was built for, or the thread pool
    of a tp 1 onnxruntime engine with the engine's kernels."""
    build = config.build
    if build.backend == "tensorrt":
        return dataclasses.replace(config, backend_device=trtb.device_stamp(build).record())
    if build.tp_size == 1 and config.plugins.engine_kernels_plugin:
        return dataclasses.replace(config, thread_pool=ortb.thread_pool(engine_dir / engine_file(0)))
    return config


def _score(config: EngineConfig, engine_dir: Path, accuracy: AccuracyOptions,
           reference: ReferenceEngine) -> EngineConfig:
    """A build that differs from float32 (weights, lm_head or KV cache) scored against its float reference: the
    report goes into config.json, and --max-ppl-increase fails the build."""
    quant, build = config.quantization, config.build
    scored = quant.mode is not None or build.kv_cache_dtype != "float32" or quant.lm_head_dtype != "float32"
    if not (scored and accuracy.eval_tokens and build.backend == "onnxruntime"):
        return config
    report = reference.accuracy_report(engine_dir, accuracy, config.generation.bos_token_id)
    config = dataclasses.replace(config, quantization=dataclasses.replace(quant, accuracy=report))
    save_config(engine_dir, config)
    check_gate(report, accuracy, quant.mode or (f"--kv-cache-dtype {build.kv_cache_dtype}"
                                                if build.kv_cache_dtype != "float32"
                                                else f"--lm-head-dtype {quant.lm_head_dtype}"))
    return config
