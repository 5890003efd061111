"""What bench/compare.py records of the machine it runs on and of the packages it measures."""
from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = ("engine", "onnxruntime", "onnxruntime-genai", "onnx", "numpy", "torch", "transformers",
            "llama-cpp-python", "tokenizers")


def installed(module: str) -> str:
    """The distribution version of a peer, "" when it is not importable."""
    import importlib.util
    if importlib.util.find_spec(module) is None:
        return ""
    dist = {"onnxruntime_genai": "onnxruntime-genai", "llama_cpp": "llama-cpp-python"}.get(module, module)
    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def machine() -> dict:
    info = {"host": platform.node(), "kernel": platform.release(), "python": platform.python_version(),
            "logical_cpus": os.cpu_count()}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        for line in cpuinfo.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                info["isa"] = " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
                                                   "amx_int8", "amx_bf16") if f in flags)
                break
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()
        info["memory_GiB"] = round(int(mem[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def versions() -> dict:
    out = {}
    for p in PACKAGES:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out
