"""The engine's own ONNX Runtime CPU kernels (plugins/kernels/): compiled on first use, cached, registered.

    library() -> Path        plugins/kernels/*.cc ──g++ -O3 -march=native──▶ $ENGINE_CACHE_DIR/kernels/<digest>/
                             libengine_kernels.so (default cache ~/.cache/engine); compiled once per source digest,
                             compiler and CPU (a source per CPU at once, then linked) in a temporary directory and
                             renamed into place, so concurrent first uses and an interrupted compile never leave a
                             broken library behind. Beside it, libengine_kernels.so.sha256 holds the sha256 the
                             compile wrote; a library that does not match it (damaged, truncated, replaced, or from
                             a cache without one) is compiled again rather than loaded
    register(options)        SessionOptions.register_custom_ops_library(library()): the ops of domain "engine"
    THREADS_ENTRY            the session config entry that gives the kernels their own thread pool

-march=native because the library is compiled on the machine that runs it, like the engine itself
(builder/onnxruntime_backend.py: an engine is built on the kind of machine that runs it). The kernels include ONNX
Runtime's C API header from kernels/third_party/onnxruntime/ (vendored at the version its README gives), by a path
relative to kernels/: no include flag, and the digest covers it like every other file under kernels/.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.core.errors import EngineError

KERNELS = Path(__file__).parent / "kernels"
FLAGS = ["-O3", "-march=native", "-mtune=generic", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
         "-fno-math-errno", "-pthread"]
# never unloaded: the kernels' own pool (kernels/spin_pool.h) keeps threads that run the library's code
LINK_FLAGS = ["-Wl,-z,nodelete"]
COMPILE_TIMEOUT_S = 300
log = logging.getLogger("engine.kernels")


def compiler() -> str:
    """The C++ compiler: $CXX if set, else g++ or c++ on PATH."""
    wanted = os.environ.get("CXX")
    cxx = shutil.which(wanted) if wanted else shutil.which("g++") or shutil.which("c++")
    if not cxx:
        found = f"CXX={wanted!r} is not an executable" if wanted else "no C++ compiler (g++ or c++) is on PATH"
        raise EngineError(f"the engine's own kernels (--engine-kernels-plugin enable, the default) are "
                          f"compiled on first use and {found}: install g++ (Debian: apt-get install g++) or set "
                          "CXX, or build with --engine-kernels-plugin disable")
    return cxx


def _digest(cxx: str) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in KERNELS.rglob("*") if p.is_file()):
        h.update(path.relative_to(KERNELS).as_posix().encode() + b"\0" + path.read_bytes())
    h.update(" ".join([cxx, *FLAGS, *LINK_FLAGS, platform.machine(), _cpu_flags()]).encode())
    return h.hexdigest()[:16]


@functools.cache
def _cpu_flags() -> str:
    """The CPU's feature flags (-march=native depends on them), so a cache shared across machines stays correct."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def has_int8_dot() -> bool:
    """Whether this CPU has the int8 dot products QuantMatMul's tiles are written for (kernels/quant_tiles.h):
    AVX-512 VNNI (with BW), or AVX2's vpmaddubsw (with FMA)."""
    flags = set(_cpu_flags().split())
    return {"avx512_vnni", "avx512bw"} <= flags or {"avx2", "fma"} <= flags


def cache_dir() -> Path:
    return Path(os.environ.get("ENGINE_CACHE_DIR") or Path.home() / ".cache" / "engine") / "kernels"


def library() -> Path:
    cxx = compiler()
    target = cache_dir() / _digest(cxx) / "libengine_kernels.so"
    if _intact(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        objects = _compile_objects(cxx, work)
        tmp = work / target.name
        _run(cxx, [*FLAGS, *LINK_FLAGS, *map(str, objects), "-o", str(tmp)])
        (work / "sha256").write_text(_sha256(tmp) + "\n")
        # the digest first: a library is never in place without the digest it must match
        os.replace(work / "sha256", _digest_path(target))
        os.replace(tmp, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _digest_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()       # a few MiB, read once per session


def _intact(target: Path) -> bool:
    """Whether the cached library exists and matches the digest written when it was compiled (a library is code
    this process will run: its file merely existing does not say it is the one compiled)."""
    if not target.exists():
        return False
    try:
        if _digest_path(target).read_text().strip() == _sha256(target):
            return True
    except OSError:
        pass
    log.warning("%s does not match its digest %s (damaged, replaced, or from an older cache); compiling it again",
                target, _digest_path(target).name)
    return False


def _compile_objects(cxx: str, work: Path) -> list[Path]:
    """Each source compiled to an object in `work`, as many at once as this process may use CPUs (the largest
    first): paged_attention.cc alone takes about half of a serial compile, 14 of 31 s on a 2-core Zen 3."""
    # globbed now, not at import: the digest hashes the files present now, and must name what is compiled
    sources = sorted(KERNELS.glob("*.cc"), key=lambda path: path.stat().st_size, reverse=True)
    objects = [work / (path.stem + ".o") for path in sources]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=cpus) as pool:
        list(pool.map(lambda src, obj: _run(cxx, [*FLAGS, "-c", str(src), "-o", str(obj)]), sources, objects))
    return sorted(objects)


def _run(cxx: str, args: list[str]) -> None:
    try:
        done = subprocess.run([cxx, *args], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EngineError(f"compiling the engine's kernels with {cxx} took over {COMPILE_TIMEOUT_S} s; "
                          "build with --engine-kernels-plugin disable to do without them") from None
    if done.returncode != 0:
        raise EngineError(f"compiling the engine's kernels with {cxx} failed (exit {done.returncode}):\n"
                          f"{done.stderr.strip()[-2000:]}\n"
                          "build with --engine-kernels-plugin disable to do without them")


def register(options) -> None:
    """Add the kernels' custom op domain to ONNX Runtime SessionOptions `options`."""
    options.register_custom_ops_library(str(library()))


# The session config entry that gives the kernels their own pool of that many threads (kernels/ort_abi.h
# kThreadsEntry); kernels read it through KernelInfo_GetConfigEntries, which ONNX Runtime has since 1.24.
THREADS_ENTRY = "engine.kernel_threads"
OWN_POOL_ORT = (1, 24)


def own_pool_supported(ort_version: str) -> bool:
    return tuple(int(p) for p in ort_version.split(".")[:2]) >= OWN_POOL_ORT


def default_threads() -> int:
    """The cores this process may run on, hyper-thread siblings counted once: ONNX Runtime's default intra-op
    pool size, and so the own pool's when no thread count is given."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return len(cores)
