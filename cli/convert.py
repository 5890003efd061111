"""`engine convert`: a Hugging Face model directory or a GGUF file -> an engine checkpoint directory."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from engine.core.errors import EngineError
from engine.core.config import DTYPES

from .progress import progress_bar


def convert_command(
    model_dir: Optional[Path] = typer.Option(None, "--model-dir", help="Hugging Face model directory "
                                             "(config.json, *.safetensors or pytorch_model*.bin, tokenizer files)."),
    gguf: Optional[Path] = typer.Option(None, "--gguf", help="A llama.cpp GGUF file; weights are dequantized, the "
                                        "tokenizer and chat template come from its metadata."),
    output_dir: Path = typer.Option(..., "--output-dir", help="Checkpoint directory to create."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size: number of rank{N}.safetensors shards."),
    pp: int = typer.Option(1, "--pp", help="Pipeline-parallel size (only 1 is supported)."),
    dtype: str = typer.Option("auto", "--dtype", help=f"Weight dtype: auto (keep the model's), {', '.join(DTYPES)}."),
    force: bool = typer.Option(False, "--force", help="Replace --output-dir if it exists."),
):
    """Convert a model into an engine checkpoint: canonical tensor names, TP shards, config.json, tokenizer."""
    from engine.recipes.convert import ConvertConfig, convert
    from engine.recipes.sources import HFDirSource

    if (model_dir is None) == (gguf is None):
        raise EngineError("give exactly one of --model-dir DIR or --gguf FILE", usage=True)
    if model_dir is not None:
        source = HFDirSource(model_dir)
    else:
        from engine.recipes.gguf_source import GGUFSource
        source = GGUFSource(gguf)
    cfg = ConvertConfig(output_dir=output_dir, tp=tp, pp=pp, dtype=dtype, force=force)
    with progress_bar("converting", total=len(source.names()) * tp) as step:
        ckpt = convert(source, cfg, progress=step)
    m = ckpt.model
    Console().print(f"[green]converted[/] {m.architecture} ({m.num_layers} layers, hidden {m.hidden_size}, "
                    f"vocab {m.vocab_size}) to {output_dir} — dtype {ckpt.dtype}, tp {ckpt.mapping.tp_size}")
