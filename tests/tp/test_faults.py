"""A rank that dies or never comes makes the others stop with an error naming it, within the timeout: no hang.

    worker killed     -> rank 0's next step raises EngineError naming rank 1 and the signal; so does every later one
    rank 0 killed     -> the worker notices (its connection closes) and exits with an error naming its rank
    a rank never runs -> `engine run` (torchrun-style, rank 0 alone) exits 1 after --tp-timeout, naming the rank
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.core.errors import EngineError
from engine.runtime.step_inputs import SeqChunk
from engine.runtime.tp.distributed import DistributedConfig
from engine.runtime.tp.session import TPSession

KEY = "LlamaForCausalLM"
ENGINE = str(Path(sys.executable).with_name("engine"))
ROOT = Path(__file__).resolve().parents[2]


def _step(session) -> None:
    session.run([SeqChunk([5, 6, 7], 0, [0], True)])


def test_killed_worker_fails_the_next_step_naming_it(tiny):
    session = TPSession(tiny.engine(KEY, tp_size=2), num_blocks=8, distributed=DistributedConfig(timeout_s=20))
    failures = []
    session.on_failure = failures.append
    try:
        _step(session)
        session._procs[1].kill()
        with pytest.raises(EngineError, match=r"rank 1 is gone: its process \(pid \d+\) was killed by SIGKILL"):
            _step(session)
        with pytest.raises(EngineError, match="rank 1 is gone"):  # and every later step, at once
            _step(session)
        assert failures and "rank 1" in failures[0]
    finally:
        session.close()


def test_killed_rank0_makes_the_worker_exit_with_an_error(tiny, tmp_path):
    engine_dir = tiny.engine(KEY, tp_size=2)
    script = ("import sys, time\n"
              "from engine.runtime.tp.distributed import DistributedConfig\n"
              "from engine.runtime.tp.session import TPSession\n"
              f"s = TPSession({str(engine_dir)!r}, num_blocks=8, distributed=DistributedConfig(timeout_s=20))\n"
              "print(s._procs[1].pid, flush=True)\n"
              "time.sleep(600)\n")
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=tmp_path)
    try:
        worker = int(rank0.stdout.readline())
    except ValueError:
        rank0.kill()
        pytest.fail(f"rank 0 did not start: {rank0.communicate()[1]}")
    rank0.send_signal(signal.SIGKILL)
    rank0.wait()
    # The worker is re-parented once rank 0 is gone: wait for its pid to disappear (bounded by the 20 s timeout).
    deadline = time.monotonic() + 60
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "the worker outlived rank 0 by more than a minute"
    err = rank0.stderr.read()
    assert "engine: error: tensor-parallel rank 1:" in err, err
    assert "another rank's connection closed: it exited or crashed" in err or "no answer from the other ranks" in err, err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_engine_run_without_its_other_rank_exits_1_after_the_timeout(tiny, tmp_path):
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    r = subprocess.run([ENGINE, "run", "--engine-dir", str(tiny.engine(KEY, tp_size=2)), "--input-text", "Hello",
                        "--max-output-len", "2", "--tp-timeout", "3"], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert "rank(s) 1 did not start within 3 s" in " ".join(r.stderr.split()), r.stderr
    assert "Traceback" not in r.stderr


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_engine_serve_stops_with_exit_1_when_a_rank_dies(tiny, tmp_path):
    import urllib.request
    port = _free_port()
    server = subprocess.Popen([ENGINE, "serve", "--engine-dir", str(tiny.engine(KEY, tp_size=2)), "--port", str(port),
                               "--max-kv-tokens", "512", "--tp-timeout", "20"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and server.poll() is None:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"the server did not become healthy: {server.stderr.read() if server.poll() else ''}")
        workers = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 1, workers
        os.kill(int(workers[0]), signal.SIGKILL)
        _, err = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 1, err
    assert "error: tensor-parallel rank 1 is gone" in err and "SIGKILL" in err, err
