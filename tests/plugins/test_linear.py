"""plugins.linear: MatMul with the build-time transposed weight (+ bias) against NumPy."""
import numpy as np
import pytest

from engine.core.errors import EngineError
from engine.plugins.linear import bias_name_for, linear, quantized_linear
from engine.quantization.weight_only import block_grid

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


@pytest.mark.parametrize("kernel", [False, True], ids=["onnx", "kernel"])
@pytest.mark.parametrize("tokens", [1, 5, 19])   # 19: the kernel's rows in groups of 8, the last short
def test_kept_4_bit_blocks_with_offsets_match_numpy(kernel, tokens):
    """A weight on GGUF Q4_1's grid (per block of 32: d * q + m) is kept exactly; its offsets m are added by
    Reshape + ReduceSum + MatMul + Add, or by the engine's BlockOffsets op (plugins/kernels/block_offsets.cc)."""
    rng = np.random.default_rng(3)
    d = rng.uniform(0.001, 0.01, (2100, 3, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.05, 0.0, (2100, 3, 1)).astype(np.float16).astype(np.float32)
    codes = rng.integers(0, 16, (2100, 3, 32))
    codes[..., 0], codes[..., 1] = 0, 15   # every block spans the grid, as GGUF's min/max quantizer makes it
    w = (codes * d + m).reshape(2100, 96).astype(np.float32)
    q = block_grid(w, 32)
    assert q is not None and q.offsets is not None
    x = rng.standard_normal((tokens, 96)).astype(np.float32)
    y = run_op(lambda g, xs: quantized_linear(g, xs, q, None, name="/proj", weight_name="proj.weight",
                                              accuracy_level=0, kernel=kernel), {"x": x}, threads=2)
    assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)
