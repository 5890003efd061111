"""LoRA through the CLI: `engine build --lora-target-modules`, `engine run --lora ADAPTER` giving the Python API's
tokens with that adapter, and one-line errors for bad LoRA flags."""
import json
import subprocess

import pytest

from engine.runtime import LLM, SamplingParams
from tests.cli.engine_cli import ENGINE, assert_one_line_error, engine_cmd
from tests.lora_models import Models

pytest.importorskip("peft")
KEY = "LlamaForCausalLM"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("cli_lora"))


def build(models, out, *flags, rc=0):
    models.engine(KEY)    # makes the checkpoint
    r = subprocess.run(ENGINE + ["build", "--checkpoint-dir", str(models.root / KEY / "ckpt"), "--output-dir",
                                 str(out), "--max-seq-len", "64", "--max-batch-size", "4", *flags],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == rc, r.stderr
    return r


def test_run_with_an_adapter_equals_the_python_api(models, tmp_path):
    engine = tmp_path / "engine"
    build(models, engine, "--lora-target-modules", "all")
    adapter = models.adapter(KEY, seed=1)
    out = tmp_path / "out.json"
    engine_cmd("run", engine, "--input-text", "The capital of France is", "--max-output-len", "8", "--lora",
               str(adapter), "--output-json", str(out))
    llm = LLM(engine, max_kv_tokens=512, lora_config={"modules": {"a": str(adapter)}, "max_lora_rank": 4})
    want = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8), lora="a")[0]
    base = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))[0]
    assert json.loads(out.read_text())[0]["token_ids"] == want.token_ids != base.token_ids


def test_bad_lora_flags_are_one_clear_line(models, tmp_path):
    assert_one_line_error(build(models, tmp_path / "e", "--lora-target-modules", "q_proj,wq", rc=2),
                          "--lora-target-modules wq", "q_proj")
    assert_one_line_error(build(models, tmp_path / "e", "--lora-target-modules", "all", "--lora-dtype", "fp8",
                                rc=2), "--lora-dtype 'fp8'")
    plain = tmp_path / "plain"
    build(models, plain)
    r = engine_cmd("run", plain, "--input-text", "hi", "--max-output-len", "2", "--lora",
                   str(models.adapter(KEY, seed=1)), check_rc=2)
    assert_one_line_error(r, "built without LoRA support", "--lora-target-modules all")
    r = engine_cmd("run", plain, "--input-text", "hi", "--max-output-len", "2", "--lora", str(tmp_path), check_rc=2)
    assert_one_line_error(r, "expected a PEFT adapter directory")
