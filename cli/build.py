"""`engine build`: a checkpoint directory -> an engine directory (flags named as TensorRT-LLM's trtllm-build).

This module declares the flags; build_steps.py does the work, imported only when the command runs (it imports the
builder and torch, which `engine --help` does not wait for).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .flags_file import CONFIG
from .json_output import JSON, NO_PROGRESS

SWITCH = "enable|disable"

# inputs, outputs and limits
CHECKPOINT_DIR = typer.Option(..., "--checkpoint-dir", help="Checkpoint directory made by `engine convert`.")
OUTPUT_DIR = typer.Option(..., "--output-dir", help="Engine directory to create.")
MAX_BATCH_SIZE = typer.Option(32, "--max-batch-size", help="Most sequences in one step (sequences).")
MAX_INPUT_LEN = typer.Option(None, "--max-input-len", help="Longest prompt (tokens); a cap for those who want one: "
                             "prefill runs in chunks of --max-num-tokens.", show_default="--max-seq-len")
MAX_SEQ_LEN = typer.Option(None, "--max-seq-len", help="Longest sequence, prompt + output (tokens).",
                           show_default="the model's max_position_embeddings")
MAX_NUM_TOKENS = typer.Option(2048, "--max-num-tokens", help="Most tokens computed in one step, all sequences "
                              "together (tokens); longer prompts are prefilled in chunks.")
TOKENS_PER_BLOCK = typer.Option(32, "--tokens-per-block", help="Tokens per KV-cache block (tokens, a power of two).")
# precision and quantization
KV_CACHE_DTYPE = typer.Option("auto", "--kv-cache-dtype", help="KV-cache dtype: float32; float16 (2 bytes per "
                              "element: 2x the tokens in the same memory, half the bytes a decode step reads, no "
                              "calibration); int8 or fp8 (1 byte per element, 4x the tokens; per-KV-head scales "
                              "calibrated at build from --calib-data or sampled text; fp8 is e4m3, emulated on the "
                              "CPU: int8 is more precise and faster there). auto: float16 for a quantized --dtype "
                              "on onnxruntime, else float32.")
DTYPE = typer.Option("float32", "--dtype", help="Compute dtype: float32; float16/bfloat16 are accepted and computed "
                     "in float32 on ONNX Runtime CPU (see `engine inspect`). Quantized modes (TensorRT-LLM names): "
                     "int8_wo, int4_wo (weight-only RTN, quantized at build); int8_sq (SmoothQuant W8A8), fp8 (E4M3 "
                     "Q/DQ, emulated on CPU), int4_awq (AWQ), calibrated at build with NVIDIA ModelOpt (the "
                     "`quantization` extra); gguf (a checkpoint converted from a GGUF file runs its blocks exactly "
                     "as the file stores them: docs/gguf.md).")
GROUP_SIZE = typer.Option(None, "--group-size", help="Weight-only: input features sharing one scale (16, 32, 64, "
                          "128, 256; must divide every quantized weight's in features).",
                          show_default="int4_wo 32; int8_wo the largest that fits")
QUANTIZE_LM_HEAD = typer.Option(False, "--quantize-lm-head", help="Also quantize lm_head (and a tied embedding, "
                                "which shares its table); by default both stay float32.")
LM_HEAD_DTYPE = typer.Option("auto", "--lm-head-dtype", help="float32; bfloat16: lm_head (and a tied embedding) "
                             "stored in bfloat16 and run by the engine's Bf16MatMul, half the bytes a decode step "
                             "reads for it (onnxruntime, a CPU with AVX-512 BF16); int8: blocks of 32 on "
                             "llama.cpp's Q8_0 rule, a quarter of the bytes (weight-only --dtype, onnxruntime). "
                             "Neither with --quantize-lm-head. auto: int8 for int8_wo / int4_wo, bfloat16 for the "
                             "calibrated modes, where each runs; else float32.")
QUANT_ACCURACY_LEVEL = typer.Option(None, "--quant-accuracy-level", help="MatMulNBits accuracy_level: 0 float32 "
                                    "compute (true weight-only), 4 int8 activations per block (fast).",
                                    show_default="4")
# calibration and the accuracy report of quantized builds
CALIB_DATA = typer.Option(None, "--calib-data", help="int8_sq, fp8, int4_awq, int8/fp8 KV cache: calibration text "
                          '(.txt, or .jsonl with a "text" field per line).',
                          show_default="text sampled from the unquantized model itself (seeded)")
CALIB_SIZE = typer.Option(None, "--calib-size", help="int8_sq, fp8, int4_awq, quantized KV: calibration sequences. "
                          "Without --calib-data the model samples them itself: 512 x 512 tokens take about 40 "
                          "minutes on two cores; --calib-size 64 is 8x cheaper.",
                          show_default="512; 64 for a KV cache alone")
CALIB_MAX_SEQ_LEN = typer.Option(None, "--calib-max-seq-len", help="int8_sq, fp8, int4_awq, quantized KV: tokens "
                                 "per calibration sequence.", show_default="512; 256 for a KV cache alone")
CALIB_CACHE = typer.Option(None, "--calib-cache", help="int8_sq, fp8, int4_awq: a folder of calibrations to reuse. "
                           "A build of the same checkpoint, mode and calibration options (at any --tp) takes its "
                           "result from there instead of calibrating again; otherwise it calibrates and stores it "
                           "there. Delete the folder to calibrate afresh.", show_default="calibrate every build")
EVAL_DATA = typer.Option(None, "--eval-data", help="Quantized builds: held-out text file for the accuracy report.",
                         show_default="text sampled from the unquantized model itself (seeded)")
EVAL_TOKENS = typer.Option(2048, "--eval-tokens", help="Quantized builds: held-out tokens scored for the accuracy "
                           "report (0: no report).")
MAX_PPL_INCREASE = typer.Option(None, "--max-ppl-increase", help="Quantized builds: fail when perplexity rises more "
                                "than PCT percent over the unquantized reference.")
# backend
BACKEND = typer.Option("auto", "--backend", help="auto (tensorrt where the `tensorrt` package imports and a CUDA "
                       "GPU is visible, else onnxruntime), onnxruntime, or tensorrt (needs the `tensorrt` extra and "
                       "an NVIDIA GPU).")
WORKSPACE_SIZE = typer.Option(None, "--workspace-size", help="TensorRT: workspace memory-pool limit (bytes, or with "
                              "KiB/MiB/GiB, e.g. 4GiB).", show_default="TensorRT's: all device memory")
INPUT_TIMING_CACHE = typer.Option(None, "--input-timing-cache", help="TensorRT: timing cache to start from (one "
                                  "written by --output-timing-cache).")
OUTPUT_TIMING_CACHE = typer.Option(None, "--output-timing-cache", help="TensorRT: write the timing cache here after "
                                   "the build.")
# plugins: the fused lowering of each op, or its reference in standard ONNX ops
GPT_ATTENTION_PLUGIN = typer.Option("enable", "--gpt-attention-plugin", help=f"{SWITCH}: opset-23 Attention "
                                    "kernel, or the reference lowering in MatMul/Softmax.")
ENGINE_KERNELS_PLUGIN = typer.Option("enable", "--engine-kernels-plugin", help=f"{SWITCH}: the engine's own "
                                     "C++ onnxruntime ops, compiled with g++ on first use (attention reading the "
                                     "paged KV cache in place; the offsets of kept 4-bit blocks in one op), or "
                                     "standard ONNX ops only.")
RMSNORM_PLUGIN = typer.Option("enable", "--rmsnorm-plugin", help=f"{SWITCH}: fused RMSNorm kernels, or the "
                              "reference lowering.")
ROTARY_PLUGIN = typer.Option("enable", "--rotary-plugin", help=f"{SWITCH}: fused rotary kernel, or the "
                             "reference lowering.")
GEMM_SWIGLU_PLUGIN = typer.Option("enable", "--gemm-swiglu-plugin", help=f"{SWITCH}: one gate+up MatMul, or "
                                  "two.")
WEIGHT_ONLY_QUANT_MATMUL_PLUGIN = typer.Option("enable", "--weight-only-quant-matmul-plugin", help=f"{SWITCH}: "
                                               "quantized weights as MatMulNBits, or the DequantizeLinear + MatMul "
                                               "reference.")
# parallelism, graph optimization, and what the run does
TP = typer.Option(None, "--tp", help="Tensor-parallel size: engines rank0..rank{tp-1}; a checkpoint of another tp "
                  "is resharded.", show_default="the checkpoint's")
MOE_TP_SIZE = typer.Option(None, "--moe-tp-size", help="Mixture-of-experts models: ranks each expert is split "
                           "across; x --moe-ep-size = --tp.", show_default="--tp / --moe-ep-size")
MOE_EP_SIZE = typer.Option(None, "--moe-ep-size", help="Mixture-of-experts models: groups of ranks the experts are "
                           "divided among (expert parallelism); x --moe-tp-size = --tp.",
                           show_default="--tp / --moe-tp-size, else 1")
LORA_TARGET_MODULES = typer.Option(None, "--lora-target-modules", help="Projections that take LoRA adapters at run "
                                   "time (engine serve --lora-modules, engine run --lora): 'all', or PEFT module "
                                   "names, comma-separated (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj).",
                                   show_default="none: no LoRA")
LORA_DTYPE = typer.Option("auto", "--lora-dtype", help="LoRA adapters' weights in the engine: float32, bfloat16 "
                          "(half the bytes a token reads), or auto: bfloat16 over quantized weights, else float32.")
WORKERS = typer.Option(1, "--workers", help="Ranks built in parallel (processes).")
OPT_LEVEL = typer.Option("all", "--opt-level", help="ORT graph optimization applied once at build: disable, basic, "
                         "extended, all.")
DRY_RUN = typer.Option(False, "--dry-run", help="Check the flags and print the memory plan; build nothing.")
FORCE = typer.Option(False, "--force", help="Replace --output-dir if it exists.")


def build_command(
    ctx: typer.Context,
    config_file: Optional[Path] = CONFIG,
    checkpoint_dir: Path = CHECKPOINT_DIR,
    output_dir: Path = OUTPUT_DIR,
    max_batch_size: int = MAX_BATCH_SIZE,
    max_input_len: Optional[int] = MAX_INPUT_LEN,
    max_seq_len: Optional[int] = MAX_SEQ_LEN,
    max_num_tokens: int = MAX_NUM_TOKENS,
    tokens_per_block: int = TOKENS_PER_BLOCK,
    kv_cache_dtype: str = KV_CACHE_DTYPE,
    dtype: str = DTYPE,
    group_size: Optional[int] = GROUP_SIZE,
    quantize_lm_head: bool = QUANTIZE_LM_HEAD,
    lm_head_dtype: str = LM_HEAD_DTYPE,
    quant_accuracy_level: Optional[int] = QUANT_ACCURACY_LEVEL,
    calib_data: Optional[Path] = CALIB_DATA,
    calib_size: Optional[int] = CALIB_SIZE,
    calib_max_seq_len: Optional[int] = CALIB_MAX_SEQ_LEN,
    calib_cache: Optional[Path] = CALIB_CACHE,
    eval_data: Optional[Path] = EVAL_DATA,
    eval_tokens: int = EVAL_TOKENS,
    max_ppl_increase: Optional[float] = MAX_PPL_INCREASE,
    backend: str = BACKEND,
    workspace_size: Optional[str] = WORKSPACE_SIZE,
    input_timing_cache: Optional[Path] = INPUT_TIMING_CACHE,
    output_timing_cache: Optional[Path] = OUTPUT_TIMING_CACHE,
    gpt_attention_plugin: str = GPT_ATTENTION_PLUGIN,
    engine_kernels_plugin: str = ENGINE_KERNELS_PLUGIN,
    rmsnorm_plugin: str = RMSNORM_PLUGIN,
    rotary_plugin: str = ROTARY_PLUGIN,
    gemm_swiglu_plugin: str = GEMM_SWIGLU_PLUGIN,
    weight_only_quant_matmul_plugin: str = WEIGHT_ONLY_QUANT_MATMUL_PLUGIN,
    tp: Optional[int] = TP,
    moe_tp_size: Optional[int] = MOE_TP_SIZE,
    moe_ep_size: Optional[int] = MOE_EP_SIZE,
    lora_target_modules: Optional[str] = LORA_TARGET_MODULES,
    lora_dtype: str = LORA_DTYPE,
    workers: int = WORKERS,
    opt_level: str = OPT_LEVEL,
    dry_run: bool = DRY_RUN,
    force: bool = FORCE,
    as_json: bool = JSON,
    no_progress: bool = NO_PROGRESS,
):
    """Build an engine: one optimized ONNX graph per rank, config.json with the memory plan, tokenizer files."""
    from .build_steps import BuildFlags, run_build

    # the flags as resolved (command line > --config file > default); --config itself is spent
    run_build(ctx, BuildFlags(**{name: value for name, value in ctx.params.items() if name != "config_file"}))
