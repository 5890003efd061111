"""`--config FILE`: a command's flags in a YAML or JSON file; flags given on the command line win.

    # build.yaml                         engine build --config build.yaml --checkpoint-dir CKPT --output-dir ENGINE
    dtype: int4_wo                       precedence: command line > file > built-in default
    max_batch_size: 8
    max-seq-len: 2048                    keys are the flag names, with '-' or '_'

The file's values become click's `default_map` for the command, so each one is converted and checked by the same
code as the flag on the command line, and a flag given there simply overrides it. Relative paths in the file are
relative to the working directory, as on the command line. An engine's config.json is accepted too: its
`build_flags` (the flags it was built with) are read, so `engine build --config ENGINE/config.json` rebuilds it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from engine.core.errors import EngineError
from engine.core.serde import read_json

_META = "engine.flags_file"  # ctx.meta key: the file the defaults came from


def read_flags_file(path: Path) -> dict:
    """The flags in `path` (YAML by suffix .yaml/.yml, else JSON) as {parameter name: value}."""
    if not path.is_file():
        raise EngineError(f"--config {path} is not a file; pass a YAML or JSON file of flags", usage=True)
    if path.suffix in (".yaml", ".yml"):
        import yaml
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise EngineError(f"cannot read --config {path}: {e}") from None
        except yaml.YAMLError as e:
            raise EngineError(f"--config {path} is not valid YAML: {' '.join(str(e).split())}", usage=True) from None
        data = {} if data is None else data
    else:
        data = read_json(path)
    if not isinstance(data, dict):
        raise EngineError(f"--config {path} holds a {type(data).__name__}; it must map flag names to values, e.g. "
                          "`max_batch_size: 8`", usage=True)
    if data.get("format") == "engine":  # an engine's config.json: the flags it was built with
        data = data.get("build_flags")
        if not data or not isinstance(data, dict):
            raise EngineError(f"--config {path} is an engine's config.json without build_flags (it was built from "
                              "Python, not `engine build`); pass a YAML or JSON file of flags", usage=True)
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _apply(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Path]) -> Optional[Path]:
    if value is None:
        return value
    # a key is a flag's name (max_seq_len for --max-seq-len, json for --json) or its parameter's name
    names = {}
    for p in ctx.command.params:
        if p.name and p.name != param.name:
            names[p.name] = p.name
            for opt in p.opts:
                names[opt.lstrip("-").replace("-", "_")] = p.name
    flags = read_flags_file(value)
    unknown = sorted(set(flags) - set(names))
    if unknown:
        known = sorted({o.lstrip("-").replace("-", "_") for p in ctx.command.params if p.name != param.name
                        for o in p.opts})
        raise EngineError(f"--config {value}: unknown flags {unknown} for `{ctx.command_path}`; known: "
                          f"{', '.join(known)}", usage=True)
    ctx.default_map = {**(ctx.default_map or {}), **{names[k]: v for k, v in flags.items()}}
    ctx.meta[_META] = value
    return value


def origin(error: Exception) -> str:
    """" (set in --config FILE)" when the bad value a click error reports came from the config file, else ""."""
    ctx, param = getattr(error, "ctx", None), getattr(error, "param", None)
    if ctx is None or param is None or _META not in ctx.meta:
        return ""
    source = ctx.get_parameter_source(param.name)
    return f" (set in --config {ctx.meta[_META]})" if source is not None and source.name == "DEFAULT_MAP" else ""


CONFIG = typer.Option(None, "--config", is_eager=True, callback=_apply, show_default="none",
                      help="YAML or JSON file of flags (keys are flag names, e.g. max_batch_size: 8); flags on the "
                      "command line override it. An engine's config.json gives the flags it was built with.")


# Where the inputs and outputs go, and how results are shown: not part of what is built.
NOT_RECORDED = ("config_file", "checkpoint_dir", "output_dir", "force", "dry_run", "as_json", "no_progress")


def recorded_flags(ctx: typer.Context) -> dict:
    """Every flag of the command as resolved (command line > --config file > default), for the artifact's
    config.json; paths as the strings given."""
    return {name: str(value) if isinstance(value, Path) else value
            for name, value in sorted(ctx.params.items()) if name not in NOT_RECORDED}
