"""The real SmolLM2-135M-Instruct end to end: convert -> build -> run, checked against transformers.

The checkpoint is converted from the HF directory transformers makes from the shipped GGUF (tests/recipes/
test_gguf.py proves `convert --gguf` gives the identical checkpoint).
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine.builder.build import build_engine
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.runtime import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Photosynthesis is the process by which plants",
]


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_checkpoint, tmp_path_factory):
    engine = tmp_path_factory.mktemp("smollm2") / "engine"
    build = BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=1024, max_num_tokens=1024)
    build_engine(smollm2_checkpoint, engine, build, PluginConfig())
    return engine


def test_run_chat_answers_the_capital_of_france(smollm2_engine):
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "run", "--engine-dir", str(smollm2_engine), "--chat",
         "--input-text", "What is the capital of France?", "--max-output-len", "32", "--max-kv-tokens", "4096"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout, result.stdout


def test_greedy_tokens_equal_transformers_for_64_tokens(smollm2_engine, smollm2_hf_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(smollm2_engine, max_kv_tokens=8192)
    prompts_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outputs = llm.generate(prompts_ids, params)  # all four together: continuous batching
    llm.check_all_free()
    llm.close()

    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    for ids, out in zip(prompts_ids, outputs):
        ref = _hf_greedy(model, ids, 64)
        assert list(out.token_ids) == ref, f"prompt {ids[:8]}...: engine {out.token_ids} != transformers {ref}"


@torch.no_grad()
def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with transformers' KV cache; unlike generate(min_new_tokens=...), eos is not
    suppressed, which is what the engine's ignore_eos means."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(n):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens
