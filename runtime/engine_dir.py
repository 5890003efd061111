"""Loading and checking an engine directory: config.json, the rank files, and the versions it was built with.

An engine is tied to what built it: the ONNX Runtime version that optimized and serialized its graph (ORT's
optimized models are not portable across versions) and the toolchain that wrote config.json. Anything else is
refused with the command that rebuilds it. This module must not import builder/ or recipes/.
"""
from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from engine.core.artifacts import check_format
from engine.core.engine_config import ENGINE_FORMAT, ENGINE_FORMAT_VERSION, EngineConfig, engine_file
from engine.core.errors import EngineError
from engine.core.serde import from_json, read_json

BACKENDS = ("onnxruntime", "tensorrt")
REBUILD = "rebuild it with `engine build --checkpoint-dir CKPT --output-dir {dir} --force` using this installation"


def toolchain_version() -> str:
    try:
        return version("engine")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0+unknown"


def backend_version(backend: str) -> str:
    """The installed version of `backend`'s Python package, "" when it is not installed."""
    try:  # the module, not the distribution: onnxruntime-gpu installs the same `onnxruntime` module
        return importlib.import_module(backend).__version__
    except ImportError:
        return ""


def load_engine_config(engine_dir: Path) -> EngineConfig:
    """config.json of `engine_dir`, checked against this installation; rank files are checked to exist."""
    engine_dir = Path(engine_dir)
    rebuild = REBUILD.format(dir=engine_dir)
    if not engine_dir.is_dir():
        raise EngineError(f"engine directory {engine_dir} does not exist; create it with `engine build`")
    path = engine_dir / "config.json"
    data = read_json(path)
    check_format(data, path, ENGINE_FORMAT, ENGINE_FORMAT_VERSION, rebuild)
    config = from_json(EngineConfig, data, where=str(path))
    backend = config.build.backend
    if backend not in BACKENDS:
        raise EngineError(f"{path}: unknown backend {backend!r} (known: {', '.join(BACKENDS)}); {rebuild}")
    installed = backend_version(backend)
    if not installed:
        raise EngineError(f"{engine_dir} is a {backend} engine but {backend} is not installed; install it "
                          f"(version {config.backend_version}) or {rebuild} for another --backend")
    if installed != config.backend_version:
        raise EngineError(f"{engine_dir} was built with {backend} {config.backend_version} but {installed} is "
                          f"installed; {rebuild}")
    ours = toolchain_version()
    if config.toolchain_version != ours:
        raise EngineError(f"{engine_dir} was built by engine {config.toolchain_version or '(unknown)'}, this is "
                          f"engine {ours}; {rebuild}")
    for rank in range(config.mapping.world_size):
        name = engine_file(rank, backend)
        if not (engine_dir / name).is_file():
            raise EngineError(f"{engine_dir} lacks {name} of its {config.mapping.world_size} ranks; "
                              f"the engine is incomplete: {rebuild}")
    return config


def load_runnable_engine(engine_dir: Path, backend: str) -> EngineConfig:
    """The config of an engine a session of `backend` can run: checked, of that backend, and tp=1."""
    config = load_engine_config(engine_dir)
    if config.build.backend != backend:
        raise EngineError(f"{engine_dir} is a {config.build.backend} engine; this session runs {backend} engines")
    if config.mapping.world_size != 1:
        raise EngineError(f"{engine_dir} is a tp={config.mapping.tp_size} engine; running tensor-parallel engines "
                          "is not supported yet: rebuild with `engine build --tp 1`")
    return config
