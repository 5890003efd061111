"""`engine build`: a checkpoint directory -> an engine directory (flags named as TensorRT-LLM's trtllm-build)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine.core.errors import EngineError

from .config_file import CONFIG, recorded_flags
from .json_output import JSON, NO_PROGRESS, print_json
from .progress import progress_bar
from .results import engine_result

SWITCH = "enable|disable"


def _switch(flag: str, value: str) -> bool:
    if value not in ("enable", "disable"):
        raise EngineError(f"{flag} {value!r} must be enable or disable", usage=True)
    return value == "enable"


def build_command(
    ctx: typer.Context,
    config_file: Optional[Path] = CONFIG,
    checkpoint_dir: Path = typer.Option(..., "--checkpoint-dir", help="Checkpoint directory made by `engine convert`."),
    output_dir: Path = typer.Option(..., "--output-dir", help="Engine directory to create."),
    max_batch_size: int = typer.Option(32, "--max-batch-size", help="Most sequences in one step (sequences)."),
    max_input_len: Optional[int] = typer.Option(None, "--max-input-len", help="Longest prompt (tokens); a cap for "
                                                "those who want one: prefill runs in chunks of --max-num-tokens.",
                                                show_default="--max-seq-len"),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="Longest sequence, prompt + output "
                                              "(tokens).", show_default="the model's max_position_embeddings"),
    max_num_tokens: int = typer.Option(2048, "--max-num-tokens", help="Most tokens computed in one step, all "
                                       "sequences together (tokens); longer prompts are prefilled in chunks."),
    tokens_per_block: int = typer.Option(32, "--tokens-per-block", help="Tokens per KV-cache block (tokens, a "
                                         "power of two)."),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="KV-cache dtype: float32; float16 (2 "
                                       "bytes per element: 2x the tokens in the same memory, half the bytes a "
                                       "decode step reads, no calibration); int8 or fp8 (1 byte per element, 4x "
                                       "the tokens; per-KV-head scales calibrated at build from --calib-data or "
                                       "sampled text; fp8 is e4m3, emulated on the CPU: int8 is more precise and "
                                       "faster there). auto: float16 for a quantized --dtype on onnxruntime, else "
                                       "float32."),
    dtype: str = typer.Option("float32", "--dtype", help="Compute dtype: float32; float16/bfloat16 are accepted and "
                              "computed in float32 on ONNX Runtime CPU (see `engine inspect`). Quantized modes "
                              "(TensorRT-LLM names): int8_wo, int4_wo (weight-only RTN, quantized at build); "
                              "int8_sq (SmoothQuant W8A8), fp8 (E4M3 Q/DQ, emulated on CPU), int4_awq (AWQ), "
                              "calibrated at build with NVIDIA ModelOpt (the `quantization` extra); gguf (a "
                              "checkpoint converted from a GGUF file runs its blocks exactly as the file stores "
                              "them: docs/gguf.md)."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Weight-only: input features sharing one "
                                             "scale (16, 32, 64, 128, 256; must divide every quantized weight's in "
                                             "features).", show_default="int4_wo 32; int8_wo the largest that fits"),
    quantize_lm_head: bool = typer.Option(False, "--quantize-lm-head", help="Also quantize lm_head (and a tied "
                                          "embedding, which shares its table); by default both stay float32."),
    lm_head_dtype: str = typer.Option("auto", "--lm-head-dtype", help="float32; bfloat16: lm_head (and a tied "
                                      "embedding) stored in bfloat16 and run by the engine's Bf16MatMul, half the "
                                      "bytes a decode step reads for it (onnxruntime, a CPU with AVX-512 BF16); "
                                      "int8: blocks of 32 on llama.cpp's Q8_0 rule, a quarter of the bytes "
                                      "(weight-only --dtype, onnxruntime). Neither with --quantize-lm-head. auto: "
                                      "int8 for int8_wo / int4_wo, bfloat16 for the calibrated modes, where each "
                                      "runs; else float32."),
    quant_accuracy_level: Optional[int] = typer.Option(None, "--quant-accuracy-level", help="MatMulNBits "
                                                       "accuracy_level: 0 float32 compute (true weight-only), 4 int8 "
                                                       "activations per block (fast).", show_default="4"),
    calib_data: Optional[Path] = typer.Option(None, "--calib-data", help="int8_sq, fp8, int4_awq, int8/fp8 KV cache: "
                                              "calibration text (.txt, or .jsonl with a \"text\" field per line).",
                                              show_default="text sampled from the unquantized model itself (seeded)"),
    calib_size: Optional[int] = typer.Option(None, "--calib-size", help="int8_sq, fp8, int4_awq, quantized KV: "
                                             "calibration sequences. Without --calib-data the model samples "
                                             "them itself: 512 x 512 tokens take about 40 minutes on two cores; "
                                             "--calib-size 64 is 8x cheaper.",
                                             show_default="512; 64 for a KV cache alone"),
    calib_max_seq_len: Optional[int] = typer.Option(None, "--calib-max-seq-len", help="int8_sq, fp8, int4_awq, "
                                                    "quantized KV: tokens per calibration sequence.",
                                                    show_default="512; 256 for a KV cache alone"),
    eval_data: Optional[Path] = typer.Option(None, "--eval-data", help="Quantized builds: held-out text file for "
                                             "the accuracy report.", show_default="text sampled from the unquantized "
                                             "model itself (seeded)"),
    eval_tokens: int = typer.Option(2048, "--eval-tokens", help="Quantized builds: held-out tokens scored for the "
                                    "accuracy report (0: no report)."),
    max_ppl_increase: Optional[float] = typer.Option(None, "--max-ppl-increase", help="Quantized builds: fail when "
                                                     "perplexity rises more than PCT percent over the unquantized "
                                                     "reference."),
    backend: str = typer.Option("auto", "--backend", help="auto (tensorrt where the `tensorrt` package imports and a "
                                "CUDA GPU is visible, else onnxruntime), onnxruntime, or tensorrt (needs the "
                                "`tensorrt` extra and an NVIDIA GPU)."),
    workspace_size: Optional[str] = typer.Option(None, "--workspace-size", help="TensorRT: workspace memory-pool "
                                                 "limit (bytes, or with KiB/MiB/GiB, e.g. 4GiB).",
                                                 show_default="TensorRT's: all device memory"),
    input_timing_cache: Optional[Path] = typer.Option(None, "--input-timing-cache", help="TensorRT: timing cache "
                                                      "to start from (one written by --output-timing-cache)."),
    output_timing_cache: Optional[Path] = typer.Option(None, "--output-timing-cache", help="TensorRT: write the "
                                                       "timing cache here after the build."),
    gpt_attention_plugin: str = typer.Option("enable", "--gpt-attention-plugin", help=f"{SWITCH}: opset-23 "
                                             "Attention kernel, or the reference lowering in MatMul/Softmax."),
    engine_kernels_plugin: str = typer.Option("enable", "--engine-kernels-plugin", help=f"{SWITCH}: the "
                                              "engine's own C++ onnxruntime ops, compiled with g++ on first use "
                                              "(attention reading the paged KV cache in place; the offsets of kept "
                                              "4-bit blocks in one op), or standard ONNX ops only."),
    rmsnorm_plugin: str = typer.Option("enable", "--rmsnorm-plugin", help=f"{SWITCH}: fused RMSNorm kernels, "
                                       "or the reference lowering."),
    rotary_plugin: str = typer.Option("enable", "--rotary-plugin", help=f"{SWITCH}: fused rotary kernel, "
                                      "or the reference lowering."),
    gemm_swiglu_plugin: str = typer.Option("enable", "--gemm-swiglu-plugin", help=f"{SWITCH}: one gate+up MatMul, "
                                           "or two."),
    weight_only_quant_matmul_plugin: str = typer.Option("enable", "--weight-only-quant-matmul-plugin",
                                                        help=f"{SWITCH}: quantized weights as MatMulNBits, or "
                                                        "the DequantizeLinear + MatMul reference."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size: engines rank0..rank{tp-1}; "
                                     "a checkpoint of another tp is resharded.", show_default="the checkpoint's"),
    workers: int = typer.Option(1, "--workers", help="Ranks built in parallel (processes)."),
    opt_level: str = typer.Option("all", "--opt-level", help="ORT graph optimization applied once at build: "
                                  "disable, basic, extended, all."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the flags and print the memory plan; build "
                                 "nothing."),
    force: bool = typer.Option(False, "--force", help="Replace --output-dir if it exists."),
    as_json: bool = JSON,
    no_progress: bool = NO_PROGRESS,
):
    """Build an engine: one optimized ONNX graph per rank, config.json with the memory plan, tokenizer files."""
    from engine.builder.build import build_engine, check_build_config, resolve_quant
    from engine.builder.tensorrt_backend import resolve_backend
    from engine.builder.memory import memory_plan, plan_rows
    from engine.core.artifacts import load_checkpoint_config
    from engine.core.config import QuantConfig
    from engine.core.engine_config import BuildConfig, PluginConfig
    from engine.quantization import modes
    from engine.quantization.accuracy import AccuracyOptions
    from engine.quantization.calibrate import CalibrationOptions
    from engine.quantization.kv_cache import KV_CALIBRATION, QUANTIZED as KV_QUANTIZED, resolve_kv_cache_dtype

    if workers < 1:
        raise EngineError(f"--workers {workers} must be at least 1", usage=True)
    plugins = PluginConfig(
        gpt_attention_plugin=_switch("--gpt-attention-plugin", gpt_attention_plugin),
        engine_kernels_plugin=_switch("--engine-kernels-plugin", engine_kernels_plugin),
        rmsnorm_plugin=_switch("--rmsnorm-plugin", rmsnorm_plugin),
        rotary_plugin=_switch("--rotary-plugin", rotary_plugin),
        gemm_swiglu_plugin=_switch("--gemm-swiglu-plugin", gemm_swiglu_plugin),
        weight_only_quant_matmul_plugin=_switch("--weight-only-quant-matmul-plugin",
                                                weight_only_quant_matmul_plugin))
    compute_dtype, mode = modes.split_dtype(dtype)
    kv_quantized = kv_cache_dtype in KV_QUANTIZED   # calibrated and scored like a quantized --dtype
    # scored against float32 like a quantized --dtype (a float16 KV cache: scored, not calibrated); auto is float32
    # where no --dtype mode is given
    scored = kv_cache_dtype not in ("float32", "auto") or lm_head_dtype == "bfloat16"
    if mode is None and (group_size is not None or quantize_lm_head or quant_accuracy_level is not None
                         or (not scored and (max_ppl_increase is not None or eval_data is not None))):
        raise EngineError(f"--group-size, --quantize-lm-head, --quant-accuracy-level, --eval-data and "
                          f"--max-ppl-increase apply to quantized builds; --dtype {dtype} is not one: pass "
                          f"--dtype {' or '.join(modes.IMPLEMENTED)}", usage=True)
    calib_flags = {"--calib-data": calib_data, "--calib-size": calib_size, "--calib-max-seq-len": calib_max_seq_len}
    given = [flag for flag, value in calib_flags.items() if value is not None]
    if given and mode not in modes.CALIBRATED and not kv_quantized:
        raise EngineError(f"{', '.join(given)} apply to calibrated builds (--dtype {', '.join(modes.CALIBRATED)}, "
                          f"or --kv-cache-dtype int8|fp8); --dtype {dtype} is not one: leave them out", usage=True)
    if calib_data is not None and not calib_data.is_file():
        raise EngineError(f"--calib-data {calib_data} is not a file; pass a UTF-8 .txt or .jsonl file", usage=True)
    # a KV cache alone needs only absmax statistics: fewer sampled tokens than ModelOpt's weight calibration
    defaults = CalibrationOptions() if mode in modes.CALIBRATED or not kv_quantized else KV_CALIBRATION
    calibration = CalibrationOptions(data=calib_data, size=defaults.size if calib_size is None else calib_size,
                                     max_seq_len=defaults.max_seq_len if calib_max_seq_len is None
                                     else calib_max_seq_len)
    if eval_data is not None and not eval_data.is_file():
        raise EngineError(f"--eval-data {eval_data} is not a file; pass a UTF-8 text file", usage=True)
    accuracy = AccuracyOptions(eval_data=eval_data, max_ppl_increase=max_ppl_increase, eval_tokens=eval_tokens)
    backend = resolve_backend(backend, mode, "float32" if kv_cache_dtype == "auto" else kv_cache_dtype)
    kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, mode, backend)
    from engine.builder.tensorrt_backend import TensorRTOptions, check_options, parse_size
    trt = TensorRTOptions(workspace_size=parse_size(workspace_size) if workspace_size is not None else None,
                          input_timing_cache=input_timing_cache, output_timing_cache=output_timing_cache)
    if backend != "tensorrt" and trt != TensorRTOptions():
        raise EngineError(f"--workspace-size, --input-timing-cache and --output-timing-cache apply to TensorRT "
                          f"builds; this build's backend is {backend}: pass --backend tensorrt or leave them out",
                          usage=True)
    check_options(trt)
    ckpt = load_checkpoint_config(checkpoint_dir)
    seq = max_seq_len if max_seq_len is not None else ckpt.model.max_position_embeddings
    build = BuildConfig(
        # any prompt that fits the sequence, as vLLM's max_model_len: chunked prefill bounds each step, not the prompt
        max_batch_size=max_batch_size, max_input_len=max_input_len if max_input_len is not None else seq,
        max_seq_len=seq, max_num_tokens=max_num_tokens, tokens_per_block=tokens_per_block,
        kv_cache_dtype=kv_cache_dtype, dtype=compute_dtype, backend=backend,
        tp_size=tp if tp is not None else ckpt.mapping.tp_size, opt_level=opt_level)
    check_build_config(ckpt.model, build)
    requested = QuantConfig(mode=mode, group_size=group_size, quantize_lm_head=quantize_lm_head,
                            accuracy_level=quant_accuracy_level, lm_head_dtype=lm_head_dtype)
    modes.resolve(requested, ckpt.model, build.tp_size)   # bad flags fail here, before anything is read
    modes.resolve_lm_head_dtype(requested, ckpt.model, backend=backend, kernels=plugins.engine_kernels_plugin)
    console = Console()
    if dry_run:
        table = Table(title=f"memory plan of {ckpt.model.architecture}, tp {build.tp_size} (dry run: nothing built)")
        table.add_column("item")
        table.add_column("size", justify="right")
        quant = resolve_quant(requested, checkpoint_dir, ckpt, build.tp_size, build.backend,
                              plugins.engine_kernels_plugin)
        rows = plan_rows(memory_plan(ckpt.model, build, quant, plugins), build)
        if as_json:
            print_json("build", {"dry_run": True, "build": build, "memory_plan": dict(rows)})
            return
        for item, size in rows:
            table.add_row(item, size)
        console.print(table)
        return
    start = time.perf_counter()
    with progress_bar("building", total=build.tp_size, enabled=not (no_progress or as_json)) as step:
        config = build_engine(checkpoint_dir, output_dir, build, plugins, force=force, workers=workers,
                              progress=step, quant=requested, accuracy=accuracy, trt=trt, calibration=calibration,
                              build_flags={**recorded_flags(ctx), "backend": backend})  # auto, resolved
    note = config.precision.get("note")
    if note:
        Console(stderr=True, soft_wrap=True).print(f"[yellow]note:[/] {escape(note)}")
    if as_json:
        print_json("build", {**engine_result(output_dir, config), "seconds": round(time.perf_counter() - start, 3)})
        return
    report = config.quantization.accuracy
    if "quantized_ppl" in report:
        q = config.quantization
        what = [q.mode] if q.mode else []
        what += [f"{q.lm_head_dtype} lm_head"] if q.lm_head_dtype != "float32" else []
        what += [f"{build.kv_cache_dtype} KV cache"] if build.kv_cache_dtype != "float32" else []
        out = Console(highlight=False, soft_wrap=True)
        for part in (report, report.get("chat")):
            if part:
                out.print(f"accuracy ({' + '.join(what)}): perplexity {part['reference_ppl']:.3f} -> "
                          f"{part['quantized_ppl']:.3f} ({part['ppl_increase_pct']:+.2f}%), top-1 agreement "
                          f"{part['top1_agreement']:.3f}, mean KL {part['mean_kl']:.4f} on {part['tokens']} tokens, "
                          f"{escape(part['data'])}")
    m = config.model
    Console(highlight=False, soft_wrap=True).print(f"[green]built[/] {m.architecture} engine ({build.backend} {config.backend_version}, tp "
                  f"{build.tp_size}, max_seq_len {build.max_seq_len}, max_batch_size {build.max_batch_size}) in "
                  f"{escape(str(output_dir))}")
