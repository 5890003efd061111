"""A mixture-of-experts model through the command line, in subprocesses: `engine convert` of a tiny Qwen3-MoE
directory, `engine build` (float32 and int4_wo), `engine inspect`, `engine run`; greedy tokens equal transformers'."""
import json
import subprocess

import pytest
import torch

from engine.plugins import native
from tests.builder.engines import hf_greedy
from tests.cli.engine_cli import ENGINE, assert_one_line_error, engine_cmd
from tests.tiny_models import make_tiny_model

KEY = "Qwen3MoeForCausalLM"
PROMPT = "The quick brown fox jumps over"
STEPS = 8


def engine(*args: str, rc: int = 0) -> subprocess.CompletedProcess:
    r = subprocess.run([*ENGINE, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == rc, f"rc {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    return r


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_cli")
    hf = make_tiny_model(KEY, root / "hf")
    engine("convert", "--model-dir", str(hf), "--output-dir", str(root / "ckpt"), "--no-progress")
    return root


@pytest.mark.parametrize("dtype", ["float32", "int4_wo"])
def test_build_inspect_and_run(ckpt, dtype, tmp_path):
    from transformers import AutoModelForCausalLM
    from engine.runtime import Tokenizer
    out = tmp_path / "engine"
    engine("build", "--checkpoint-dir", str(ckpt / "ckpt"), "--output-dir", str(out), "--dtype", dtype,
           "--max-seq-len", "64", "--eval-tokens", "0", "--no-progress")
    inspect = engine("inspect", "--engine-dir", str(out), "--json")
    report = json.loads(inspect.stdout)
    assert report["config"]["model"]["moe"]["num_experts"] == 8
    counts = next(iter(report["op_counts"].values()))
    assert counts.get("engine.MoE", 0) == (2 if native.has_int8_dot() else 0)   # one a layer, with the kernels
    result = tmp_path / "out.json"
    engine_cmd("run", out, "--input-text", PROMPT, "--max-output-len", str(STEPS), "--output-json", str(result))
    tokens = json.loads(result.read_text())[0]["token_ids"]
    assert 0 < len(tokens) <= STEPS
    if dtype != "float32":
        return
    model = AutoModelForCausalLM.from_pretrained(ckpt / "hf", dtype=torch.float32, attn_implementation="eager")
    expected, _ = hf_greedy(model.eval(), Tokenizer(out).encode(PROMPT), STEPS)
    assert tokens == expected[:len(tokens)]   # the engine stops at EOS; transformers here does not


@pytest.mark.parametrize("flags,ep", [(["--moe-ep-size", "2"], 2), (["--moe-tp-size", "2"], 1),
                                      (["--moe-tp-size", "1", "--moe-ep-size", "2"], 2), ([], 1)])
def test_expert_parallel_flags(ckpt, tmp_path, flags, ep):
    r = engine("build", "--checkpoint-dir", str(ckpt / "ckpt"), "--output-dir", str(tmp_path / "e"), "--tp", "2",
               *flags, "--dry-run", "--json")
    assert json.loads(r.stdout)["build"]["moe_ep_size"] == ep


@pytest.mark.parametrize("flags,needle", [
    (["--moe-ep-size", "3"], "--moe-ep-size 3 must divide --tp 2"),
    (["--moe-tp-size", "2", "--moe-ep-size", "2"], "--moe-tp-size 2 x --moe-ep-size 2 must equal --tp 2"),
    (["--moe-tp-size", "3"], "--moe-tp-size 3 must divide --tp 2"),
])
def test_expert_parallel_flags_that_do_not_fit_are_one_line_errors(ckpt, tmp_path, flags, needle):
    r = engine("build", "--checkpoint-dir", str(ckpt / "ckpt"), "--output-dir", str(tmp_path / "e"), "--tp", "2",
               *flags, "--dry-run", rc=2)
    assert_one_line_error(r, needle)
