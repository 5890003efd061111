"""Loading and checking an engine directory: config.json, its manifest (every file's size and sha256), the rank
files, and the versions it was built with.

An engine is tied to what built it: the ONNX Runtime version that optimized and serialized its graph (ORT's
optimized models are not portable across versions) and the toolchain that wrote config.json. Anything else is
refused with the command that rebuilds it. This module must not import builder/ or recipes/.
"""
from __future__ import annotations

import contextlib
import importlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from engine.core import VERSION
from engine.core.artifacts import check_format
from engine.core.engine_format import ENGINE_FORMAT, ENGINE_FORMAT_VERSION, EngineConfig, rank_files
from engine.core.errors import EngineError
from engine.core.manifest import check_contents, check_sizes
from engine.core.serde import from_json, read_json

BACKENDS = ("onnxruntime", "tensorrt")
REBUILD = "rebuild it with `engine build --checkpoint-dir CKPT --output-dir {dir} --force` using this installation"


def toolchain_version() -> str:
    return VERSION


def backend_version(backend: str) -> str:
    """The installed version of `backend`'s Python package, "" when it is not installed."""
    try:  # the module, not the distribution: onnxruntime-gpu installs the same `onnxruntime` module
        return importlib.import_module(backend).__version__
    except ImportError:
        return ""


def load_engine_config(engine_dir: Path) -> EngineConfig:
    """config.json of `engine_dir`, checked against this installation; the files of its manifest are checked to
    exist with their sizes (cheap); their hashes are checked where they are loaded (`verifying_files`)."""
    engine_dir = Path(engine_dir)
    rebuild = REBUILD.format(dir=engine_dir)
    if not engine_dir.is_dir():
        raise EngineError(f"engine directory {engine_dir} does not exist; create it with `engine build`")
    path = engine_dir / "config.json"
    try:
        data = read_json(path)
    except EngineError as e:
        raise EngineError(f"{e} — {rebuild}") from None
    check_format(data, path, ENGINE_FORMAT, ENGINE_FORMAT_VERSION, rebuild)
    config = from_json(EngineConfig, data, where=str(path))
    _check_limits(config, path, rebuild)
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
        for name in rank_files(rank, backend, config.mapping.tp_size, config.model.num_layers,
                               config.quantization.mode):
            if not (engine_dir / name).is_file():
                raise EngineError(f"{engine_dir} lacks {name} of its {config.mapping.world_size} ranks; "
                                  f"the engine is incomplete: {rebuild}")
    check_sizes(engine_dir, config.manifest, "engine directory", _damaged(engine_dir))
    return config


def _damaged(engine_dir: Path) -> str:
    return (f"it was modified or damaged after `engine build` (copy it again, or {REBUILD.format(dir=engine_dir)}); "
            "`engine verify` checks a copy")


def verify_engine_files(engine_dir: Path, config: EngineConfig) -> None:
    """Hash every file of `engine_dir` against config.json's manifest; EngineError naming the first mismatch."""
    check_contents(engine_dir, config.manifest, "engine directory", _damaged(engine_dir))


@contextlib.contextmanager
def verifying_files(engine_dir: Path, config: EngineConfig) -> Iterator[None]:
    """Hash the engine's files in a thread while the body loads them, and refuse the engine at the end on a mismatch.

    Hashing SmolLM2's 540 MB of float32 weights takes ~0.3-0.5 s of one core (sha256 through OpenSSL releases the
    GIL); ONNX Runtime's session creation takes about as long, so the two overlap and a strict check costs little
    of `engine run`'s cold start. A mismatch wins over an error of the body (a damaged file often makes the
    backend fail first, with a message that does not say why).
    """
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-verify") as pool:
        check = pool.submit(verify_engine_files, engine_dir, config)
        try:
            yield
        except BaseException:
            if check.exception() is not None:
                raise check.exception() from None
            raise
        check.result()


def _check_limits(config: EngineConfig, path: Path, rebuild: str) -> None:
    """The build limits and mapping the runtime sizes everything from: a zero or negative one (a hand-edited or
    corrupt config.json) would divide by zero or allocate nonsense far from here."""
    b, m = config.build, config.mapping
    for name in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens", "tokens_per_block", "tp_size"):
        if getattr(b, name) < 1:
            raise EngineError(f"{path}: build.{name} {getattr(b, name)} must be at least 1; the file is corrupt — "
                              f"{rebuild}")
    if b.tokens_per_block & (b.tokens_per_block - 1) or b.max_input_len > b.max_seq_len:
        raise EngineError(f"{path}: build limits tokens_per_block {b.tokens_per_block} (a power of two), "
                          f"max_input_len {b.max_input_len} <= max_seq_len {b.max_seq_len} do not hold; the file is "
                          f"corrupt — {rebuild}")
    if min(m.world_size, m.tp_size, m.pp_size) < 1 or m.world_size != m.tp_size * m.pp_size or m.tp_size != b.tp_size:
        raise EngineError(f"{path}: mapping {m} does not match build.tp_size {b.tp_size}; the file is corrupt — "
                          f"{rebuild}")


def load_runnable_engine(engine_dir: Path, backend: str) -> EngineConfig:
    """The config of an engine a session of `backend` can run: checked, of that backend, and tp=1."""
    config = load_engine_config(engine_dir)
    if config.build.backend != backend:
        raise EngineError(f"{engine_dir} is a {config.build.backend} engine; this session runs {backend} engines")
    if config.mapping.world_size != 1:
        raise EngineError(f"{engine_dir} is a tp={config.mapping.tp_size} engine: it runs with one process per rank "
                          "(LLM, `engine run`, `engine serve`), not in one session")
    return config
