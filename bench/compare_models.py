"""The models the side-by-side benchmark needs, made on first use and cached (bench/compare.py).

    the GGUF and its float32 HF dir   bench/real_models.py (`engine download`'s cache; CACHE/hf/<model>)
    CACHE/ckpt                  engine convert --model-dir HF_DIR (SmolLM2: --gguf GGUF when there is no HF dir;
                                the GGUF models: always --gguf, which keeps the file's blocks)
    CACHE/engines/<variant>     engine build --dtype ... (BUILD_FLAGS)
    CACHE/ortgenai-<version>/<precision>   onnxruntime-genai's model builder on the HF dir, -e cpu, as the
                                anchors' build_ortgenai.sh did (bench/anchors)
    CACHE/<gguf stem>.Q8_0.gguf  llama.cpp's own quantizer (llama_model_quantize, requantizing) on the Q4_1 GGUF:
                                the int8 peer of the engine's int8_wo, the same weights on an 8-bit grid

CACHE is --cache-dir for SmolLM2 (the layout it always had) and --cache-dir/<model> for the others.
Engines are rebuilt when they no longer load (another engine or onnxruntime version), or when a source file of
the toolchain (core, recipes, quantization, plugins, builder) is newer than the engine, so a rerun after a code
change never measures a stale engine. Builds other than the timed one skip the build's accuracy report
(--eval-tokens 0): it does not change the engine, only the time the build takes.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench import real_models

ROOT = Path(__file__).resolve().parent.parent
TOOLCHAIN_DIRS = ("core", "recipes", "quantization", "plugins", "builder")

# name -> (engine build flags, what the weights are)
ENGINE_VARIANTS: dict[str, tuple[list[str], str]] = {
    "fp32": (["--dtype", "float32"], "float32"),
    "int8": (["--dtype", "int8_wo"], "int8_wo g32 (defaults: lm_head int8 Q8_0, KV cache float16)"),
    "int8-lmbf16": (["--dtype", "int8_wo", "--lm-head-dtype", "bfloat16"],
                    "int8_wo g32, lm_head bf16, KV cache float16"),
    "int4": (["--dtype", "int4_wo"], "int4_wo g32, Q4_1 blocks kept (defaults: lm_head int8 Q8_0, KV cache float16)"),
    "int4-lmbf16": (["--dtype", "int4_wo", "--lm-head-dtype", "bfloat16"],
                    "int4_wo g32, Q4_1 blocks kept, lm_head bf16, KV cache float16"),
    "int8-lm32-kv32": (["--dtype", "int8_wo", "--lm-head-dtype", "float32", "--kv-cache-dtype", "float32"],
                       "int8_wo g32, lm_head fp32, KV cache float32"),
    "int4-lm32-kv32": (["--dtype", "int4_wo", "--lm-head-dtype", "float32", "--kv-cache-dtype", "float32"],
                       "int4_wo g32, Q4_1 blocks kept, lm_head fp32, KV cache float32"),
    "int8-lmq": (["--dtype", "int8_wo", "--quantize-lm-head", "--kv-cache-dtype", "float32"],
                 "int8_wo + lm_head int8, KV cache float32"),
    "int4-lmq": (["--dtype", "int4_wo", "--quantize-lm-head", "--kv-cache-dtype", "float32"],
                 "int4_wo g32, Q4_1 blocks kept + lm_head int4 (RTN), KV cache float32"),
    "int8-lmq-kv8": (["--dtype", "int8_wo", "--quantize-lm-head", "--kv-cache-dtype", "int8"],
                     "int8_wo + lm_head int8, KV cache int8"),
    "int4-lmq-kv8": (["--dtype", "int4_wo", "--quantize-lm-head", "--kv-cache-dtype", "int8"],
                     "int4_wo g32, Q4_1 blocks kept + lm_head int4, KV cache int8"),
    "fp32-kv16": (["--dtype", "float32", "--kv-cache-dtype", "float16"], "float32, KV cache float16"),
    "int8-lmq-kv16": (["--dtype", "int8_wo", "--quantize-lm-head", "--kv-cache-dtype", "float16"],
                      "int8_wo + lm_head int8, KV cache float16"),
    "int4-lmq-kv16": (["--dtype", "int4_wo", "--quantize-lm-head", "--kv-cache-dtype", "float16"],
                      "int4_wo g32, Q4_1 blocks kept + lm_head int4, KV cache float16"),
}
# the GGUF models' builds: the file's blocks kept exactly, and the engine's own int4 of the same weights
GGUF_VARIANTS: dict[str, tuple[list[str], str]] = {
    "gguf": (["--dtype", "gguf"], "the GGUF's blocks kept exactly (defaults: KV cache float16)"),
    "int4": (["--dtype", "int4_wo"], "int4_wo g32 of the dequantized weights (defaults: lm_head int8 Q8_0, "
                                     "KV cache float16)"),
}
BUILD_FLAGS = {**ENGINE_VARIANTS, **GGUF_VARIANTS}
ORTGENAI_PRECISIONS = ("int4", "int8", "fp32")
NO_LLAMA = ("llama-cpp-python is not installed (it compiles for ~10 minutes: pip install llama-cpp-python; where the "
            "CPU has AMX build it with AMX off, as bench/anchors/build_llamacpp.sh does, or set LLAMA_CPP_LIB_PATH)")
TIMED_BUILD_VARIANT = "int8"


def relative(path: Path) -> str:
    """`path` from the repository root where it lies below it: results name no machine's absolute paths."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def engine_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "engine.cli", *args]


