"""bench/compare_measure.py's turn-taking worker (compare.py's alternating steps): READY once loaded, one TURN record
per "go", a clean exit at the end of its input; and compare_runner.Runner.turns over several such workers. The
bandwidth worker over 8 MiB stands in for any measurement."""
from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

from bench.compare_runner import Runner

ROOT = Path(__file__).resolve().parents[2]


def test_worker_takes_one_turn_per_go_and_exits_at_eof():
    spec = {"threads": 1, "bandwidth_mib": 8, "turns": 1}
    p = subprocess.Popen([sys.executable, "-m", "bench.compare_measure", "bandwidth", "--spec", json.dumps(spec)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert p.stdout.readline().strip() == "READY"
        turns = []
        for _ in range(2):
            p.stdin.write("go\n")
            p.stdin.flush()
            line = p.stdout.readline()
            assert line.startswith("TURN "), line
            turns.append(json.loads(line[5:]))
        p.stdin.close()
        assert p.wait(timeout=60) == 0, p.stderr.read()
    finally:
        p.kill()
    assert all(t["read_GBps"] > 0 and t["peak_rss_MB"] > 0 for t in turns)
    assert p.stdout.read() == ""   # nothing measured without a "go"


def test_runner_takes_turns_among_any_number_of_workers():
    """Runner.turns: each side a worker of its own, every side once a round, in order; alternating() keeps one
    figure of each turn, as the decode goals' records hold it."""
    r = Runner(Namespace(threads=1, rounds=2, step_timeout=120, prompt_len=1, new_tokens=1, repeats=1))
    spec = {"threads": 1, "bandwidth_mib": 8}
    turns = r.turns({name: ("bandwidth", spec) for name in ("a", "b", "c")})
    assert list(turns) == ["a", "b", "c"] and all(len(t) == 2 and t[0]["read_GBps"] > 0 for t in turns.values())
    pair = r.alternating(("bandwidth", spec, "read_GBps"), ("bandwidth", spec, "read_GBps"))
    assert (len(pair["a"]), len(pair["b"]), pair["a_key"]) == (2, 2, "read_GBps")
