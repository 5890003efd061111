"""`engine build`: a checkpoint directory -> an engine directory (flags named as TensorRT-LLM's trtllm-build)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine.core.errors import EngineError

from .progress import progress_bar

SWITCH = "enable|disable"


def _switch(flag: str, value: str) -> bool:
    if value not in ("enable", "disable"):
        raise EngineError(f"{flag} {value!r} must be enable or disable", usage=True)
    return value == "enable"


def build_command(
    checkpoint_dir: Path = typer.Option(..., "--checkpoint-dir", help="Checkpoint directory made by `engine convert`."),
    output_dir: Path = typer.Option(..., "--output-dir", help="Engine directory to create."),
    max_batch_size: int = typer.Option(32, "--max-batch-size", help="Most sequences in one step (sequences)."),
    max_input_len: Optional[int] = typer.Option(None, "--max-input-len", help="Longest prompt (tokens).",
                                                show_default="1024, at most --max-seq-len"),
    max_seq_len: Optional[int] = typer.Option(None, "--max-seq-len", help="Longest sequence, prompt + output "
                                              "(tokens).", show_default="the model's max_position_embeddings"),
    max_num_tokens: int = typer.Option(2048, "--max-num-tokens", help="Most tokens computed in one step, all "
                                       "sequences together (tokens); longer prompts are prefilled in chunks."),
    tokens_per_block: int = typer.Option(32, "--tokens-per-block", help="Tokens per KV-cache block (tokens, a "
                                         "power of two)."),
    kv_cache_dtype: str = typer.Option("float32", "--kv-cache-dtype", help="KV-cache dtype: float32 (quantized "
                                       "KV caches are not supported yet)."),
    dtype: str = typer.Option("float32", "--dtype", help="Compute dtype: float32; float16/bfloat16 are accepted and "
                              "computed in float32 on ONNX Runtime CPU (see `engine inspect`)."),
    backend: str = typer.Option("auto", "--backend", help="auto (= onnxruntime), onnxruntime, or tensorrt (needs "
                                "the `tensorrt` extra and an NVIDIA GPU)."),
    gpt_attention_plugin: str = typer.Option("enable", "--gpt-attention-plugin", help=f"{SWITCH}: opset-23 "
                                             "Attention kernel, or the reference lowering in MatMul/Softmax."),
    rmsnorm_plugin: str = typer.Option("enable", "--rmsnorm-plugin", help=f"{SWITCH}: fused RMSNorm kernels, "
                                       "or the reference lowering."),
    rotary_plugin: str = typer.Option("enable", "--rotary-plugin", help=f"{SWITCH}: fused rotary kernel, "
                                      "or the reference lowering."),
    gemm_swiglu_plugin: str = typer.Option("enable", "--gemm-swiglu-plugin", help=f"{SWITCH}: one gate+up MatMul, "
                                           "or two."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size: engines rank0..rank{tp-1}; "
                                     "a checkpoint of another tp is resharded.", show_default="the checkpoint's"),
    workers: int = typer.Option(1, "--workers", help="Ranks built in parallel (processes)."),
    opt_level: str = typer.Option("all", "--opt-level", help="ORT graph optimization applied once at build: "
                                  "disable, basic, extended, all."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the flags and print the memory plan; build "
                                 "nothing."),
    force: bool = typer.Option(False, "--force", help="Replace --output-dir if it exists."),
):
    """Build an engine: one optimized ONNX graph per rank, config.json with the memory plan, tokenizer files."""
    from engine.builder.build import build_engine, check_build_config, resolve_backend
    from engine.builder.memory import memory_plan, plan_rows
    from engine.core.artifacts import load_checkpoint_config
    from engine.core.engine_config import BuildConfig, PluginConfig

    if workers < 1:
        raise EngineError(f"--workers {workers} must be at least 1", usage=True)
    plugins = PluginConfig(
        gpt_attention_plugin=_switch("--gpt-attention-plugin", gpt_attention_plugin),
        rmsnorm_plugin=_switch("--rmsnorm-plugin", rmsnorm_plugin),
        rotary_plugin=_switch("--rotary-plugin", rotary_plugin),
        gemm_swiglu_plugin=_switch("--gemm-swiglu-plugin", gemm_swiglu_plugin))
    backend = resolve_backend(backend)
    ckpt = load_checkpoint_config(checkpoint_dir)
    seq = max_seq_len if max_seq_len is not None else ckpt.model.max_position_embeddings
    build = BuildConfig(
        max_batch_size=max_batch_size, max_input_len=max_input_len if max_input_len is not None else min(1024, seq),
        max_seq_len=seq, max_num_tokens=max_num_tokens, tokens_per_block=tokens_per_block,
        kv_cache_dtype=kv_cache_dtype, dtype=dtype, backend=backend,
        tp_size=tp if tp is not None else ckpt.mapping.tp_size, opt_level=opt_level)
    check_build_config(ckpt.model, build)
    console = Console()
    if dry_run:
        table = Table(title=f"memory plan of {ckpt.model.architecture}, tp {build.tp_size} (dry run: nothing built)")
        table.add_column("item")
        table.add_column("size", justify="right")
        for item, size in plan_rows(memory_plan(ckpt.model, build), build):
            table.add_row(item, size)
        console.print(table)
        return
    with progress_bar("building", total=build.tp_size) as step:
        config = build_engine(checkpoint_dir, output_dir, build, plugins, force=force, workers=workers,
                              progress=step)
    note = config.precision.get("note")
    if note:
        Console(stderr=True, soft_wrap=True).print(f"[yellow]note:[/] {escape(note)}")
    m = config.model
    Console(highlight=False, soft_wrap=True).print(f"[green]built[/] {m.architecture} engine ({build.backend} {config.backend_version}, tp "
                  f"{build.tp_size}, max_seq_len {build.max_seq_len}, max_batch_size {build.max_batch_size}) in "
                  f"{escape(str(output_dir))}")
