"""`engine convert`: a Hugging Face model directory or a GGUF file -> an engine checkpoint directory.

Flag values are checked (ConvertConfig) before any file is read, so a typo fails at once with exit status 2.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from engine.core.errors import EngineError
from engine.core.model_config import DTYPES

from .json_output import JSON, NO_PROGRESS, print_json
from .progress import progress_bar
from .results import checkpoint_result


def convert_command(
    model_dir: Optional[Path] = typer.Option(
        None, "--model-dir", show_default="none",
        help="Hugging Face model directory (config.json, *.safetensors or pytorch_model*.bin, tokenizer files). "
             "Give exactly one of --model-dir and --gguf."),
    gguf: Optional[Path] = typer.Option(
        None, "--gguf", show_default="none",
        help="A llama.cpp GGUF file; weights are dequantized, the tokenizer and chat template come from its metadata."),
    output_dir: Path = typer.Option(..., "--output-dir", help="Checkpoint directory to create."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size: number of rank{N}.safetensors shards."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel size (only 1 is supported)."),
    dtype: str = typer.Option("auto", "--dtype", help=f"Weight dtype: auto (keep the model's), {', '.join(DTYPES)}."),
    force: bool = typer.Option(False, "--force", show_default="off",
                               help="Replace --output-dir if it exists (only once the new checkpoint is complete)."),
    as_json: bool = JSON,
    no_progress: bool = NO_PROGRESS,
):
    """Convert a model into an engine checkpoint: canonical tensor names, TP shards, config.json, tokenizer."""
    from engine.quantization.gguf_tensor import dequantized_note
    from engine.recipes.convert import ConvertConfig, convert
    from engine.recipes.sources import HFDirSource

    if (model_dir is None) == (gguf is None):
        given = "both" if model_dir is not None else "neither"
        raise EngineError(f"give exactly one of --model-dir DIR or --gguf FILE ({given} was given)", usage=True)
    cfg = ConvertConfig(output_dir=output_dir, tp=tp, pp=pp, dtype=dtype, force=force)
    with contextlib.ExitStack() as stack:
        if model_dir is not None:
            source = HFDirSource(model_dir)
        else:
            from engine.recipes.gguf_source import GGUFSource
            source = stack.enter_context(GGUFSource(gguf))  # removes the tokenizer files it extracted
        start = time.perf_counter()
        with progress_bar("converting", total=len(source.names()) * tp, enabled=not (no_progress or as_json)) as step:
            ckpt = convert(source, cfg, progress=step)
    note = dequantized_note(ckpt.source)
    if note:
        Console(stderr=True, soft_wrap=True).print(f"[yellow]note:[/] {escape(note)}")
    if as_json:
        print_json("convert", {**checkpoint_result(output_dir, ckpt), "seconds": round(time.perf_counter() - start, 3)})
        return
    m = ckpt.model
    Console(highlight=False, soft_wrap=True).print(
        f"[green]converted[/] {m.architecture} ({m.num_layers} layers, hidden {m.hidden_size}, vocab {m.vocab_size}) "
        f"to {escape(str(output_dir))} — {_weights(ckpt)}, tp {ckpt.mapping.tp_size}")


def _weights(ckpt) -> str:
    """"dtype float32", or a GGUF checkpoint's kept blocks: "GGUF blocks kept (Q4_K 169, Q6_K 29), the rest float32"."""
    kept = ckpt.source.get("kept")
    if not kept:
        return f"dtype {ckpt.dtype}"
    return f"GGUF blocks kept ({', '.join(f'{k} {n}' for k, n in kept.items())}), the rest {ckpt.dtype}"
