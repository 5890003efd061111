"""`engine serve`'s flags for several engines behind one server (runtime/server/models.py), parsed into ModelSpecs.

    engine serve --engine-dir ENGINE                                  one model, named by --served-model-name
    engine serve --engine-dir smol=ENGINES/smol --engine-dir ENGINES/qwen   several: NAME=PATH, or the dir's name
    engine serve --models-dir ENGINES [--models-max 2] [--pin smol] [--unload-idle-seconds 600]

The first model given (the first --engine-dir, else --models-dir's first subdirectory by name) is the default:
what a request without `model` gets, and what loads at start when nothing is pinned.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from engine.core.errors import EngineError

ENGINE_DIRS = typer.Option(None, "--engine-dir", metavar="[NAME=]PATH", help="Engine directory made by `engine "
                           "build`; repeat it to serve several, each as NAME=PATH or PATH (named by the directory's "
                           "name).")
MODELS_DIR = typer.Option(None, "--models-dir", metavar="DIR", help="Serve every engine directory under DIR (a "
                          "subdirectory holding config.json), named by its subdirectory's name.")
MODELS_MAX = typer.Option(None, "--models-max", help="Most engines loaded at once; the least recently used idle one "
                          "is unloaded to load another (default: no cap).")
PIN = typer.Option(None, "--pin", metavar="NAME", help="A model loaded at start and never unloaded (repeatable).")
UNLOAD_IDLE = typer.Option(None, "--unload-idle-seconds", help="Unload an unpinned model after this many seconds "
                           "without requests (default: never).")


def model_specs(engine_dirs: Optional[list[str]], models_dir: Optional[Path], served_model_name: Optional[str]):
    """The served models, the default first; a usage error when none is given, a name repeats or
    --served-model-name is ambiguous."""
    from engine.runtime.server.config import ModelSpec

    specs = [_engine_dir_spec(v, ModelSpec) for v in engine_dirs or []]
    if models_dir is not None:
        specs += _models_dir_specs(models_dir, ModelSpec)
    if not specs:
        raise EngineError("give the engine to serve with --engine-dir ENGINE (or --models-dir DIR)", usage=True)
    if served_model_name is not None:
        if len(specs) > 1:
            raise EngineError("--served-model-name names a server's only engine; with several, name each with "
                              "--engine-dir NAME=PATH (--models-dir names them by their directories)", usage=True)
        specs[0] = ModelSpec(served_model_name, specs[0].engine_dir)
    return specs


def _engine_dir_spec(value: str, ModelSpec):
    name, sep, path = value.partition("=")
    if sep and name and "/" not in name and not Path(value).exists():
        return ModelSpec(name, Path(path))
    return ModelSpec(Path(value).resolve().name, Path(value))


def _models_dir_specs(models_dir: Path, ModelSpec):
    if not models_dir.is_dir():
        raise EngineError(f"--models-dir {models_dir} is not a directory; give the directory holding the engine "
                          "directories", usage=True)
    found = [ModelSpec(d.name, d) for d in sorted(models_dir.iterdir()) if (d / "config.json").is_file()]
    if not found:
        raise EngineError(f"--models-dir {models_dir} holds no engine (no subdirectory with a config.json); build "
                          "them with `engine build --output-dir DIR/NAME`", usage=True)
    return found


def check_one_engine(specs, *, ray: bool = False, distributed=None, speculation=None) -> None:
    """Paths that serve one engine refuse several, naming the flag."""
    if len(specs) == 1:
        return
    names = ", ".join(s.name for s in specs)
    if ray:
        raise EngineError(f"--ray serves one engine; {len(specs)} were given ({names}): run one Ray deployment per "
                          "model", usage=True)
    if distributed is not None and not distributed.spawn:
        raise EngineError(f"a tensor-parallel server started by torchrun serves one engine; {len(specs)} were given "
                          f"({names})", usage=True)
    if speculation is not None and speculation.draft_engine_dir is not None:
        raise EngineError("--draft-engine-dir drafts for one engine; serve several without --speculative draft "
                          "(--speculative ngram works for every model)", usage=True)
