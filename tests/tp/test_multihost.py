"""`engine serve` on a tp=2 engine whose ranks join through torchrun's c10d rendezvous as ranks on two machines do:
two torchrun agents (--nnodes 2, one process each) on loopback, which of them becomes rank 0 decided by the
rendezvous. Rank 0 serves HTTP and its greedy completions are the tp=1 engine's; SIGTERM to the agents ends both."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.runtime import LLM, SamplingParams
from tests.tp.test_faults import _free_port

KEY = "Qwen3ForCausalLM"
PROMPTS = ["The capital of France is", "Engines compile checkpoints"]
BIN = Path(sys.executable).parent


def _agent(engine_dir: Path, rdzv_port: int, http_port: int, log: Path) -> subprocess.Popen:
    """One node's torchrun agent running `engine serve`; both nodes run the same command."""
    cmd = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", "engine-test", "--local-addr", "127.0.0.1",
           str(BIN / "engine"), "serve", "--engine-dir", str(engine_dir), "--port", str(http_port),
           "--served-model-name", "tp", "--max-kv-tokens", "512", "--tp-timeout", "60", "--log-level", "warning"]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def test_serve_tp2_with_ranks_joined_by_torchrun_rendezvous_matches_tp1(tiny, tmp_path):
    llm = LLM(tiny.engine(KEY), max_kv_tokens=512)
    try:
        expected = [o.text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6))]
    finally:
        llm.close()
    rdzv, port = _free_port(), _free_port()
    agents = [_agent(tiny.engine(KEY, tp_size=2), rdzv, port, tmp_path / f"node{n}.log") for n in (0, 1)]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _healthy(url):
            logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-2000:] for n in (0, 1))
            assert time.monotonic() < deadline and all(a.poll() is None for a in agents), logs
            time.sleep(0.2)
        got = [httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tp", "prompt": p, "max_tokens": 6, "temperature": 0}).json()["choices"][0]["text"]
            for p in PROMPTS]
        assert got == expected
    finally:
        for a in agents:
            a.terminate()
        for a in agents:
            a.wait(timeout=60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
