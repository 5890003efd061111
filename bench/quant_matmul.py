"""SmolLM2-135M's 210 layer projections (30 layers x q, k, v, o, gate, up, down) chained in one ONNX Runtime graph,
timed for each way the engine can run them, at several numbers of rows (tokens in a step).

    .venv/bin/python -m bench.quant_matmul [--rows 1 16 32 128 512] [--threads 2] [--rounds 5] [--engine-dir DIR]

Variants, interleaved round by round in one process (this VM's speed wanders between minutes):
  q4_1 / int8 QuantMatMul           the kernel library as built for this CPU (on AMX: calls of >= 64 rows in
                                    bfloat16 tiles, fewer rows in int8 tiles 16 at a time)
  q4_1 / int8 QuantMatMul int8-AMX  the same sources compiled with -mno-amx-bf16 (int8 tiles at every row count)
  q4_1 / int8 QuantMatMul no-AMX    compiled with -mno-amx-tile -mno-amx-int8 (the VNNI code)
  int4 / int8 MatMulNBits          ONNX Runtime's op at accuracy level 4 (what builds without the kernels use)
Weights are random on each scheme's grid (Q4_1: GGUF's float16 d and m per block of 32, kept; int8: RTN groups of
32). With --engine-dir, also a real engine's steps (a 512-token prefill, decode steps of 8 and 32 sequences at context
160) with the library built both ways. Prints tables of the median ms per round and writes
bench/results/quant_matmul.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort

from engine.plugins.graph import ENGINE_DOMAIN, Graph
from engine.plugins import native, quant_matmul
from engine.plugins.linear import quantized_linear
from engine.plugins.rms_norm import rms_norm
from engine.quantization.weight_only import WeightOnlyScheme, block_grid, quantize
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk

ROOT = Path(__file__).resolve().parent
HIDDEN, INTER, KV, LAYERS = 576, 1536, 192, 30
SHAPES = [("q", HIDDEN, HIDDEN), ("k", KV, HIDDEN), ("v", KV, HIDDEN), ("o", HIDDEN, HIDDEN),
          ("gate", INTER, HIDDEN), ("up", INTER, HIDDEN), ("down", HIDDEN, INTER)]  # (name, N, K)


def q4_1(rng, n: int, k: int):
    d = rng.uniform(0.001, 0.01, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.05, 0.0, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    codes = rng.integers(0, 16, (n, k // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15
    return block_grid((codes * d + m).reshape(n, k).astype(np.float32), 32)


def rtn(bits: int):
    return lambda rng, n, k: quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05,
                                      WeightOnlyScheme(bits, 32, accuracy_level=4))


def projections(weight, op: str) -> onnx.ModelProto:
    """x [T, 576] through 30 layers of the 7 projections, chained as a layer's are, one output [T, 576]:

        x ─┬─ q ── o ─┬─ gate ─┐
           ├─ k       └─ up ───┴─ Mul ── down ─┐
           └─ v                                ├─ Add ── RMSNorm ──▶ next layer's x
                        x + mean(k) + mean(v) ─┘

    (k and v are kept alive by their row means; the norm keeps 30 layers of random weights finite.)"""
    rng = np.random.default_rng(0)
    g = Graph("projections")
    x = g.input("x", onnx.TensorProto.FLOAT, ["T", HIDDEN])
    for layer in range(LAYERS):
        y = {}
        for name, n, k in SHAPES:
            q, stem = weight(rng, n, k), f"layers.{layer}.{name}"
            source = {"q": x, "k": x, "v": x, "o": y.get("q"), "gate": y.get("o"), "up": y.get("o"),
                      "down": y.get("gate")}[name]
            if name == "down":
                source = g.scope(f"/layers.{layer}/mlp")("Mul", [y["gate"], y["up"]])
            if op == "QuantMatMul":
                y[name] = g.scope(f"/{stem}")("QuantMatMul", [source, g.weight(f"{stem}.weight",
                                                                                quant_matmul.pack(q))],
                                              domain=ENGINE_DOMAIN, N=n, bits=q.bits, group_size=q.group_size,
                                              offsets=int(q.offsets is not None))
            else:
                y[name] = quantized_linear(g, source, q, None, name=f"/{stem}", weight_name=f"{stem}.weight",
                                           accuracy_level=4)
        scope = g.scope(f"/layers.{layer}/residual")
        means = [scope("ReduceMean", [y[name], g.const([1])], keepdims=1) for name in ("k", "v")]
        total = scope("Add", [scope("Add", [x, y["down"]]), scope("Add", means)])
        x = rms_norm(g, total, np.ones(HIDDEN, np.float32), 1e-5, name=f"/layers.{layer}/norm",
                     weight_name=f"layers.{layer}.norm.weight", plugin=True, whole_rows=True)
    g.output(x, "y", onnx.TensorProto.FLOAT, ["T", HIDDEN])
    return g.model()


def session(model: onnx.ModelProto, threads: int, library: Path | None) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    if library is not None:
        opts.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


NO_AMX = ["-mno-amx-tile", "-mno-amx-int8"]
NO_BF16 = ["-mno-amx-bf16"]   # AMX's int8 tiles only: calls of many rows as int8 too (kernels/quant_bf16.h)
BUILDS = {"": [], " int8-AMX": NO_BF16, " no-AMX": NO_AMX}   # variant suffix -> extra compiler flags


@contextmanager
def flags(extra: list[str]):
    """The kernel library compiled with `extra` flags while inside (native.library() keys its cache by them)."""
    kept = native.FLAGS
    native.FLAGS = [*kept, *extra]
    try:
        yield
    finally:
        native.FLAGS = kept


def library_with(extra: list[str]) -> Path:
    with flags(extra):
        return native.library()


def interleaved(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median ms of each run over `rounds` rounds, the runs taking turns (after one warm-up each)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()
    for _ in range(rounds):
        for name, run in runs.items():
            time.sleep(0.05)   # the last session's intra-op worker spins on the other core for a while
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def engine_steps(engine_dir: Path, threads: int, rounds: int) -> dict[str, dict[str, float]]:
    """A real engine's steps, its QuantMatMul library compiled each way (BUILDS)."""
    blocks = 40
    sessions = {}
    for suffix, extra in BUILDS.items():
        with flags(extra):
            sessions[suffix.strip() or "as built"] = EngineSession(engine_dir, num_blocks=33 * blocks,
                                                                   threads=threads)
    assert sessions["as built"].tokens_per_block * blocks >= 512
    rng = np.random.default_rng(2)

    def decodes(batch: int) -> list[SeqChunk]:
        return [SeqChunk([int(rng.integers(1000))], 160, list(range(i * blocks, (i + 1) * blocks)), True)
                for i in range(batch)]

    steps = {"prefill 512": [SeqChunk(rng.integers(1000, size=512).tolist(), 0,
                                      list(range(32 * blocks, 33 * blocks)), True)],
             "decode b=8": decodes(8), "decode b=32": decodes(32)}
    return {step: interleaved({name: functools.partial(s.run, chunks) for name, s in sessions.items()}, rounds)
            for step, chunks in steps.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 128, 512])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine-dir", type=Path, help="also time this engine's steps with each library")
    args = ap.parse_args()

    libraries = {suffix: library_with(extra) for suffix, extra in BUILDS.items()}
    variants = {}
    for label, weight in [("q4_1", q4_1), ("int8", rtn(8))]:
        model = projections(weight, "QuantMatMul")
        for suffix, library in libraries.items():
            variants[f"{label} QuantMatMul{suffix}"] = session(model, args.threads, library)
    for label, weight in [("int4", rtn(4)), ("int8", rtn(8))]:
        variants[f"{label} MatMulNBits"] = session(projections(weight, "MatMulNBits"), args.threads, None)

    rng = np.random.default_rng(1)
    ms: dict[str, dict[int, float]] = {name: {} for name in variants}
    for rows in args.rows:
        feeds = {"x": rng.standard_normal((rows, HIDDEN)).astype(np.float32)}
        runs = {name: functools.partial(s.run, None, feeds) for name, s in variants.items()}
        for name, median in interleaved(runs, args.rounds).items():
            ms[name][rows] = median

    print(f"210 SmolLM2 projections, {args.threads} threads, median ms of {args.rounds} interleaved rounds")
    print(f"{'variant':28s}" + "".join(f"{f'T={r}':>10s}" for r in args.rows))
    for name, row in ms.items():
        print(f"{name:28s}" + "".join(f"{row[r]:10.2f}" for r in args.rows))
    out = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "rounds": args.rounds,
           "amx_flags": "amx_int8" in native._cpu_flags(), "ms": ms}
    if args.engine_dir:
        out["engine"] = str(args.engine_dir)
        out["engine_steps_ms"] = steps = engine_steps(args.engine_dir, args.threads, args.rounds)
        print(f"\n{args.engine_dir}: one step, median ms of {args.rounds} interleaved rounds")
        print(f"{'step':14s}" + "".join(f"{name:>12s}" for name in next(iter(steps.values()))))
        for step, row in steps.items():
            print(f"{step:14s}" + "".join(f"{v:12.2f}" for v in row.values()))
    (ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / "quant_matmul.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
