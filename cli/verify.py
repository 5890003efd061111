"""`engine verify`: is this engine directory exactly what `engine build` wrote, and can this installation run it?

Checks, stopping at the first problem (exit 1 naming it): config.json parses as an engine of this format; every
file of its manifest is present with its size; no file is there that the manifest does not list; every file's
sha256 matches; then what loading checks (build limits, toolchain and backend versions, rank files). Loading does
the same except the unlisted-file check (a stray file does not stop an engine from running).
"""
from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from engine.core.errors import EngineError

from .json_output import JSON, print_json
from .results import engine_result


def verify_command(
    engine_dir: Path = typer.Option(..., "--engine-dir", help="Engine directory made by `engine build` (or "
                                    "`engine unpack`)."),
    as_json: bool = JSON,
):
    """Check every file of an engine against its manifest, and the versions; exit 1 naming the first mismatch."""
    from engine.core.artifacts import check_format
    from engine.core.engine_format import ENGINE_FORMAT, ENGINE_FORMAT_VERSION, EngineConfig
    from engine.core.manifest import first_mismatch
    from engine.core.serde import from_json, read_json
    from engine.runtime.engine_dir import REBUILD, load_engine_config

    start = time.perf_counter()
    result: dict = {"engine_dir": str(engine_dir)}
    mismatch = None
    try:
        if not Path(engine_dir).is_dir():
            raise EngineError(f"engine directory {engine_dir} does not exist; create it with `engine build`")
        path = Path(engine_dir) / "config.json"
        data = read_json(path)
        check_format(data, path, ENGINE_FORMAT, ENGINE_FORMAT_VERSION, REBUILD.format(dir=engine_dir))
        config = from_json(EngineConfig, data, where=str(path))
        result.update(engine_result(engine_dir, config))
        mismatch = first_mismatch(Path(engine_dir), config.manifest, unlisted=True)
        if mismatch is not None:
            raise EngineError(f"engine directory {engine_dir} does not match its manifest: {mismatch}; it was "
                              f"modified or damaged after `engine build` (copy it again, or "
                              f"{REBUILD.format(dir=engine_dir)})")
        load_engine_config(engine_dir)
    except EngineError as e:
        if as_json:
            print_json("verify", {**result, "mismatch": mismatch, "error": str(e),
                                  "seconds": round(time.perf_counter() - start, 3)}, ok=False)
        raise  # the error line on stderr, exit status 1
    seconds = time.perf_counter() - start
    if as_json:
        print_json("verify", {**result, "mismatch": None, "error": None, "seconds": round(seconds, 3)})
        return
    Console(highlight=False, soft_wrap=True).print(
        f"[green]ok[/] {escape(str(engine_dir))}: {result['files']} files, {result['bytes'] / 2**20:.1f} MiB match "
        f"the manifest; built by engine {config.toolchain_version} with {config.build.backend} "
        f"{config.backend_version}, as installed here ({seconds:.1f} s)\ndigest {result['digest']}")
