"""bench/compare_measure.py's turn-taking worker (compare.py's alternating goals): READY once loaded, one TURN record
per "go", a clean exit at the end of its input. The bandwidth worker over 8 MiB stands in for any measurement."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

MEASURE = Path(__file__).resolve().parents[2] / "bench" / "compare_measure.py"


def test_worker_takes_one_turn_per_go_and_exits_at_eof():
    spec = {"threads": 1, "bandwidth_mib": 8, "turns": 1}
    p = subprocess.Popen([sys.executable, str(MEASURE), "bandwidth", "--spec", json.dumps(spec)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    assert all(t["read_GBps"] > 0 for t in turns)
    assert p.stdout.read() == ""   # nothing measured without a "go"
