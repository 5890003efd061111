"""plugins.rms_norm: both lowerings against NumPy and each other, whole rows and per-head groups."""
import numpy as np
import pytest

from engine.core.errors import EngineError
from engine.plugins.rms_norm import add_rms_norm, rms_norm

from .runner import assert_close, node_names, run_op


def rms_ref(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64).reshape(x.shape[0], -1, len(w))
    y = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * w
    return y.reshape(x.shape).astype(np.float32)


def random(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("plugin", [False, True])
@pytest.mark.parametrize("tokens,hidden,eps", [(1, 16, 1e-6), (7, 64, 1e-5), (33, 576, 1e-5)])
@pytest.mark.parametrize("whole_rows", [False, True])
def test_rms_norm(plugin, tokens, hidden, eps, whole_rows):
    rng = np.random.default_rng(1)
    x, w = random(rng, tokens, hidden, scale=3.0), random(rng, hidden)
    y = run_op(lambda g, x: rms_norm(g, x, w, eps, name="/model/layers.0/input_layernorm",
                                     weight_name="layers.0.attn_norm.weight", plugin=plugin, whole_rows=whole_rows),
               {"x": x})
    assert_close(y, rms_ref(x, w, eps))


@pytest.mark.parametrize("plugin", [False, True])
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 3, 8), (9, 4, 64), (17, 9, 64)])
def test_rms_norm_per_head(plugin, tokens, heads, head_dim):
    """q/k norms: x [T, heads*hd] normalized per head with a weight of length hd."""
    rng = np.random.default_rng(2)
    x, w = random(rng, tokens, heads * head_dim, scale=2.0), random(rng, head_dim)
    x[:, :head_dim] *= 100.0   # heads of very different scale: a whole-row norm would not match
    y = run_op(lambda g, x: rms_norm(g, x, w, 1e-6, name="/model/layers.0/attn/q_norm",
                                     weight_name="layers.0.attention.q_norm.weight", plugin=plugin), {"x": x})
    assert_close(y, rms_ref(x, w, 1e-6))


@pytest.mark.parametrize("plugin,kernel", [(False, False), (True, False), (True, True)],
                         ids=["reference", "ort", "kernel"])
@pytest.mark.parametrize("tokens,hidden", [(1, 16), (5, 64), (40, 576), (3, 37)])  # 37: a tail past the vectors
def test_add_rms_norm(plugin, kernel, tokens, hidden):
    rng = np.random.default_rng(3)
    x, r, w = random(rng, tokens, hidden), random(rng, tokens, hidden, scale=4.0), random(rng, hidden)
    y, total = run_op(lambda g, x, r: add_rms_norm(g, x, r, w, 1e-5, name="/model/layers.1/post_attention_layernorm",
                                                   weight_name="layers.1.mlp_norm.weight", plugin=plugin,
                                                   kernel=kernel), {"x": x, "r": r}, threads=2)
    assert_close(total, x + r)
    assert_close(y, rms_ref(x + r, w, 1e-5))


@pytest.mark.parametrize("per_head", [False, True])
def test_lowerings_agree(per_head):
    rng = np.random.default_rng(4)
    hd = 32
    x, w = random(rng, 12, 4 * hd), random(rng, hd if per_head else 4 * hd)
    a, b = (run_op(lambda g, x: rms_norm(g, x, w, 1e-6, name="/n", weight_name="n.weight", plugin=p), {"x": x})
            for p in (False, True))
    assert_close(a, b)


def test_node_names():
    w = np.ones(8, np.float32)
    names = node_names(lambda g, x: rms_norm(g, x, w, 1e-6, name="/n", weight_name="n.weight", plugin=False,
                                             whole_rows=True), {"x": np.zeros((2, 8), np.float32)})
    assert names == ["/n/Mul", "/n/ReduceMean", "/n/Add", "/n/Sqrt", "/n/Div", "/n/Mul_1"]
    names = node_names(lambda g, x, r: add_rms_norm(g, x, r, w, 1e-6, name="/s", weight_name="s.weight", plugin=True),
                       {"x": np.zeros((2, 8), np.float32), "r": np.zeros((2, 8), np.float32)})
    assert names == ["/s/Add", "/s/RMSNormalization"]
    names = node_names(lambda g, x, r: add_rms_norm(g, x, r, w, 1e-6, name="/s", weight_name="s.weight", plugin=True,
                                                    kernel=True),
                       {"x": np.zeros((2, 8), np.float32), "r": np.zeros((2, 8), np.float32)})
    assert names == ["/s/AddRMSNorm"]


def test_rejects_matrix_weight():
    with pytest.raises(EngineError, match="1-D"):
        run_op(lambda g, x: rms_norm(g, x, np.ones((2, 4), np.float32), 1e-6, name="/n", weight_name="n.weight",
                                     plugin=True), {"x": np.zeros((1, 8), np.float32)})
