"""`engine pack` / `engine unpack`: an engine directory as one reproducible tar file, checked both ways
(core/packing.py)."""
from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from .json_output import JSON, print_json


def pack_command(
    engine_dir: Path = typer.Option(..., "--engine-dir", help="Engine directory made by `engine build`."),
    output: Path = typer.Option(..., "--output", help="The .tar file to write (same engine, same bytes)."),
    force: bool = typer.Option(False, "--force", help="Replace --output if it exists."),
    as_json: bool = JSON,
):
    """Pack an engine directory into one tar file; every file is checked against the manifest while it is copied."""
    from engine.core.manifest import CONFIG, digest_file
    from engine.core.packing import pack

    start = time.perf_counter()
    packed = pack(engine_dir, output, force=force)
    result = {"engine_dir": str(engine_dir), "output": str(output), "digest": digest_file(Path(engine_dir) / CONFIG),
              "files": packed.files, "bytes": packed.bytes, "archive_sha256": packed.sha256,
              "seconds": round(time.perf_counter() - start, 3)}
    if as_json:
        print_json("pack", result)
        return
    Console(highlight=False, soft_wrap=True).print(
        f"[green]packed[/] {escape(str(engine_dir))} ({packed.files} files, {packed.bytes / 2**20:.1f} MiB) into "
        f"{escape(str(output))}\nsha256 {packed.sha256}")


def unpack_command(
    input: Path = typer.Option(..., "--input", help="A .tar made by `engine pack` (also .tar.gz, .tar.xz, ...)."),
    output_dir: Path = typer.Option(..., "--output-dir", help="Engine directory to create."),
    force: bool = typer.Option(False, "--force", help="Replace --output-dir if it exists (only once the new one is "
                               "complete and checked)."),
    as_json: bool = JSON,
):
    """Unpack an engine from a tar file; every file is checked against the manifest before the directory appears."""
    from engine.core.manifest import CONFIG, digest_file
    from engine.core.packing import unpack

    start = time.perf_counter()
    manifest = unpack(input, output_dir, force=force)
    result = {"input": str(input), "engine_dir": str(output_dir), "digest": digest_file(Path(output_dir) / CONFIG),
              "files": len(manifest.files), "bytes": sum(f.size for f in manifest.files),
              "seconds": round(time.perf_counter() - start, 3)}
    if as_json:
        print_json("unpack", result)
        return
    Console(highlight=False, soft_wrap=True).print(
        f"[green]unpacked[/] {escape(str(input))} into {escape(str(output_dir))}: {result['files']} files match the "
        f"manifest (`engine verify` also checks the versions)\ndigest {result['digest']}")
