"""plugins.linear: MatMul with the build-time transposed weight (+ bias) against NumPy."""
import numpy as np
import pytest

from engine.core.errors import EngineError
from engine.plugins.linear import bias_name_for, linear

from .runner import assert_close, build, node_names, run_op


@pytest.mark.parametrize("tokens,in_features,out_features", [(1, 16, 8), (7, 64, 192), (33, 48, 48)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_numpy(tokens, in_features, out_features, with_bias):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, in_features)).astype(np.float32)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32)
    b = rng.standard_normal(out_features).astype(np.float32) if with_bias else None
    y = run_op(lambda g, x: linear(g, x, w, b, name="/model/layers.0/attn/qkv_proj",
                                   weight_name="layers.0.attention.qkv.weight"), {"x": x})
    expected = x.astype(np.float64) @ w.T.astype(np.float64) + (0 if b is None else b)
    assert_close(y, expected.astype(np.float32), rtol=1e-5, atol=1e-5 * np.sqrt(in_features))


def test_linear_names_and_layout():
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones(3, np.float32)
    g, _ = build(lambda g, x: linear(g, x, w, b, name="/model/layers.0/attn/qkv_proj",
                                     weight_name="layers.0.attention.qkv.weight"), {"x": np.zeros((2, 4), np.float32)})
    inits = {t.name: t for t in g.initializers}
    assert list(inits["layers.0.attention.qkv.weight"].dims) == [4, 3]   # stored as MatMul's [in, out]
    assert "layers.0.attention.qkv.bias" in inits
    assert node_names(lambda g, x: linear(g, x, w, b, name="/p", weight_name="w.weight"),
                      {"x": np.zeros((2, 4), np.float32)}) == ["/p/MatMul", "/p/Add"]


def test_bias_name():
    assert bias_name_for("layers.3.attention.qkv.weight") == "layers.3.attention.qkv.bias"
    assert bias_name_for("proj") == "proj.bias"


def test_linear_rejects_bad_shapes():
    with pytest.raises(EngineError, match="2-D"):
        build(lambda g, x: linear(g, x, np.zeros(4, np.float32), None, name="/p", weight_name="w"),
              {"x": np.zeros((1, 4), np.float32)})
    with pytest.raises(EngineError, match="bias"):
        build(lambda g, x: linear(g, x, np.zeros((3, 4), np.float32), np.zeros(4, np.float32), name="/p",
                                  weight_name="w"), {"x": np.zeros((1, 4), np.float32)})
