"""What `engine build` does with its flags (declared in build.py), step by step:

    resolve_flags         check the flags and turn them into the library's configs (a BuildRequest); every usage
                          error is raised here, before anything is read but the checkpoint's config.json
    print_memory_plan     --dry-run: the memory plan, and nothing built
    build_with_progress   builder.build.build_engine under a progress bar
    report                a precision note, the accuracy report of a quantized build, the success line (or --json)
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine.builder.build import build_engine, check_build_config, resolve_quant
from engine.builder.memory import memory_plan, plan_rows
from engine.builder.tensorrt_backend import TensorRTOptions, check_options, parse_size, resolve_backend
from engine.core.artifacts import CheckpointConfig, load_checkpoint_config
from engine.core.engine_format import BuildConfig, EngineConfig, PluginConfig
from engine.core.errors import EngineError
from engine.core.lora import resolve_lora_dtype, resolve_target_modules
from engine.core.model_config import QuantConfig
from engine.quantization import modes
from engine.quantization.accuracy import AccuracyOptions
from engine.quantization.modelopt_calibration import CalibrationOptions
from engine.quantization.kv_cache import KV_CALIBRATION, QUANTIZED as KV_QUANTIZED, resolve_kv_cache_dtype

from .flags_file import recorded_flags
from .json_output import print_json
from .progress import progress_bar
from .results import engine_result


@dataclass(frozen=True)
class BuildFlags:
    """`engine build`'s flags as resolved (command line > --config file > default), not yet checked."""
    checkpoint_dir: Path
    output_dir: Path
    max_batch_size: int
    max_input_len: Optional[int]
    max_seq_len: Optional[int]
    max_num_tokens: int
    tokens_per_block: int
    kv_cache_dtype: str
    dtype: str
    group_size: Optional[int]
    quantize_lm_head: bool
    lm_head_dtype: str
    quant_accuracy_level: Optional[int]
    calib_data: Optional[Path]
    calib_size: Optional[int]
    calib_max_seq_len: Optional[int]
    calib_cache: Optional[Path]
    eval_data: Optional[Path]
    eval_tokens: int
    max_ppl_increase: Optional[float]
    backend: str
    workspace_size: Optional[str]
    input_timing_cache: Optional[Path]
    output_timing_cache: Optional[Path]
    gpt_attention_plugin: str
    engine_kernels_plugin: str
    rmsnorm_plugin: str
    rotary_plugin: str
    gemm_swiglu_plugin: str
    weight_only_quant_matmul_plugin: str
    tp: Optional[int]
    moe_tp_size: Optional[int]
    moe_ep_size: Optional[int]
    lora_target_modules: Optional[str]
    lora_dtype: str
    workers: int
    opt_level: str
    dry_run: bool
    force: bool
    as_json: bool
    no_progress: bool


@dataclass(frozen=True)
class BuildRequest:
    """The checked flags as builder.build.build_engine takes them."""
    ckpt: CheckpointConfig
    build: BuildConfig
    plugins: PluginConfig
    quant: QuantConfig  # as requested: build_engine fills in its defaults
    accuracy: AccuracyOptions
    calibration: CalibrationOptions
    trt: TensorRTOptions


def run_build(ctx: typer.Context, flags: BuildFlags) -> None:
    request = resolve_flags(flags)
    if flags.dry_run:
        print_memory_plan(flags, request)
        return
    start = time.perf_counter()
    config = build_with_progress(ctx, flags, request)
    report(flags, config, seconds=time.perf_counter() - start)


def resolve_flags(flags: BuildFlags) -> BuildRequest:
    """The flags checked and turned into configs: a bad one raises a usage error that names it."""
    if flags.workers < 1:
        raise EngineError(f"--workers {flags.workers} must be at least 1", usage=True)
    plugins = _plugin_config(flags)
    compute_dtype, mode = modes.split_dtype(flags.dtype)
    _check_quantization_flags(flags, mode)
    calibration = _calibration(flags, mode)
    if flags.eval_data is not None and not flags.eval_data.is_file():
        raise EngineError(f"--eval-data {flags.eval_data} is not a file; pass a UTF-8 text file", usage=True)
    accuracy = AccuracyOptions(eval_data=flags.eval_data, max_ppl_increase=flags.max_ppl_increase,
                               eval_tokens=flags.eval_tokens)
    backend = resolve_backend(flags.backend, mode, "float32" if flags.kv_cache_dtype == "auto"
                              else flags.kv_cache_dtype)
    kv_cache_dtype = resolve_kv_cache_dtype(flags.kv_cache_dtype, mode, backend)
    trt = _tensorrt_options(flags, backend)
    ckpt = load_checkpoint_config(flags.checkpoint_dir)
    seq = flags.max_seq_len if flags.max_seq_len is not None else ckpt.model.max_position_embeddings
    # any prompt that fits the sequence, as vLLM's max_model_len: chunked prefill bounds each step, not the prompt
    max_input_len = flags.max_input_len if flags.max_input_len is not None else seq
    tp = flags.tp if flags.tp is not None else ckpt.mapping.tp_size
    build = BuildConfig(
        max_batch_size=flags.max_batch_size, max_input_len=max_input_len, max_seq_len=seq,
        max_num_tokens=flags.max_num_tokens, tokens_per_block=flags.tokens_per_block,
        kv_cache_dtype=kv_cache_dtype, dtype=compute_dtype, backend=backend, tp_size=tp, opt_level=flags.opt_level,
        moe_ep_size=_moe_ep_size(flags, tp), lora_target_modules=_lora_target_modules(flags),
        lora_dtype=resolve_lora_dtype(flags.lora_dtype, mode))
    check_build_config(ckpt.model, build)
    quant = QuantConfig(mode=mode, group_size=flags.group_size, quantize_lm_head=flags.quantize_lm_head,
                        accuracy_level=flags.quant_accuracy_level, lm_head_dtype=flags.lm_head_dtype)
    modes.resolve(quant, ckpt.model, build.tp_size, build.moe_ep_size)   # bad flags fail here, before any read
    modes.resolve_lm_head_dtype(quant, ckpt.model, backend=backend, kernels=plugins.engine_kernels_plugin)
    return BuildRequest(ckpt, build, plugins, quant, accuracy, calibration, trt)


