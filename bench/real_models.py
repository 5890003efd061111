"""The real models the benchmarks run, by the short name `--model` takes, and where their files come from.

    NAME                 engine download NAME                    the HF dir (transformers, float32 dequantized)
    smollm2              smollm2-135m-instruct-q4_1               CACHE/hf/smollm2
    qwen2.5-coder-0.5b   qwen2.5-coder-0.5b-instruct-q4_k_m       CACHE/hf/qwen2.5-coder-0.5b
    qwen2.5-coder-1.5b   qwen2.5-coder-1.5b-instruct-q4_k_m       CACHE/hf/qwen2.5-coder-1.5b

The GGUF is fetched and cached by the engine's own `engine download` (engine.recipes.models.fetch: its cache,
$ENGINE_MODEL_CACHE or ~/.cache/engine/models); the HF dir is made of it by engine.recipes.gguf_reference, so
every system has the same weights. CACHE is the benchmark's cache (default .cache/bench).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = ROOT / ".cache" / "bench"

# --model NAME -> the name `engine download` knows
DOWNLOAD_NAMES = {
    "smollm2": "smollm2-135m-instruct-q4_1",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m",
}


def gguf(model: str) -> Path:
    """The model's GGUF file, downloaded on first use."""
    from engine.recipes.models import fetch
    return fetch(DOWNLOAD_NAMES[model])


def hf_dir(model: str, cache: Path = DEFAULT_CACHE) -> Path:
    """The float32 HF checkpoint of the model's GGUF, made on first use (needs transformers) in a process of its
    own, its output in CACHE/hf/<model>.log: the caller does not import torch nor keep the dequantized weights'
    memory (a 1.5B model's are 6 GB), which every process it starts afterwards would count in its ru_maxrss."""
    out = Path(cache) / "hf" / model
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{model}.log"
    make = "import sys; from engine.recipes.gguf_reference import hf_checkpoint; hf_checkpoint(*sys.argv[1:])"
    print(f"  making the HF checkpoint of {model} -> {out}", flush=True)
    with open(log, "a") as f:
        rc = subprocess.run([sys.executable, "-c", make, str(gguf(model)), str(out)], stdout=f,
                            stderr=subprocess.STDOUT).returncode
    if rc:
        raise RuntimeError(f"making the HF checkpoint of {model} failed with exit status {rc}; see {log}")
    return out
