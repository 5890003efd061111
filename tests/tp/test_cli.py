"""`engine run` on a tp=2 engine, both ways of starting its ranks, prints what the tp=1 engine prints (greedy):
spawned by `engine run` itself, and torchrun-style (two `engine run` processes with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT, as `torchrun --nproc-per-node 2 engine run ...` would start them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.tp.test_faults import _free_port

ENGINE = str(Path(sys.executable).with_name("engine"))
KEY = "Qwen3ForCausalLM"
PROMPTS = ["The capital of France is", "Engines compile checkpoints"]


def _run(engine_dir: Path, out: Path, env=None) -> subprocess.Popen:
    args = [ENGINE, "run", "--engine-dir", str(engine_dir), "--max-output-len", "6", "--output-json", str(out),
            "--max-kv-tokens", "512", "--tp-timeout", "60"]
    for p in PROMPTS:
        args += ["--input-text", p]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _tokens(proc: subprocess.Popen, out: Path) -> list[list[int]]:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return [r["token_ids"] for r in json.loads(out.read_text())]


def test_engine_run_tp2_spawned_and_torchrun_style_match_tp1(tiny, tmp_path):
    expected = _tokens(_run(tiny.engine(KEY), tmp_path / "tp1.json"), tmp_path / "tp1.json")
    tp2 = tiny.engine(KEY, tp_size=2)
    assert _tokens(_run(tp2, tmp_path / "spawn.json"), tmp_path / "spawn.json") == expected
    port = str(_free_port())
    ranks = [_run(tp2, tmp_path / f"rank{r}.json", dict(os.environ, RANK=str(r), WORLD_SIZE="2",
                                                         MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in (0, 1)]
    assert _tokens(ranks[0], tmp_path / "rank0.json") == expected
    _, err = ranks[1].communicate(timeout=60)
    assert ranks[1].returncode == 0, err          # rank 1 ran its shard until rank 0 shut it down
    assert not (tmp_path / "rank1.json").exists()  # and printed nothing: rank 0 owns the output
