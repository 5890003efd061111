"""A/B of kernel libraries on the K-quant tiles alone: one GGUF projection of the 1.5B's shapes (gate|up [17920 x
1536], down [1536 x 8960]) as QuantMatMul, random weights (5-23 MB, in L3 after the first call), rows 1 .. 512,
libraries in turns.

    .venv/bin/python -m bench.kquant_ab --libs LIB_A,LIB_B[,...] [--kinds Q4_K,Q6_K] [--rows 1 8 32 512]

Build a variant library as bench/kernel_ab.py's docstring shows. Each library gets its own ORT session per case; the
order of the libraries rotates every turn. Prints the median ms of each library and its speedup over the first,
and the largest output difference from the first's relative to its largest output (0 where the arithmetic is the
same); writes bench/results/kquant_ab.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from engine.plugins import gguf_tiles, native
from engine.plugins.graph import Graph
from engine.quantization.gguf_blocks import decode
from tests.plugins.test_gguf_tiles import raw_weight

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "kquant_ab.json"
SHAPES = {"gate_up": (17920, 1536), "down": (1536, 8960)}


def session(lib: Path, kind: str, n: int, k: int, threads: int) -> ort.InferenceSession:
    blocks, f = gguf_tiles.pack(decode(raw_weight(kind, n, k, 0), kind, k))
    g = Graph("kquant_ab")
    x = g.input("x", onnx.TensorProto.FLOAT, ["t", k])
    y = gguf_tiles.gguf_node(g.scope("/proj"), x, g.weight("proj.weight", blocks), n, f)
    g.output(y, "y", onnx.TensorProto.FLOAT, ["t", n])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    native.library = lambda: lib
    native.register(opts)
    return ort.InferenceSession(g.model().SerializeToString(), opts, providers=["CPUExecutionProvider"])


def timed(s: ort.InferenceSession, x: np.ndarray, repeats: int) -> tuple[float, np.ndarray]:
    s.run(None, {"x": x})
    t = time.perf_counter()
    for _ in range(repeats):
        y = s.run(None, {"x": x})[0]
    return (time.perf_counter() - t) / repeats * 1e3, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--libs", required=True, help="comma-separated kernel libraries; the first is the baseline")
    ap.add_argument("--kinds", default="Q4_K,Q6_K")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    libs = [Path(p) for p in a.libs.split(",")]
    result = {"libs": [str(p) for p in libs], "turns": a.turns, "cases": {}}
    for kind in a.kinds.split(","):
        for shape, (n, k) in SHAPES.items():
            sessions = [session(lib, kind, n, k, a.threads) for lib in libs]
            for rows in a.rows:
                x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
                repeats = max(2, 200 // rows)
                ms = [[] for _ in libs]
                out = [None] * len(libs)
                for turn in range(a.turns):
                    for i in [(turn + j) % len(libs) for j in range(len(libs))]:
                        dt, out[i] = timed(sessions[i], x, repeats)
                        ms[i].append(dt)
                med = [float(np.median(m)) for m in ms]
                diff = [float(np.abs(o - out[0]).max() / np.abs(out[0]).max()) for o in out]
                name = f"{kind} {shape} {rows} rows"
                result["cases"][name] = {"median_ms": med, "ms": ms, "max_rel_diff": diff}
                print(f"{name:28s} " + "  ".join(f"{m:8.3f} ms {med[0] / m:5.2f}x (min {min(ms[0]) / min(v):4.2f}x)"
                                                   f" |d| {d:.0e}" for m, v, d in zip(med, ms, diff)), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