def source_models(cache: Path) -> tuple[Path, Path | None, str]:
    """SmolLM2's (GGUF file, HF dir or None, why there is no HF dir)."""
    gguf = real_models.gguf("smollm2")
    try:
        import transformers  # noqa: F401  (the HF dir is made by transformers from the GGUF)
    except ImportError:
        cached = cache / "hf" / "smollm2"
        if (cached / "config.json").is_file():
            return gguf, cached, ""
        return gguf, None, "transformers is not installed (pip install -e '.[gguf]')"
    return gguf, real_models.hf_dir("smollm2", cache), ""


def _newest_source_mtime() -> float:
    return max(p.stat().st_mtime for d in TOOLCHAIN_DIRS for p in (ROOT / d).rglob("*.py"))


def _usable(out: Path, engine: bool, keep: bool) -> bool:
    """Loads with this installation and, unless `keep`, is newer than every toolchain source file."""
    cfg = out / "config.json"
    if not cfg.is_file() or (not keep and cfg.stat().st_mtime < _newest_source_mtime()):
        return False
    if not engine:
        return True
    from engine.core.errors import EngineError
    from engine.runtime.engine_dir import load_engine_config
    try:
        load_engine_config(out)
    except EngineError:
        return False
    return True


def _run(cmd: list[str], log: Path, cwd: Path = ROOT, env: dict | None = None) -> float:
    """Run a build command, its output appended to `log`; seconds of wall time. Raises on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env).returncode
    seconds = time.perf_counter() - t0
    if rc:
        raise RuntimeError(f"`{' '.join(cmd)}` failed with exit status {rc}; see {log}")
    return seconds


def convert(cache: Path, source: Path) -> float:
    """`engine convert` of an HF dir, or of a GGUF file."""
    flag = "--model-dir" if source.is_dir() else "--gguf"
    return _run(engine_cli("convert", flag, str(source), "--output-dir", str(cache / "ckpt"), "--force"),
                cache / "build.log")


def build(cache: Path, variant: str, *, timed: bool = False) -> float:
    flags, _ = BUILD_FLAGS[variant]
    extra = [] if timed else ["--eval-tokens", "0"]
    cmd = engine_cli("build", "--checkpoint-dir", str(cache / "ckpt"), "--output-dir", str(cache / "engines" / variant),
                     *flags, *extra, "--force")
    if not timed:
        return _run(cmd, cache / "build.log")
    with tempfile.TemporaryDirectory() as fresh:   # an empty kernel cache: the library compiles, as on a new machine
        return _run(cmd, cache / "build.log", env={**os.environ, "ENGINE_CACHE_DIR": fresh})


def timed_convert_build(cache: Path, source: Path) -> dict:
    """The build goal as a user meets it on a new machine: `engine convert` then `engine build --dtype int8_wo` with
    its defaults (accuracy report included) and an empty kernel cache (plugins/native.py compiles the library),
    each a fresh process, wall clock."""
    c = convert(cache, source)
    b = build(cache, TIMED_BUILD_VARIANT, timed=True)
    _CHECKED.update({cache / "ckpt", cache / "engines" / TIMED_BUILD_VARIANT})
    return {"convert_s": round(c, 2), "build_s": round(b, 2), "total_s": round(c + b, 2),
            "variant": TIMED_BUILD_VARIANT, "source": source.name, "fresh_kernels": True}


_CHECKED: set[Path] = set()   # engines checked or built by this process: one run measures one build of each


def ensure_engine(cache: Path, source: Path, variant: str, *, rebuild: bool = False, keep: bool = False) -> Path:
    """The engine of `variant`, (re)built when `rebuild`, when it does not load, or (unless `keep`) when older
    than the toolchain's sources; checked once per process, so every step of a run uses the same build."""
    out = cache / "engines" / variant
    if out in _CHECKED:
        return out
    _CHECKED.add(out)
    if rebuild or not _usable(out, engine=True, keep=keep):
        ensure_ckpt(cache, source, rebuild=rebuild, keep=keep)
        print(f"  building engine {variant} -> {out}", flush=True)
        build(cache, variant)
    return out


