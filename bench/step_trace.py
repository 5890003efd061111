"""Where a batch-1 decode step's time goes, from a timeline the kernels record (plugins/kernels/step_trace.h).

    .venv/bin/python -m bench.step_trace --engine-dir .cache/bench/engines/fp32 [--steps 128] [--threads 2]

Builds the kernel library with -DENGINE_KERNELS_TRACE (beside the usual one in the kernels' cache), runs the
benchmark's 512-token prompt and then --steps greedy decode steps on it, as bench/compare.py's engine rows do, and
splits each step into:
  python   between two ORT runs: argmax, the next step's inputs, their bindings, the logits copy
  ort      from the run's start to the first op, between ops, from the last op to the run's end
  each op  its calls to the thread pool that stream weights (with their rate), its other calls (attention's items,
           norms), and its own serial work outside the calls (reading inputs, setting up, epilogues)
Prints the median a step of each part and writes bench/results/step_trace.json. A timestamp costs ~25 ns, and a
SmolLM2 step takes ~600 (~15 us of ~7.5 ms), where ORT's profiler adds ~3.7 us of its own between two nodes
(bench/NOTES.md entries 51-52).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from engine.plugins import native
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "step_trace.json"
PROMPT = ROOT / "bench" / "prompt_ids.json"
OP_ENTER, OP_EXIT, CALL_ENTER, CALL_EXIT, CALL_BYTES = 1, 2, 3, 4, 5   # step_trace.h's TraceKind
OPS = {1: "QuantMatMul", 2: "QuantMatMulAddRMSNorm", 3: "QuantMLP", 4: "QuantMLPAddRMSNorm", 5: "QuantGather",
       6: "attention", 7: "AddRMSNorm", 8: "Bf16MatMul"}                 # step_trace.h's TraceOp
CAPACITY = 1 << 21


class Event(ctypes.Structure):
    _fields_ = [("ns", ctypes.c_uint64), ("kind", ctypes.c_uint64), ("value", ctypes.c_uint64)]


def traced_library() -> Path:
    """The kernel library compiled with the trace: the flag is part of native.library()'s digest, so it gets a
    directory of its own beside the usual library, which stays as it is."""
    native.FLAGS = [*native.FLAGS, "-DENGINE_KERNELS_TRACE"]
    return native.library()


def take_events(lib: ctypes.CDLL, capacity: int = CAPACITY) -> np.ndarray:
    """The events recorded since the last call (up to `capacity`): [n, 3] of (ns, kind, value)."""
    buffer = (Event * capacity)()
    n = lib.EngineKernelsTrace(buffer, capacity)
    return np.frombuffer(buffer, dtype=np.uint64, count=3 * n).reshape(n, 3).copy()


def split_step(events: np.ndarray, start: int, end: int) -> dict[str, float]:
    """The parts of the ORT run [start, end] (ns) whose kernel events are `events`: microseconds, and each op's
    count and streamed bytes."""
    parts: dict[str, float] = defaultdict(float)
    last_exit, op, op_start, call_start, call_bytes, in_calls = start, None, 0, 0, 0, 0
    for ns, kind, value in events.tolist():
        if kind == OP_ENTER:
            parts["ort: run start to first op" if op is None else "ort: between ops"] += (ns - last_exit) / 1e3
            op, op_start, in_calls = OPS.get(value, f"op {value}"), ns, 0
            parts[f"{op}: count"] += 1
        elif kind == CALL_BYTES:
            call_bytes = value
        elif kind == CALL_ENTER:
            call_start = ns
        elif kind == CALL_EXIT:
            parts[f"{op}: {'weight streams' if call_bytes else 'other calls'}"] += (ns - call_start) / 1e3
            parts[f"{op}: streamed bytes"] += call_bytes
            in_calls += ns - call_start
            call_bytes = 0
        elif kind == OP_EXIT:
            parts[f"{op}: serial work"] += (ns - op_start - in_calls) / 1e3
            last_exit = ns
    parts["ort: last op to run end"] += (end - last_exit) / 1e3
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine-dir", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--library", type=Path, help="a library built with the trace already (a variant's, as "
                    "bench/kernel_ab.py builds them, with -DENGINE_KERNELS_TRACE); default: built from the sources")
    a = ap.parse_args()
    path = a.library or traced_library()
    native.library = lambda: path
    prompt = json.loads(PROMPT.read_text())["ids"][:512]
    tokens_per_block = load_engine_config(a.engine_dir).build.tokens_per_block
    blocks = list(range(-(-(len(prompt) + a.steps + 8) // tokens_per_block)))
    session = EngineSession(a.engine_dir, num_blocks=len(blocks), threads=a.threads)
    lib = ctypes.CDLL(str(path))
    runs: list[tuple[int, int]] = []
    ort_run = session._session.run_with_iobinding   # the ORT run inside session.run, timed from outside

    def timed_run(binding) -> None:
        start = time.monotonic_ns()
        ort_run(binding)
        runs.append((start, time.monotonic_ns()))

    session._session.run_with_iobinding = timed_run
    logits = session.run([SeqChunk(prompt, 0, blocks, True)])
    for i in range(a.steps + 8):                    # 8 untimed steps first: ORT's and the pools' first runs
        if i == 8:
            take_events(lib)
            runs.clear()
        logits = session.run([SeqChunk([int(np.argmax(logits[0]))], len(prompt) + i, blocks, True)])
    events = take_events(lib)
    times = events[:, 0].astype(np.int64)
    steps = []
    for i in range(1, len(runs) - 1):   # a step: from its ORT run's start to the next one's
        (start, end), previous_end, next_start = runs[i], runs[i - 1][1], runs[i + 1][0]
        parts = split_step(events[(times >= start) & (times <= end)], start, end)
        parts["step (ORT run to ORT run)"] = (next_start - start) / 1e3
        parts["python between ORT runs"] = (start - previous_end) / 1e3
        steps.append(parts)
    report(a, steps)


def report(a: argparse.Namespace, steps: list[dict[str, float]]) -> None:
    """The median a step of each part, the step first, then Python, ORT and the ops; what the weight streams
    left of the step is the part beyond a bandwidth floor."""
    for s in steps:
        s["weight streams, all ops"] = sum(v for k, v in s.items() if k.endswith("weight streams"))
        s["streamed bytes, all ops"] = sum(v for k, v in s.items() if k.endswith(": streamed bytes"))
        s["the rest of the step"] = s["step (ORT run to ORT run)"] - s["weight streams, all ops"]
    first = ["step (ORT run to ORT run)", "weight streams, all ops", "the rest of the step", "python between ORT runs",
             "ort: run start to first op", "ort: between ops", "ort: last op to run end"]
    keys = first + sorted({k for s in steps for k in s} - set(first))
    median = {k: float(np.median([s.get(k, 0.0) for s in steps])) for k in keys}
    table = Table(title=f"{a.engine_dir.name}: a decode step after 512 prompt tokens, median of {len(steps)} steps")
    table.add_column("part")
    table.add_column("us a step", justify="right")
    table.add_column("", justify="right")
    for k in keys:
        if k.endswith(("count", "bytes", "all ops")) and "weight streams" not in k:
            continue
        note = ""
        if "weight streams" in k:
            mb = median[k.replace("weight streams", "streamed bytes")] / 1e6
            note = f"{mb:.1f} MB at {mb / median[k] * 1e3:.1f} GB/s"
        elif k.endswith("serial work"):
            note = f"{median[k.replace('serial work', 'count')]:.0f} ops"
        elif k.startswith("ort:"):
            note = "ORT: its own nodes and dispatch"
        table.add_row(k, f"{median[k]:.1f}", note)
    Console().print(table)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"engine": str(a.engine_dir), "steps": len(steps), "median_us": median}, indent=2)
                       + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
