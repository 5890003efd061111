"""Qwen2.5-Coder-0.5B-Instruct from its Q4_K_M GGUF file (Q5_0, Q8_0, Q4_K and Q6_K tensors): the checkpoint keeps
the file's blocks (no float copy, about the file's size), `--dtype gguf` runs every one of them in its own kind
within 1.1x the file's size, its accuracy report stays within 1% perplexity of the float32 engine of the same
weights, and it writes the code it is asked for.

Measured (this machine, the build's sampled text, 2040 tokens): perplexity 2.101 -> 2.111 (+0.45%); the engine is
1.07x the file. The float32 engine is the reference of the report, built from the same checkpoint.
"""
from __future__ import annotations

import pytest

from engine.builder.build import build_engine
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.core.model_config import QuantConfig
from engine.plugins import native
from engine.quantization.accuracy import AccuracyOptions
from engine.recipes.convert import ConvertConfig, convert
from engine.recipes.gguf_source import GGUFSource
from engine.runtime import LLM, SamplingParams
from engine.runtime.engine_dir import load_engine_config
from tests import real_model

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not native.has_int8_dot(), reason="--dtype gguf runs on AVX-512 VNNI or AVX2")]

BUILD = BuildConfig(max_batch_size=4, max_input_len=512, max_seq_len=1024, max_num_tokens=512)
KINDS = {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    gguf = real_model.qwen_05b_gguf()
    root = tmp_path_factory.mktemp("qwen05")
    with GGUFSource(gguf) as source:
        convert(source, ConvertConfig(root / "ckpt"))
    build_engine(root / "ckpt", root / "engine", BUILD, PluginConfig(), quant=QuantConfig(mode="gguf"),
                 accuracy=AccuracyOptions(max_ppl_increase=1.0))
    return gguf, root


def _bytes(directory) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.name.startswith("rank0."))


def test_checkpoint_and_engine_are_the_files_size(qwen):
    gguf, root = qwen
    size = gguf.stat().st_size
    assert _bytes(root / "ckpt") <= 1.0 * size
    assert _bytes(root / "engine") <= 1.1 * size


def test_every_quantized_tensor_keeps_its_kind_and_the_report_is_within_target(qwen):
    _, root = qwen
    config = load_engine_config(root / "engine")
    assert set(config.quantization.formats.values()) == KINDS
    # every projection, the embedding and lm_head: 24 layers x (q|k, v, o, gate|up, down) + 2
    assert len(config.quantization.formats) == 24 * 5 + 2
    report = config.quantization.accuracy
    assert report["ppl_increase_pct"] <= 1.0 and report["top1_agreement"] >= 0.97, report
    # the conversations the float32 engine answers itself: the gguf engine predicts its answers' tokens
    assert report["chat"]["top1_agreement"] >= 0.97 and report["chat"]["tokens"] >= 200, report["chat"]


def test_writes_the_function_it_is_asked_for(qwen):
    _, root = qwen
    llm = LLM(root / "engine", max_kv_tokens=4096)
    out = llm.chat([{"role": "user", "content": "Write a Python function is_even(n) that returns whether n is even."}],
                   SamplingParams(temperature=0, max_tokens=160))[0]
    llm.close()
    assert "def is_even(n" in out.text and "% 2" in out.text, out.text
