"""bench/step_trace.py and the trace it reads (plugins/kernels/step_trace.h): a library compiled with
-DENGINE_KERNELS_TRACE records each op, its calls to the thread pool and the weight bytes a projection streams, in
order and without changing a result; the script's split of a run partitions its time; the usual library has no
trace at all."""
from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort
import pytest

from engine.plugins import native, quant_matmul

from bench import step_trace

from ..plugins.runner import assert_close, library_without
from ..plugins.test_quant_matmul import WEIGHTS, expected, quant_matmul_op


def test_a_traced_library_records_each_op_its_calls_and_their_weights(monkeypatch, tmp_path):
    lib = ctypes.CDLL(str(library_without(monkeypatch, tmp_path, "-DENGINE_KERNELS_TRACE")))
    pools = [None, 2] if native.own_pool_supported(ort.__version__) else [None]   # ORT's intra-op pool, the own
    q = WEIGHTS["int8_g32"](44, 256)
    for pool in pools:
        for tokens in (1, 5):   # a lone row's call, a call of several rows
            x = np.random.default_rng(tokens).standard_normal((tokens, 256)).astype(np.float32)
            step_trace.take_events(lib, 4096)
            assert_close(quant_matmul_op(x, q, pool=pool), expected(x, q), rtol=2e-5, atol=2e-5)
            events = step_trace.take_events(lib, 4096)
            ns, kinds, values = events.T.tolist()
            assert (kinds[0], values[0], kinds[-1], values[-1]) == (step_trace.OP_ENTER, 1, step_trace.OP_EXIT, 1)
            assert kinds.count(step_trace.OP_ENTER) == 1 and kinds.count(step_trace.CALL_ENTER) >= 1
            calls = [k for k in kinds if k in (step_trace.CALL_ENTER, step_trace.CALL_EXIT)]
            assert calls == [step_trace.CALL_ENTER, step_trace.CALL_EXIT] * (len(calls) // 2)   # calls do not nest
            assert [v for k, v in zip(kinds, values) if k == step_trace.CALL_BYTES] == [quant_matmul.pack(q).nbytes]
            assert kinds[kinds.index(step_trace.CALL_BYTES) + 1] == step_trace.CALL_ENTER   # named as it starts
            assert ns == sorted(ns)

            start, end = ns[0] - 500, ns[-1] + 700   # the run around the op
            parts = step_trace.split_step(events, start, end)
            assert parts["QuantMatMul: count"] == 1
            assert parts["QuantMatMul: streamed bytes"] == quant_matmul.pack(q).nbytes
            assert (parts["ort: run start to first op"], parts["ort: last op to run end"]) == pytest.approx((0.5, 0.7))
            assert "ort: between ops" not in parts
            times = [v for k, v in parts.items() if not k.endswith(("count", "bytes"))]
            assert sum(times) == pytest.approx((end - start) / 1e3)   # the parts cover the run, once


def test_the_usual_library_records_nothing():
    with pytest.raises(AttributeError):
        ctypes.CDLL(str(native.library())).EngineKernelsTrace
