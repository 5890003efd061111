"""Perplexity (runtime/perplexity.py) against transformers, the build's accuracy report and its gate, and the
`engine eval` / `engine build --dtype` / `engine inspect` commands on quantized tiny engines."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from engine.builder.build import build_engine
from engine.core.errors import EngineError
from engine.core.model_config import QuantConfig
from engine.quantization.accuracy import AccuracyOptions
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.perplexity import ScoringSession, perplexity, sample_tokens, split_windows
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD, prompts
from tests.builder.test_engine_dir import cli
from tests.tiny_models import _CORPUS

LLAMA = "LlamaForCausalLM"
TIED = "LlamaForCausalLM:llama3-rope-tied"


def test_perplexity_matches_transformers(tiny):
    ids = prompts(1, (70,), seed=5)[0]
    windows = split_windows(ids, 32)                       # 32 + 32 + 6 tokens
    result = perplexity(tiny.engine(LLAMA), windows)
    model = tiny.hf_model(LLAMA)
    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logp = torch.log_softmax(model(torch.tensor([w])).logits[0, :-1].double(), dim=-1)
            total -= float(logp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum())
            count += len(w) - 1
    assert result.tokens == count == 70 - 3 and result.windows == 3
    assert result.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)


def test_scoring_logits_equal_the_session_last_token_logits(tiny):
    ids = prompts(1, (23,), seed=6)[0]
    engine = tiny.engine(TIED)
    every = ScoringSession(engine, 32).logits(ids)
    session = EngineSession(engine, num_blocks=16)
    for n in (1, 9, 23):
        last = session.run([SeqChunk(ids[:n], 0, list(range(8)), True)])[0]
        np.testing.assert_allclose(every[n - 1], last, atol=1e-4)


def test_sampling_is_seeded(tiny):
    engine = tiny.engine(LLAMA)
    a = sample_tokens(engine, sequences=3, length=20, seed=1, start_token=1)
    assert a == sample_tokens(engine, sequences=3, length=20, seed=1, start_token=1)
    assert a != sample_tokens(engine, sequences=3, length=20, seed=2, start_token=1)
    assert [len(s) for s in a] == [20] * 3 and all(s[0] == 1 for s in a)
    assert len({tuple(s) for s in a}) == 3


def test_report_and_gate(tiny, tmp_path):
    ckpt = tiny.checkpoint(TIED)
    quant = QuantConfig(mode="int4_wo", quantize_lm_head=True)
    opts = AccuracyOptions(eval_tokens=256, window=64)
    config = build_engine(ckpt, tmp_path / "a", TEST_BUILD, ALL_PLUGINS, quant=quant, accuracy=opts)
    report = load_engine_config(tmp_path / "a").quantization.accuracy
    assert report == config.quantization.accuracy
    assert report["data"].startswith("sampled from the reference engine")
    assert report["tokens"] == 4 * 63 and report["windows"] == 4
    assert 1 < report["reference_ppl"] < 2 * 512 and 1 < report["quantized_ppl"] < 2 * 512
    increase = report["ppl_increase_pct"]
    assert increase == pytest.approx(100 * (report["quantized_ppl"] / report["reference_ppl"] - 1), abs=2e-3)
    # the same build (deterministic: seeded text, same weights) under a limit below its increase fails whole
    assert increase > 0.05, "precondition: int4 with a quantized tied lm_head raises this model's perplexity"
    with pytest.raises(EngineError, match="over --max-ppl-increase"):
        build_engine(ckpt, tmp_path / "b", TEST_BUILD, ALL_PLUGINS, quant=quant,
                     accuracy=AccuracyOptions(eval_tokens=256, window=64, max_ppl_increase=increase - 0.05))
    assert not (tmp_path / "b").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temporary left behind
    build_engine(ckpt, tmp_path / "c", TEST_BUILD, ALL_PLUGINS, quant=quant,
                 accuracy=AccuracyOptions(eval_tokens=256, window=64, max_ppl_increase=increase + 0.05))
    assert (tmp_path / "c" / "rank0.onnx").is_file()


def test_report_on_a_text_file(tiny, tmp_path):
    text = tmp_path / "held_out.txt"
    text.write_text(_CORPUS, encoding="utf-8")
    build_engine(tiny.checkpoint(LLAMA), tmp_path / "e", TEST_BUILD, ALL_PLUGINS, quant=QuantConfig(mode="int8_wo"),
                 accuracy=AccuracyOptions(eval_data=text, eval_tokens=100, window=40))
    report = load_engine_config(tmp_path / "e").quantization.accuracy
    assert report["data"] == f"file {text}"
    assert (report["tokens"], report["windows"]) == (39 + 39 + 19, 3)
    assert abs(report["ppl_increase_pct"]) < 5


def test_eval_command(tiny, tmp_path, monkeypatch, capsys):
    text = tmp_path / "t.txt"
    text.write_text(_CORPUS[:600], encoding="utf-8")
    engine = tiny.engine(LLAMA)
    code, out, err = cli(monkeypatch, capsys, "eval", "--engine-dir", str(engine), "--data", str(text),
                         "--window", "48", "--json")
    assert code == 0, err
    result = json.loads(out)
    from engine.runtime.tokenizer import Tokenizer
    expected = perplexity(engine, split_windows(Tokenizer(engine).encode(_CORPUS[:600]), 48))
    assert result["perplexity"] == pytest.approx(expected.perplexity, rel=1e-6)
    assert result["tokens"] == expected.tokens and result["window"] == 48
    code, _, err = cli(monkeypatch, capsys, "eval", "--engine-dir", str(engine), "--data", str(text),
                       "--window", "100000")
    assert code == 2 and "--window 100000 must be between 2 and 128" in " ".join(err.split())
    code, _, err = cli(monkeypatch, capsys, "eval", "--engine-dir", str(engine), "--data", str(tmp_path / "no"))
    assert code == 2 and "is not a file" in err


def test_build_and_inspect_commands(tiny, tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "engine"
    code, out, err = cli(monkeypatch, capsys, "build", "--checkpoint-dir", str(tiny.checkpoint(TIED)),
                         "--output-dir", str(out_dir), "--dtype", "int4_wo", "--group-size", "16",
                         "--quantize-lm-head", "--eval-tokens", "64", "--max-seq-len", "64")
    assert code == 0, err
    assert "accuracy (int4_wo + float16 KV cache): perplexity" in out   # float16: a quantized build's default
    config = load_engine_config(out_dir)
    assert config.build.kv_cache_dtype == "float16"
    assert (config.quantization.group_size, config.quantization.quantize_lm_head) == (16, True)
    assert config.build.dtype == "float32" and "int4 weight-only" in config.precision["weights"]
    code, out, err = cli(monkeypatch, capsys, "inspect", "--engine-dir", str(out_dir))
    assert code == 0, err
    assert "com.microsoft.MatMulNBits" in out and "com.microsoft.GatherBlockQuantized" in out
    assert "quantization" in out and "accuracy: quantized_ppl" in out