def _lora_target_modules(flags: BuildFlags) -> tuple[str, ...]:
    names = (flags.lora_target_modules or "").replace(",", " ").split()
    return resolve_target_modules(names) if names else ()


def _moe_ep_size(flags: BuildFlags, tp: int) -> int:
    """--moe-ep-size, from itself or --moe-tp-size: their product is --tp; neither means every expert on every rank
    (--moe-tp-size = --tp). check_build_config checks the result against the model."""
    ep, moe_tp = flags.moe_ep_size, flags.moe_tp_size
    if ep is None and moe_tp is None:
        return 1
    if ep is None:
        if moe_tp < 1 or tp % moe_tp:
            raise EngineError(f"--moe-tp-size {moe_tp} must divide --tp {tp} (--moe-tp-size x --moe-ep-size = --tp)",
                              usage=True)
        return tp // moe_tp
    if moe_tp is not None and moe_tp * ep != tp:
        raise EngineError(f"--moe-tp-size {moe_tp} x --moe-ep-size {ep} must equal --tp {tp}", usage=True)
    return ep


def _switch(flag: str, value: str) -> bool:
    if value not in ("enable", "disable"):
        raise EngineError(f"{flag} {value!r} must be enable or disable", usage=True)
    return value == "enable"


def _plugin_config(flags: BuildFlags) -> PluginConfig:
    return PluginConfig(
        gpt_attention_plugin=_switch("--gpt-attention-plugin", flags.gpt_attention_plugin),
        engine_kernels_plugin=_switch("--engine-kernels-plugin", flags.engine_kernels_plugin),
        rmsnorm_plugin=_switch("--rmsnorm-plugin", flags.rmsnorm_plugin),
        rotary_plugin=_switch("--rotary-plugin", flags.rotary_plugin),
        gemm_swiglu_plugin=_switch("--gemm-swiglu-plugin", flags.gemm_swiglu_plugin),
        weight_only_quant_matmul_plugin=_switch("--weight-only-quant-matmul-plugin",
                                                flags.weight_only_quant_matmul_plugin))


def _check_quantization_flags(flags: BuildFlags, mode: str | None) -> None:
    """The flags of quantized and calibrated builds refused on a build that is neither."""
    kv_quantized = flags.kv_cache_dtype in KV_QUANTIZED   # calibrated and scored like a quantized --dtype
    # scored against float32 like a quantized --dtype (a float16 KV cache: scored, not calibrated); auto is float32
    # where no --dtype mode is given
    scored = flags.kv_cache_dtype not in ("float32", "auto") or flags.lm_head_dtype == "bfloat16"
    if mode is None and (flags.group_size is not None or flags.quantize_lm_head
                         or flags.quant_accuracy_level is not None
                         or (not scored and (flags.max_ppl_increase is not None or flags.eval_data is not None))):
        raise EngineError(f"--group-size, --quantize-lm-head, --quant-accuracy-level, --eval-data and "
                          f"--max-ppl-increase apply to quantized builds; --dtype {flags.dtype} is not one: pass "
                          f"--dtype {' or '.join(modes.IMPLEMENTED)}", usage=True)
    calib_flags = {"--calib-data": flags.calib_data, "--calib-size": flags.calib_size,
                   "--calib-max-seq-len": flags.calib_max_seq_len}
    if flags.calib_cache is not None and mode not in modes.CALIBRATED:
        raise EngineError(f"--calib-cache applies to --dtype {', '.join(modes.CALIBRATED)}; --dtype {flags.dtype} "
                          "calibrates no weights: leave it out", usage=True)
    if flags.calib_cache is not None and flags.calib_cache.exists() and not flags.calib_cache.is_dir():
        raise EngineError(f"--calib-cache {flags.calib_cache} is a file; pass a folder (it is created if missing)",
                          usage=True)
    given = [flag for flag, value in calib_flags.items() if value is not None]
    if given and mode not in modes.CALIBRATED and not kv_quantized:
        raise EngineError(f"{', '.join(given)} apply to calibrated builds (--dtype {', '.join(modes.CALIBRATED)}, "
                          f"or --kv-cache-dtype int8|fp8); --dtype {flags.dtype} is not one: leave them out",
                          usage=True)
    if flags.calib_data is not None and not flags.calib_data.is_file():
        raise EngineError(f"--calib-data {flags.calib_data} is not a file; pass a UTF-8 .txt or .jsonl file",
                          usage=True)


