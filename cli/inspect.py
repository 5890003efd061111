"""`engine inspect`: what an engine directory holds — configs, versions, memory plan, precision, quantization and
accuracy report, op counts (MatMulNBits / GatherBlockQuantized show that quantized kernels are in the graph)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine.core.errors import EngineError


def _table(title: str, rows) -> Table:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    for key, value in rows:
        table.add_row(str(key), str(value))
    return table


def _fields(obj) -> list[tuple[str, object]]:
    return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]


def inspect_command(
    engine_dir: Path = typer.Option(..., "--engine-dir", help="Engine directory made by `engine build`."),
):
    """Show an engine's model and build configs, versions, memory plan, precision and graph op counts."""
    from engine.builder.memory import plan_rows
    from engine.builder.onnxruntime_backend import op_counts
    from engine.core.artifacts import check_format
    from engine.core.engine_config import ENGINE_FORMAT, ENGINE_FORMAT_VERSION, EngineConfig, engine_file
    from engine.core.serde import from_json, read_json
    from engine.runtime.engine_dir import REBUILD, backend_version, load_engine_config, toolchain_version

    path = Path(engine_dir) / "config.json"
    if not Path(engine_dir).is_dir():
        raise EngineError(f"engine directory {engine_dir} does not exist; create it with `engine build`")
    data = read_json(path)
    check_format(data, path, ENGINE_FORMAT, ENGINE_FORMAT_VERSION, REBUILD.format(dir=engine_dir))
    config = from_json(EngineConfig, data, where=str(path))
    try:
        load_engine_config(engine_dir)
        loadable = "[green]yes[/]"
    except EngineError as e:  # inspect still shows an engine this installation cannot run, and why
        loadable = f"[red]no[/]: {escape(str(e))}"
    console = Console()
    console.print(_table("model", _fields(config.model)))
    console.print(_table("build", _fields(config.build) + _fields(config.mapping)))
    console.print(_table("plugins", [(k, "enable" if v else "disable") for k, v in _fields(config.plugins)]))
    b = config.build.backend
    console.print(_table("versions", [
        ("format", f"{config.format} {config.format_version}"),
        ("built by", f"engine {config.toolchain_version}, {b} {config.backend_version}"),
        ("installed", f"engine {toolchain_version()}, {b} {backend_version(b) or '(not installed)'}"),
        ("runs here", loadable)]))
    console.print(_table("precision", config.precision.items()))
    q = config.quantization
    if q.mode is not None:
        rows = [("mode", q.mode), ("group size", q.group_size), ("lm_head quantized", q.quantize_lm_head),
                ("MatMulNBits accuracy_level", q.accuracy_level)]
        rows += [(f"accuracy: {k}", v) for k, v in q.accuracy.items()] or [("accuracy", "(not measured)")]
        console.print(_table("quantization", rows))
    console.print(_table("memory plan", plan_rows(config.memory, config.build)))
    for rank in range(config.mapping.world_size):
        onnx_path = Path(engine_dir) / engine_file(rank)
        if not onnx_path.is_file():
            console.print(f"[red]{engine_file(rank)} is missing[/]")
            continue
        counts = op_counts(onnx_path)
        data_file = onnx_path.with_name(onnx_path.name + ".data")
        size = data_file.stat().st_size if data_file.is_file() else 0
        table = Table(title=f"{engine_file(rank)}: {sum(counts.values())} nodes, weights {size / 2**20:.1f} MiB",
                      title_justify="left")
        table.add_column("op type")
        table.add_column("count", justify="right")
        for op, n in counts.items():
            table.add_row(op, str(n))
        console.print(table)
        if rank == 0 and config.mapping.world_size > 1:
            console.print(f"(ranks 1..{config.mapping.world_size - 1} have the same graph over their shards)")
            break
