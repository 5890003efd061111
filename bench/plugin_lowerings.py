"""Plugin vs reference lowering speed of each fused op at SmolLM2-135M's sizes, on ORT's CPU provider.

    .venv/bin/python -m bench.plugin_lowerings [--threads 1] [--depth 8] [--seconds 1.0]

Each variant is a graph of `depth` copies of the op chained output to input (fresh weights per copy, as layers
have), so ORT's per-call overhead is amortized and weights are not all cache-resident; the time reported is per
op copy, after warm-up, at ORT_ENABLE_ALL like engines: the median CPU time of the one compute thread (robust
to other load on a shared machine) and the best wall time. Besides the two lowerings of
each plugin, alternatives the plugin could use are timed too (ORT's contrib SimplifiedLayerNormalization,
SkipSimplifiedLayerNormalization and com.microsoft RotaryEmbedding against the standard ops the plugins use).
The table also shows which kernels ORT actually ran after its own fusions. Writes bench/results/plugins.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort

from engine.plugins.graph import MS_DOMAIN, Graph
from engine.core.model_config import RopeConfig
from engine.plugins.attention import paged_attention
from engine.plugins.gated_mlp import gated_mlp
from engine.plugins.rms_norm import add_rms_norm, rms_norm
from engine.plugins.rotary import rotary, rotary_tables

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536
PREFILL_T, DECODE_B, DECODE_L = 512, 8, 640
ONNX_TYPES = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.int64): onnx.TensorProto.INT64,
              np.dtype(np.bool_): onnx.TensorProto.BOOL}


@dataclass(frozen=True)
class Result:
    op: str
    case: str
    variant: str
    cpu_us_per_op: float      # median CPU time of the calling thread (the primary number with --threads 1)
    wall_best_us_per_op: float
    kernels: str     # op types ORT ran after optimization, one chain copy's worth


# A chain link: (graph, input value, copy index) -> output value of the same shape.
Link = Callable[[Graph, str, int], str]


def chain_model(link: Link, feeds: dict[str, np.ndarray], chained: str, depth: int) -> onnx.ModelProto:
    g = Graph("bench")
    for name, a in feeds.items():
        g.input(name, ONNX_TYPES[a.dtype], list(a.shape))
    x = chained
    for i in range(depth):
        x = link(g, x, i)
    g.output(x, "y", onnx.TensorProto.FLOAT, None)
    return g.model()


def make_session(model: onnx.ModelProto, threads: int, depth: int) -> tuple[ort.InferenceSession, str]:
    """The session, and the op types ORT runs after its own fusions (per chain copy)."""
    with tempfile.TemporaryDirectory() as tmp:
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.log_severity_level = 3   # the optimized copy is for reading only; silence the NCHWc warning
        opts.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        optimized = onnx.load(opts.optimized_model_filepath)
    kinds = Counter(n.op_type for n in optimized.graph.node if n.op_type != "Identity")
    kernels = " ".join(f"{op}x{n // depth}" if n // depth > 1 else op
                       for op, n in sorted(kinds.items()) if n >= depth)
    return session, kernels


def time_interleaved(sessions: list[ort.InferenceSession], feeds: list[dict],
                     seconds: float) -> list[tuple[float, float]]:
    """(median CPU seconds, best wall seconds) per run of each session.

    The machine is shared, so wall time swings with other processes' load. With one intra-op thread ORT
    computes on the calling thread, and that thread's CPU time is what the op costs, whatever the load.
    The sessions take turns so that what load does to caches falls on all variants alike."""
    for session, f in zip(sessions, feeds):
        for _ in range(2):
            session.run(None, f)
    cpu: list[list[float]] = [[] for _ in sessions]
    wall: list[list[float]] = [[] for _ in sessions]
    start = time.perf_counter()
    while len(cpu[0]) < 5 or (time.perf_counter() - start < seconds * len(sessions) and len(cpu[0]) < 1000):
        for session, f, c, w in zip(sessions, feeds, cpu, wall):
            c0, w0 = time.thread_time(), time.perf_counter()
            session.run(None, f)
            c.append(time.thread_time() - c0)
            w.append(time.perf_counter() - w0)
    return [(statistics.median(c), min(w)) for c, w in zip(cpu, wall)]


def norm_cases(rng, tokens: int) -> dict[str, tuple[Link, dict]]:
    feeds = {"x": rng.standard_normal((tokens, HIDDEN)).astype(np.float32)}
    w = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    def ours(plugin):
        return lambda g, x, i: rms_norm(g, x, w, 1e-5, name=f"/n{i}", weight_name=f"n{i}.weight", plugin=plugin,
                                        whole_rows=True)

    def contrib(g, x, i):
        return g.node("SimplifiedLayerNormalization", [x, g.weight(f"n{i}.weight", w)],
                      name=f"/n{i}/SimplifiedLayerNormalization", axis=-1, epsilon=1e-5, stash_type=1)
    return {"reference": (ours(False), feeds), "plugin": (ours(True), feeds),
            "ORT SimplifiedLayerNorm": (contrib, feeds)}


def add_norm_cases(rng, tokens: int) -> dict[str, tuple[Link, dict]]:
    feeds = {"x": rng.standard_normal((tokens, HIDDEN)).astype(np.float32),
             "r": rng.standard_normal((tokens, HIDDEN)).astype(np.float32)}
    w = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    def chained(add_norm):
        # Like a decoder: the normalized output feeds the next add, the residual sum is the next residual.
        def link(g, x, i):
            y, total = add_norm(g, x, "r" if i == 0 else f"/s{i - 1}/total", i)
            g.node("Identity", [total], name=f"/s{i}/total")
            g.nodes[-1].output[0] = f"/s{i}/total"
            return y
        return link

    def ours(plugin):
        return chained(lambda g, x, r, i: add_rms_norm(g, x, r, w, 1e-5, name=f"/s{i}", weight_name=f"s{i}.weight",
                                                       plugin=plugin))

    def contrib(g, x, r, i):
        # Outputs: normalized, mean and inv_std_var (unused), x + residual.
        y, _, _, total = g.scope(f"/s{i}")("SkipSimplifiedLayerNormalization", [x, r, g.weight(f"s{i}.weight", w)],
                                           outputs=4, unused=(1, 2), domain=MS_DOMAIN, epsilon=1e-5)
        return y, total
    return {"reference": (ours(False), feeds), "plugin": (ours(True), feeds),
            "ORT SkipSimplifiedLN": (chained(contrib), feeds)}


def rotary_cases(rng, tokens: int, positions: np.ndarray) -> dict[str, tuple[Link, dict]]:
    cos, sin = rotary_tables(HEAD_DIM, RopeConfig(theta=100000.0), 8192)
    feeds = {"x": rng.standard_normal((tokens, HEADS * HEAD_DIM)).astype(np.float32), "positions": positions}

    def tables(g, i):
        return (g.weight("cos", cos), g.weight("sin", sin)) if i == 0 else ("cos", "sin")

    def ours(plugin):
        return lambda g, x, i: rotary(g, x, "positions", *tables(g, i), num_heads=HEADS, head_dim=HEAD_DIM,
                                      name=f"/r{i}", plugin=plugin)

    def contrib(g, x, i):
        c, s = tables(g, i)
        axis0 = g.const([0])
        x3 = g.node("Unsqueeze", [x, axis0], name=f"/r{i}/Unsqueeze")
        p2 = g.node("Unsqueeze", ["positions", axis0], name=f"/r{i}/Unsqueeze_1")
        y = g.node("RotaryEmbedding", [x3, p2, c, s], name=f"/r{i}/RotaryEmbedding", domain=MS_DOMAIN,
                   num_heads=HEADS)
        return g.node("Squeeze", [y, axis0], name=f"/r{i}/Squeeze")
    return {"reference": (ours(False), feeds), "plugin": (ours(True), feeds),
            "com.microsoft Rotary": (contrib, feeds)}


def attention_cases(rng, batch: int, q_len: int, ctx: int) -> dict[str, tuple[Link, dict]]:
    """`batch` sequences of `ctx` context tokens each, `q_len` of them new, in a pool with random slots."""
    slots = 4 * batch * ctx
    tokens = batch * q_len
    kv_slots = np.stack([rng.permutation(slots)[:ctx] for _ in range(batch)]).astype(np.int64)
    positions = np.arange(ctx - q_len, ctx)
    mask = np.broadcast_to(np.arange(ctx)[None, :] <= positions[:, None], (batch, 1, q_len, ctx)).copy()
    feeds = {
        "x": rng.standard_normal((tokens, HEADS * HEAD_DIM)).astype(np.float32),
        "kcache": rng.standard_normal((slots, KV_HEADS * HEAD_DIM)).astype(np.float32),
        "vcache": rng.standard_normal((slots, KV_HEADS * HEAD_DIM)).astype(np.float32),
        "q_index": np.arange(tokens, dtype=np.int64).reshape(batch, q_len),
        "kv_slots": kv_slots, "attn_mask": mask,
        "out_index": np.arange(tokens, dtype=np.int64),
    }

    def ours(plugin):
        return lambda g, x, i: paged_attention(
            g, x, "kcache", "vcache", q_index="q_index", kv_slots="kv_slots", mask="attn_mask",
            out_index="out_index", num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            scale=HEAD_DIM ** -0.5, softcap=None, name=f"/a{i}", plugin=plugin)
    return {"reference": (ours(False), feeds), "plugin": (ours(True), feeds)}


def mlp_cases(rng, tokens: int, activation: str) -> dict[str, tuple[Link, dict]]:
    feeds = {"x": rng.standard_normal((tokens, HIDDEN)).astype(np.float32)}

    def ours(plugin):
        def link(g, x, i):
            gate_up = (rng.standard_normal((2 * INTER, HIDDEN)) * 0.04).astype(np.float32)
            down = (rng.standard_normal((HIDDEN, INTER)) * 0.025).astype(np.float32)
            return gated_mlp(g, x, gate_up, down, activation, name=f"/m{i}", weight_name=f"m{i}", plugin=plugin)
        return link
    return {"reference": (ours(False), feeds), "plugin": (ours(True), feeds)}


def all_cases(rng) -> list[tuple[str, str, dict[str, tuple[Link, dict]]]]:
    prefill_pos = np.arange(PREFILL_T, dtype=np.int64)
    decode_pos = rng.integers(100, DECODE_L, DECODE_B).astype(np.int64)
    prefill, decode = f"prefill T={PREFILL_T}", f"decode B={DECODE_B}"
    return [
        ("rms_norm", prefill, norm_cases(rng, PREFILL_T)),
        ("rms_norm", decode, norm_cases(rng, DECODE_B)),
        ("add_rms_norm", prefill, add_norm_cases(rng, PREFILL_T)),
        ("add_rms_norm", decode, add_norm_cases(rng, DECODE_B)),
        ("rotary (q, 9 heads)", prefill, rotary_cases(rng, PREFILL_T, prefill_pos)),
        ("rotary (q, 9 heads)", decode, rotary_cases(rng, DECODE_B, decode_pos)),
        ("paged_attention", prefill + f" L={PREFILL_T}", attention_cases(rng, 1, PREFILL_T, PREFILL_T)),
        ("paged_attention", decode + f" L={DECODE_L}", attention_cases(rng, DECODE_B, 1, DECODE_L)),
        ("gated_mlp silu", prefill, mlp_cases(rng, PREFILL_T, "silu")),
        ("gated_mlp silu", decode, mlp_cases(rng, DECODE_B, "silu")),
        ("gated_mlp gelu_tanh", prefill, mlp_cases(rng, PREFILL_T, "gelu_tanh")),
        ("gated_mlp gelu_tanh", decode, mlp_cases(rng, DECODE_B, "gelu_tanh")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: CPU time is exact)")
    parser.add_argument("--depth", type=int, default=8, help="op copies chained in one graph")
    parser.add_argument("--seconds", type=float, default=1.0, help="timing budget per variant")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "plugins.json")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = []
    print(f"{'op':20} {'case':22} {'variant':24} {'cpu us':>9} {'wall us':>9} {'vs ref':>7}  kernels ORT ran")
    for op, case, variants in all_cases(rng):
        built = [make_session(chain_model(link, feeds, "x", args.depth), args.threads, args.depth)
                 for link, feeds in variants.values()]
        seconds = time_interleaved([s for s, _ in built], [f for _, f in variants.values()], args.seconds)
        ref_us = seconds[0][0] / args.depth * 1e6
        for variant, (_, kernels), (cpu, wall) in zip(variants, built, seconds):
            us, wall_us = cpu / args.depth * 1e6, wall / args.depth * 1e6
            results.append(Result(op, case, variant, round(us, 1), round(wall_us, 1), kernels))
            print(f"{op:20} {case:22} {variant:24} {us:9.1f} {wall_us:9.1f} {ref_us / us:6.2f}x  {kernels}",
                  flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"onnxruntime": ort.__version__, "threads": args.threads, "depth": args.depth,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    args.out.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
