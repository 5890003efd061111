"""`engine build` defaults: --max-input-len is --max-seq-len (prefill runs in chunks of --max-num-tokens), so a
prompt past TensorRT-LLM's old default of 1024 tokens is taken; an explicit --max-input-len still caps prompts."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli.engine_cli import ENGINE, assert_one_line_error

PROMPT = "Paris " * 1100


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny Llama with 2048 positions (its config says 256), so a default build allows 2048-token prompts."""
    from engine.recipes.convert import ConvertConfig, convert
    from engine.recipes.sources import HFDirSource
    from tests.tiny_models import make_tiny_model
    root = tmp_path_factory.mktemp("build_defaults")
    hf = make_tiny_model("LlamaForCausalLM", root / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    convert(HFDirSource(hf), ConvertConfig(output_dir=root / "ckpt"))
    return root / "ckpt"


def engine(*args: str, rc: int = 0) -> subprocess.CompletedProcess:
    r = subprocess.run(ENGINE + list(args), capture_output=True, text=True, timeout=600,
                       env={**os.environ, "COLUMNS": "160"})
    assert r.returncode == rc, f"rc {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    return r


def build(checkpoint: Path, out: Path, *args: str) -> Path:
    engine("build", "--checkpoint-dir", str(checkpoint), "--output-dir", str(out), "--max-batch-size", "2",
           "--max-num-tokens", "256", *args)
    return out


def run(engine_dir: Path, *args: str, rc: int = 0) -> subprocess.CompletedProcess:
    return engine("run", "--engine-dir", str(engine_dir), "--max-kv-tokens", "2304", "--input-text", PROMPT,
                  "--max-output-len", "2", *args, rc=rc)


def test_default_build_takes_prompts_up_to_max_seq_len(checkpoint, tmp_path):
    engine_dir = build(checkpoint, tmp_path / "engine")
    limits = json.loads((engine_dir / "config.json").read_text())["build"]
    assert limits["max_input_len"] == limits["max_seq_len"] == 2048
    out = tmp_path / "out.json"
    run(engine_dir, "--output-json", str(out))
    (result,) = json.loads(out.read_text())
    assert result["prompt_tokens"] > 1024 and len(result["token_ids"]) == 2   # prefilled in chunks of 256


def test_explicit_max_input_len_still_caps_prompts(checkpoint, tmp_path):
    engine_dir = build(checkpoint, tmp_path / "engine", "--max-input-len", "1024")
    assert_one_line_error(run(engine_dir, rc=1), "max_input_len 1024")


def test_help_states_the_default():
    r = engine("build", "--help")
    line = r.stdout[r.stdout.index("--max-input-len"):r.stdout.index("  --max-seq-len <int>")]
    assert "[default: (--max-seq-len)]" in line and "1024" not in line
