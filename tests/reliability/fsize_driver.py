"""Run several `engine` command lines in one process, each under its own RLIMIT_FSIZE (test_disk_full.py).

    python -m tests.reliability.fsize_driver < [[name, limit, [args...]], ...]   ->   stdout: {name: [code, stderr]}

Only the soft limit changes (the hard one stays), so it is raised again between cases; SIGXFSZ is ignored, so a
write past the limit fails with EFBIG as a write to a full disk fails with ENOSPC, instead of killing the process.
One process for every case pays the imports (torch, onnx) once.
"""
from __future__ import annotations

import json
import resource
import signal
import sys

from tests.reliability.conftest import run_cli


def main() -> None:
    cases = json.load(sys.stdin)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    results = {}
    for name, limit, args in cases:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        try:
            results[name] = run_cli(*args)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
