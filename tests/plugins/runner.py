"""Builds a one-op graph with plugins.graph.Graph and runs it on ORT's CPU provider, as engines run.

    y = run_op(lambda g, x: rms_norm(g, x, ...), {"x": array})

The graph's inputs are the feeds (name, dtype, rank taken from the arrays, every dimension symbolic so no
shape is baked in); the op's result is the single output. Sessions use ORT_ENABLE_ALL, the level engines are
optimized with, so ORT's own fusions are exercised too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort

from engine.plugins.graph import Graph, uses_engine_kernels
from engine.plugins import native

ONNX_TYPES = {np.dtype(np.float32): onnx.TensorProto.FLOAT, np.dtype(np.int64): onnx.TensorProto.INT64,
              np.dtype(np.bool_): onnx.TensorProto.BOOL, np.dtype(np.int8): onnx.TensorProto.INT8,
              np.dtype(np.uint8): onnx.TensorProto.UINT8, np.dtype(np.float16): onnx.TensorProto.FLOAT16,
              np.dtype(ml_dtypes.bfloat16): onnx.TensorProto.BFLOAT16}


def build(fn: Callable[..., str | tuple[str, ...]], feeds: dict[str, np.ndarray]) -> tuple[Graph, list[str]]:
    g = Graph("plugin_test")
    names = [g.input(n, ONNX_TYPES[a.dtype], [f"{n}_d{i}" for i in range(a.ndim)]) for n, a in feeds.items()]
    result = fn(g, *names)
    results = list(result) if isinstance(result, tuple) else [result]
    outputs = [f"out_{k}" for k in range(len(results))]
    for value, out in zip(results, outputs):   # every op here returns [T, features]
        g.output(value, out, onnx.TensorProto.FLOAT, [f"{out}_d0", f"{out}_d1"])
    return g, outputs


def run_op(fn: Callable[..., str | tuple[str, ...]], feeds: dict[str, np.ndarray],
           level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL, threads: int = 1,
           pool: int | None = None):
    """Returns the op's output (a tuple when fn returns several values). Graphs with the engine's own ops
    (plugins/native.py) get its kernel library registered; `pool` gives the kernels their own pool of that many
    threads (ORT's intra-op pool one), as engines whose EngineConfig.thread_pool is "engine" run."""
    g, outputs = build(fn, feeds)
    model = g.model()
    onnx.checker.check_model(model, full_check=True)   # valid ONNX, standard ops' types and attributes included
    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    opts.intra_op_num_threads = 1 if pool else threads
    if pool:
        opts.add_session_config_entry(native.THREADS_ENTRY, str(pool))
    if uses_engine_kernels(model):
        native.register(opts)
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    if any(a.dtype == ml_dtypes.bfloat16 for a in feeds.values()):   # ORT's numpy converter does not know it
        values = {n: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), onnx.TensorProto.BFLOAT16)
                  if a.dtype == ml_dtypes.bfloat16 else ort.OrtValue.ortvalue_from_numpy(a) for n, a in feeds.items()}
        results = [v.numpy() for v in session.run_with_ort_values(outputs, values)]
    else:
        results = session.run(outputs, feeds)
    return results[0] if len(results) == 1 else tuple(results)


def node_names(fn: Callable[..., str | tuple[str, ...]], feeds: dict[str, np.ndarray]) -> list[str]:
    g, _ = build(fn, feeds)
    return [n.name for n in g.nodes if not n.name.startswith("/model/output/")]


def assert_close(actual: np.ndarray, expected: np.ndarray, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """fp32 tolerance: ~1e-5 relative to the magnitude of the values."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), "non-finite values in the output"
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


# The narrower CPUs the kernels' fallbacks are for: AVX2 (and FMA) without AVX-512, and neither (the plain loops:
# simd.h takes the AVX2 code only with both AVX2 and FMA, and GCC's -mno-avx2 turns AVX-512 off with it).
AVX2_ONLY = ("-mno-avx512f",)
PLAIN = ("-mno-avx2",)


def library_without(monkeypatch, tmp_path: Path, *flags: str) -> Path:
    """The kernel library compiled with `flags` added to the current ones (a narrower CPU's build, e.g. PLAIN), in a
    cache shared by the test session (the digest covers the flags: each set compiles once, ~20 s on two cores); the
    ops a test runs after this load it."""
    shared = tmp_path.parent / "narrower-kernels"   # tmp_path's parent: the session's base temporary directory
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(shared))
    monkeypatch.setattr(native, "FLAGS", [*native.FLAGS, *flags])
    library = native.library()
    assert library.is_relative_to(shared)
    return library
