"""`engine inspect`: what an engine directory holds — configs, versions, memory plan, precision, quantization and
accuracy report, op counts (MatMulNBits / GatherBlockQuantized show that quantized kernels are in the graph)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine.core.artifacts import check_format
from engine.core.engine_format import ENGINE_FORMAT, ENGINE_FORMAT_VERSION, EngineConfig, rank_files
from engine.core.errors import EngineError
from engine.core.manifest import digest_file
from engine.core.model_config import QuantConfig
from engine.core.serde import from_json, read_json

from .json_output import JSON, print_json
from .results import engine_result


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
    as_json: bool = JSON,
):
    """Show an engine's model and build configs, versions, memory plan, precision and graph op counts."""
    config, why_not = _read_config(Path(engine_dir))
    if as_json:
        counts = {f: _op_counts([Path(engine_dir) / f]) for r in range(config.mapping.world_size)
                  for f in _graph_files(config, r) if f.endswith(".onnx") and (Path(engine_dir) / f).is_file()}
        print_json("inspect", {**engine_result(engine_dir, config), "runs_here": why_not is None, "why_not": why_not,
                               "config": config, "op_counts": counts})
        return
    from engine.builder.memory import plan_rows

    console = Console()
    console.print(_table("model", _fields(config.model)))
    console.print(_table("build", _fields(config.build) + _fields(config.mapping) +
                         [("thread_pool", config.thread_pool)]))
    console.print(_table("plugins", [(k, "enable" if v else "disable") for k, v in _fields(config.plugins)]))
    console.print(_table("versions", _version_rows(config, Path(engine_dir) / "config.json", why_not)))
    console.print(_table("precision", config.precision.items()))
    q = config.quantization
    if q.mode is not None or q.kv_cache:
        console.print(_table("quantization", _quantization_rows(q)))
    console.print(_table("memory plan", plan_rows(config.memory, config.build)))
    _print_graphs(console, Path(engine_dir), config)


def _read_config(engine_dir: Path) -> tuple[EngineConfig, str | None]:
    """The engine's config (refused only when unreadable) and why this installation cannot run it (None: it can)."""
    from engine.runtime.engine_dir import REBUILD, load_engine_config

    path = engine_dir / "config.json"
    if not engine_dir.is_dir():
        raise EngineError(f"engine directory {engine_dir} does not exist; create it with `engine build`")
    data = read_json(path)
    check_format(data, path, ENGINE_FORMAT, ENGINE_FORMAT_VERSION, REBUILD.format(dir=engine_dir))
    config = from_json(EngineConfig, data, where=str(path))
    try:
        load_engine_config(engine_dir)
    except EngineError as e:  # inspect still shows an engine this installation cannot run, and why
        return config, str(e)
    return config, None


def _graph_files(config: EngineConfig, rank: int) -> list[str]:
    """The graph files of `rank`: one, or (tp > 1 on onnxruntime) its segment graphs, cut at the all-reduces."""
    return rank_files(rank, config.build.backend, config.mapping.tp_size, config.model.num_layers,
                      config.quantization.mode)


def _version_rows(config: EngineConfig, path: Path, why_not: str | None) -> list[tuple[str, str]]:
    from engine.runtime.engine_dir import backend_version, toolchain_version

    b = config.build.backend
    return [
        ("format", f"{config.format} {config.format_version}"),
        ("built by", f"engine {config.toolchain_version}, {b} {config.backend_version}"),
        *([("built for", "compute capability {compute_capability} ({device_name})".format(**config.backend_device))]
          if config.backend_device else []),
        ("installed", f"engine {toolchain_version()}, {b} {backend_version(b) or '(not installed)'}"),
        ("runs here", "[green]yes[/]" if why_not is None else f"[red]no[/]: {escape(why_not)}"),
        ("digest", digest_file(path)),
        ("checkpoint digest", config.manifest.checkpoint_digest or "(none)"),
        ("source digest", config.manifest.source_digest or "(none)")]


def _quantization_rows(q: QuantConfig) -> list[tuple[str, object]]:
    rows = [("mode", q.mode), ("group size", q.group_size), ("lm_head quantized", q.quantize_lm_head),
            ("lm_head dtype", q.lm_head_dtype),
            ("MatMulNBits accuracy_level", q.accuracy_level)] if q.mode is not None else []
    rows += [(f"calibration: {k}", v) for k, v in q.calibration.items()]
    rows += [(f"KV cache: {k}", v) for k, v in q.kv_cache.items() if k not in ("k_scale", "v_scale")]
    rows += [(f"accuracy: {k}", v) for k, v in q.accuracy.items() if k != "chat"] or \
        [("accuracy", "(not measured)")]
    rows += [(f"accuracy on chat: {k}", v) for k, v in q.accuracy.get("chat", {}).items()]
    return rows + _format_rows(q.formats)


def _op_counts(paths: list[Path]) -> dict[str, int]:
    """Nodes by op type over the graphs `paths` together."""
    from engine.builder.onnxruntime_backend import op_counts

    counts: dict[str, int] = {}
    for onnx_path in paths:
        for op, n in op_counts(onnx_path).items():
            counts[op] = counts.get(op, 0) + n
    return counts


def _print_graphs(console: Console, engine_dir: Path, config: EngineConfig) -> None:
    """A table of op counts per rank (rank 0 alone when the ranks share one graph over their shards)."""
    for rank in range(config.mapping.world_size):
        files = _graph_files(config, rank)
        paths = [engine_dir / f for f in files]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            console.print(f"[red]{', '.join(missing[:3])} {'is' if len(missing) == 1 else 'are'} missing[/]")
            continue
        counts = dict(sorted(_op_counts(paths).items(), key=lambda kv: (-kv[1], kv[0])))
        data_files = [p.with_name(p.name + ".data") for p in paths]
        size = sum(d.stat().st_size for d in data_files if d.is_file())
        name = files[0] if len(files) == 1 else f"rank{rank} ({len(files)} segments)"
        table = Table(title=f"{name}: {sum(counts.values())} nodes, weights {size / 2**20:.1f} MiB",
                      title_justify="left")
        table.add_column("op type")
        table.add_column("count", justify="right")
        for op, n in counts.items():
            table.add_row(op, str(n))
        console.print(table)
        if rank == 0 and config.mapping.world_size > 1:
            console.print(f"(ranks 1..{config.mapping.world_size - 1} have the same graph over their shards)")
            break


def _format_rows(formats: dict[str, str]) -> list[tuple[str, str]]:
    """--dtype gguf's kept tensors by kind, a projection's layers listed once: ("Q6_K", "lm_head; mlp.down in
    layers 0, 3, 6; ...")."""
    by_kind: dict[str, dict[str, list[str]]] = {}
    for name, kind in formats.items():
        parts = name.removesuffix(".weight").split(".")
        layer, stem = (parts[1], ".".join(parts[2:])) if parts[0] == "layers" else (None, ".".join(parts))
        by_kind.setdefault(kind, {}).setdefault(stem, []).extend([layer] if layer is not None else [])
    rows = []
    for kind, stems in sorted(by_kind.items()):
        what = [stem + (f" in layers {', '.join(sorted(layers, key=int))}" if layers else "")
                for stem, layers in sorted(stems.items())]
        rows.append((f"kept as {kind}", "; ".join(what)))
    return rows
