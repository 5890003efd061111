"""The kernels' own thread pool (plugins/kernels/spin_pool.h): sessions given one (the session config entry
native.THREADS_ENTRY, ORT's intra-op pool one thread) compute exactly what ORT's intra-op pool computes, whatever
the number of threads and however uneven the items, and its workers really exist."""
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from engine.plugins import native

from .runner import run_op
from .test_attention import STEPS, attention_graph, make_step
from .test_quant_matmul import WEIGHTS, quant_matmul_op

pytestmark = pytest.mark.skipif(not native.own_pool_supported(ort.__version__),
                                reason=f"onnxruntime {ort.__version__} has no KernelInfo_GetConfigEntries (1.24)")


def kernel_workers() -> int:
    return sum(Path(task, "comm").read_text().strip() == "engine-kernels" for task in Path("/proc/self/task").iterdir())


# 3 threads: shards of uneven sizes on this 2-core machine, so the workers steal from each other's shards
@pytest.mark.parametrize("pool", [2, 3])
@pytest.mark.parametrize("steps", ["tiles", "many-decodes", "decode-one-long"])
def test_attention_on_the_own_pool_equals_ort_pool(steps, pool):
    """Causal prefill tiles differ in cost (later tiles see more keys), decodes in context length."""
    step = make_step(np.random.default_rng(21), STEPS[steps], 3, 64, 9)
    graph = attention_graph(9, 3, 64, 0.125, None, "kernel")
    np.testing.assert_array_equal(run_op(graph, step.feeds, pool=pool), run_op(graph, step.feeds, threads=2))


@pytest.mark.parametrize("pool", [2, 3])
@pytest.mark.parametrize("tokens", [1, 5, 70, 300])
def test_quant_matmul_on_the_own_pool_equals_ort_pool(tokens, pool):
    q = WEIGHTS["q4_1"](44, 256)
    x = np.random.default_rng(tokens).standard_normal((tokens, 256)).astype(np.float32)
    np.testing.assert_array_equal(quant_matmul_op(x, q, pool=pool), quant_matmul_op(x, q, threads=2))


def test_the_pool_has_its_workers():
    """A session asking for 3 threads gets 2 workers beside the caller (the entry was read: a wrong slot of the
    OrtApi table would crash or leave the kernels on ORT's single thread)."""
    step = make_step(np.random.default_rng(22), STEPS["mixed"], 3, 64, 9)
    run_op(attention_graph(9, 3, 64, 0.125, None, "kernel"), step.feeds, pool=3)
    assert kernel_workers() >= 2