def _calibration(flags: BuildFlags, mode: str | None) -> CalibrationOptions:
    # a KV cache alone needs only absmax statistics: fewer sampled tokens than ModelOpt's weight calibration
    kv_alone = mode not in modes.CALIBRATED and flags.kv_cache_dtype in KV_QUANTIZED
    defaults = KV_CALIBRATION if kv_alone else CalibrationOptions()
    return CalibrationOptions(
        data=flags.calib_data, size=defaults.size if flags.calib_size is None else flags.calib_size,
        max_seq_len=defaults.max_seq_len if flags.calib_max_seq_len is None else flags.calib_max_seq_len,
        cache=flags.calib_cache)


def _tensorrt_options(flags: BuildFlags, backend: str) -> TensorRTOptions:
    size = parse_size(flags.workspace_size) if flags.workspace_size is not None else None
    trt = TensorRTOptions(workspace_size=size, input_timing_cache=flags.input_timing_cache,
                          output_timing_cache=flags.output_timing_cache)
    if backend != "tensorrt" and trt != TensorRTOptions():
        raise EngineError(f"--workspace-size, --input-timing-cache and --output-timing-cache apply to TensorRT "
                          f"builds; this build's backend is {backend}: pass --backend tensorrt or leave them out",
                          usage=True)
    check_options(trt)
    return trt


def print_memory_plan(flags: BuildFlags, request: BuildRequest) -> None:
    """--dry-run: the memory plan of the build the flags ask for (as a table, or --json)."""
    ckpt, build, plugins = request.ckpt, request.build, request.plugins
    quant = resolve_quant(request.quant, flags.checkpoint_dir, ckpt, build.tp_size, build.backend,
                          plugins.engine_kernels_plugin, build.moe_ep_size)
    rows = plan_rows(memory_plan(ckpt.model, build, quant, plugins), build)
    if flags.as_json:
        print_json("build", {"dry_run": True, "build": build, "memory_plan": dict(rows)})
        return
    table = Table(title=f"memory plan of {ckpt.model.architecture}, tp {build.tp_size} (dry run: nothing built)")
    table.add_column("item")
    table.add_column("size", justify="right")
    for item, size in rows:
        table.add_row(item, size)
    Console().print(table)


def build_with_progress(ctx: typer.Context, flags: BuildFlags, request: BuildRequest) -> EngineConfig:
    r = request
    with progress_bar("building", total=r.build.tp_size, enabled=not (flags.no_progress or flags.as_json)) as step:
        return build_engine(flags.checkpoint_dir, flags.output_dir, r.build, r.plugins, force=flags.force,
                            workers=flags.workers, progress=step, quant=r.quant, accuracy=r.accuracy, trt=r.trt,
                            calibration=r.calibration,
                            build_flags={**recorded_flags(ctx), "backend": r.build.backend})  # auto, resolved


def report(flags: BuildFlags, config: EngineConfig, seconds: float) -> None:
    note = config.precision.get("note")
    if note:
        Console(stderr=True, soft_wrap=True).print(f"[yellow]note:[/] {escape(note)}")
    if flags.as_json:
        print_json("build", {**engine_result(flags.output_dir, config), "seconds": round(seconds, 3)})
        return
    out = Console(highlight=False, soft_wrap=True)
    accuracy = config.quantization.accuracy
    if "quantized_ppl" in accuracy:
        q, kv_cache_dtype = config.quantization, config.build.kv_cache_dtype
        what = [q.mode] if q.mode else []
        what += [f"{q.lm_head_dtype} lm_head"] if q.lm_head_dtype != "float32" else []
        what += [f"{kv_cache_dtype} KV cache"] if kv_cache_dtype != "float32" else []
        for part in (accuracy, accuracy.get("chat")):
            if part:
                out.print(f"accuracy ({' + '.join(what)}): perplexity {part['reference_ppl']:.3f} -> "
                          f"{part['quantized_ppl']:.3f} ({part['ppl_increase_pct']:+.2f}%), top-1 agreement "
                          f"{part['top1_agreement']:.3f}, mean KL {part['mean_kl']:.4f} on {part['tokens']} tokens, "
                          f"{escape(part['data'])}")
    m, b = config.model, config.build
    out.print(f"[green]built[/] {m.architecture} engine ({b.backend} {config.backend_version}, tp {b.tp_size}, "
              f"max_seq_len {b.max_seq_len}, max_batch_size {b.max_batch_size}) in {escape(str(flags.output_dir))}")