def ensure_ckpt(cache: Path, source: Path, *, rebuild: bool = False, keep: bool = False) -> Path:
    """`engine convert` of `source` into CACHE/ckpt, made again when `rebuild` or (unless `keep`) when older than
    the toolchain's sources; checked once per process."""
    ckpt = cache / "ckpt"
    if ckpt not in _CHECKED:
        _CHECKED.add(ckpt)
        if rebuild or not _usable(ckpt, engine=False, keep=keep):
            print(f"  converting {source.name} -> {ckpt}", flush=True)
            convert(cache, source)
    return ckpt


def ensure_ortgenai(cache: Path, hf_dir: Path | Callable[[], Path], precision: str, version: str) -> Path:
    """onnxruntime-genai's model of `precision`, built from the HF dir when not cached; `hf_dir` may be a function
    that makes the dir, called only then."""
    root = cache / f"ortgenai-{version}"
    out = root / precision
    if not (out / "genai_config.json").is_file():
        hf_dir = hf_dir() if callable(hf_dir) else hf_dir
        print(f"  building onnxruntime-genai {precision} -> {out}", flush=True)
        tmp = root / f".{precision}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        # Not from the repository root: the builder imports its own top-level `quantization` module, which our
        # quantization/ package would shadow there.
        _run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(tmp),
              "-p", precision, "-e", "cpu", "-c", str(root / "hf_cache")], root / "build.log", cwd=root)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


_QUANTIZE_Q8_0 = """
import ctypes, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
p.allow_requantize = True
p.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def llamacpp_q8_0(cache: Path, gguf: Path) -> Path:
    """Where the Q8_0 GGUF of `gguf`'s weights is cached."""
    return cache / f"{gguf.stem.rsplit('.', 1)[0]}.Q8_0.gguf"


def ensure_gguf(cache: Path, gguf: Path, wanted: Path) -> Path:
    """`wanted`, made first when it is llamacpp_q8_0(cache, gguf): by llama.cpp itself, in a process of its own
    (the quantizer prints a line per tensor), into a temporary file renamed when complete."""
    if wanted != llamacpp_q8_0(cache, gguf) or wanted.is_file():
        return wanted
    cache.mkdir(parents=True, exist_ok=True)
    tmp = wanted.with_suffix(".tmp")
    _run([sys.executable, "-c", _QUANTIZE_Q8_0, str(gguf), str(tmp)], cache / "llamacpp-quantize.log")
    tmp.rename(wanted)
    return wanted
