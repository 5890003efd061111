"""A/B of kernel libraries on one engine, in one process: the steps a change to plugins/kernels/ should move.

    .venv/bin/python -m bench.kernel_ab --engine-dir .cache/bench/engines/int4 --libs LIB_A,LIB_B[,...] [--turns 8]

A variant library is the sources as edited, compiled into a cache of its own, then the sources put back:

    ENGINE_CACHE_DIR=/tmp/variant .venv/bin/python -c "from engine.plugins import native; print(native.library())"

Each library gets its own EngineSession; the three kinds of step run on each in turns:
  dec32  one decode step of 32 sequences at 192 keys (mean of 20 steps)
  pre16  one prefill step of 16 x 128 prompt tokens
  one    64 greedy decode steps of one sequence after a 512-token prompt (mean a step)
The kinds write disjoint KV blocks, so no kind reads what another one wrote (a lone decode's greedy tokens depend
on the library's floats). On this project's VMs the speed drifts 10-20% over minutes and the first session a process
loads ran its 32-sequence decode 5-8% slower than later ones with the same library (bench/NOTES.md entry 45), so a
spare session loads and runs first, untimed, and the order of the libraries rotates every turn. List the baseline
twice (--libs A,B,A,B) to see the noise left: the two A columns are an A/A control. Prints, per kind, the median ms
of each library, its speedup over the first and the largest logit difference from the first's (0: the same floats);
writes bench/results/kernel_ab.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from engine.plugins import native
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "kernel_ab.json"
PROMPT = ROOT / "bench" / "prompt_ids.json"
KINDS = ("dec32", "pre16", "one")
BLOCKS = 32 * 7 + 16 * 4 + 18   # dec32's 32 x 7 blocks of 32 tokens, pre16's 16 x 4, then the lone decode's 18


def steps(ids: list[int]) -> dict:
    """Each kind's step inputs, on blocks of its own."""
    dec32 = [SeqChunk([100 + j], 192, list(range(7 * j, 7 * j + 7)), True) for j in range(32)]
    pre16 = [SeqChunk(ids[128 * (j % 4):128 * (j % 4) + 128], 0, list(range(224 + 4 * j, 228 + 4 * j)), True)
             for j in range(16)]
    return {"dec32": dec32, "pre16": pre16, "one": list(range(288, 306)), "prompt": ids[:512]}


def run(session: EngineSession, kind: str, s: dict) -> tuple[float, np.ndarray]:
    """(seconds a step, the last logits) of one kind."""
    if kind == "dec32":
        t = time.perf_counter()
        for _ in range(20):
            session.run(s["dec32"])
        return (time.perf_counter() - t) / 20, session.run(s["dec32"])
    if kind == "pre16":
        t = time.perf_counter()
        out = session.run(s["pre16"])
        return time.perf_counter() - t, out
    logits = session.run([SeqChunk(s["prompt"], 0, s["one"], True)])
    t = time.perf_counter()
    for i in range(64):
        token = int(np.argmax(logits[0]))
        logits = session.run([SeqChunk([token], len(s["prompt"]) + i, s["one"], True)])
    return (time.perf_counter() - t) / 64, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine-dir", type=Path, required=True)
    ap.add_argument("--libs", required=True, help="comma-separated kernel libraries; the first is the baseline")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    if any(k not in KINDS for k in kinds):
        raise SystemExit(f"--kinds {a.kinds!r}: each must be one of {', '.join(KINDS)}")
    libs = [Path(p) for p in a.libs.split(",")]
    for lib in libs:
        if not lib.is_file():
            raise SystemExit(f"--libs: {lib} is not a file; build a variant as this script's docstring shows")
    s = steps(json.loads(PROMPT.read_text())["ids"])
    sessions = []
    native.library = lambda: libs[0]
    spare = EngineSession(a.engine_dir, num_blocks=BLOCKS, threads=a.threads)   # see the docstring
    for kind in kinds:
        run(spare, kind, s)
    for lib in libs:
        native.library = lambda lib=lib: lib   # each session registers its own library's ops
        sessions.append(EngineSession(a.engine_dir, num_blocks=BLOCKS, threads=a.threads))
    for session in sessions:                   # warm-up: first touch of the pools, ORT's first runs
        for kind in kinds:
            run(session, kind, s)
    ms = {k: [[] for _ in libs] for k in KINDS}
    last: dict = {}
    for turn in range(a.turns):
        order = [(turn + i) % len(libs) for i in range(len(libs))]
        for kind in kinds:
            for i in order:
                time.sleep(0.02)
                dt, last[kind, i] = run(sessions[i], kind, s)
                ms[kind][i].append(dt * 1e3)
    table = Table(title=f"kernel libraries on {a.engine_dir.name}, {a.turns} turns, rotating order")
    table.add_column("kind")
    for i, lib in enumerate(libs):
        table.add_column(f"{'base' if i == 0 else f'#{i}'} {lib.parent.name[:8]}", justify="right")
    result = {"engine": str(a.engine_dir), "libs": [str(p) for p in libs], "turns": a.turns, "kinds": {}}
    for kind in kinds:
        med = [float(np.median(v)) for v in ms[kind]]
        diff = [float(np.abs(last[kind, i] - last[kind, 0]).max()) for i in range(len(libs))]
        table.add_row(kind, *(f"{m:.3f} ms  {med[0] / m:.3f}x  |d| {d:.1e}" for m, d in zip(med, diff)))
        result["kinds"][kind] = {"median_ms": med, "speedup": [med[0] / m for m in med], "max_abs_diff": diff,
                                 "ms": ms[kind]}
    Console().print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
