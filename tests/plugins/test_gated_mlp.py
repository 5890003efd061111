"""plugins.gated_mlp: both lowerings against NumPy (and torch's activations, as transformers uses them) and
against each other."""
import numpy as np
import pytest
import torch

from engine.core.errors import EngineError
from engine.plugins.gated_mlp import gate_times_up, gated_mlp

from .runner import assert_close, build, node_names, run_op


def activation_ref(x: np.ndarray, activation: str) -> np.ndarray:
    """transformers' ACT2FN["silu"] and ACT2FN["gelu_pytorch_tanh"], in float64."""
    t = torch.from_numpy(x.astype(np.float64))
    if activation == "silu":
        return torch.nn.functional.silu(t).numpy()
    return torch.nn.functional.gelu(t, approximate="tanh").numpy()


def mlp_ref(x, gate_up, down, activation):
    inter = gate_up.shape[0] // 2
    x64, gu, d = x.astype(np.float64), gate_up.astype(np.float64), down.astype(np.float64)
    return ((activation_ref(x64 @ gu[:inter].T, activation) * (x64 @ gu[inter:].T)) @ d.T).astype(np.float32)


def weights(rng, hidden, inter):
    gate_up = (rng.standard_normal((2 * inter, hidden)) / np.sqrt(hidden) * 2).astype(np.float32)
    down = (rng.standard_normal((hidden, inter)) / np.sqrt(inter)).astype(np.float32)
    return gate_up, down


# the reference (two MatMuls, activation spelled out), the fused projection with ORT's kernels, and with the
# engine's SwiGLU op (plugins/kernels/swiglu.cc; SiLU only, GELU keeps ORT's)
LOWERINGS = {"reference": {"plugin": False}, "fused": {"plugin": True}, "kernel": {"plugin": True, "kernel": True}}


@pytest.mark.parametrize("lowering", list(LOWERINGS))
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens,hidden,inter", [(1, 16, 32), (5, 64, 128), (17, 576, 1536), (3, 8, 13)])
def test_gated_mlp(lowering, activation, tokens, hidden, inter):
    """(3, 8, 13): an intermediate size the kernel's 8-lane loop does not tile."""
    rng = np.random.default_rng(10)
    gate_up, down = weights(rng, hidden, inter)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    y = run_op(lambda g, x: gated_mlp(g, x, gate_up, down, activation, name="/model/layers.0/mlp",
                                      weight_name="layers.0.mlp", **LOWERINGS[lowering]), {"x": x})
    assert_close(y, mlp_ref(x, gate_up, down, activation), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_lowerings_agree(activation):
    rng = np.random.default_rng(11)
    gate_up, down = weights(rng, 48, 96)
    x = (rng.standard_normal((9, 48)) * 3).astype(np.float32)   # wide range: both tails of the activation
    a, b, c = (run_op(lambda g, x: gated_mlp(g, x, gate_up, down, activation, name="/m", weight_name="m",
                                             **kwargs), {"x": x}) for kwargs in LOWERINGS.values())
    assert_close(a, b, atol=2e-5)
    assert_close(a, c, atol=2e-5)


def test_swiglu_kernel_over_the_whole_float_range():
    """The kernel's sigmoid on gates from -200 to 200 (exp(-|g|) flushed below 2^-126), zeros of both signs."""
    gate = np.concatenate([np.linspace(-200, 200, 997), [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 104.0]])
    up = np.random.default_rng(12).standard_normal(gate.size)
    x = np.concatenate([gate, up])[None].astype(np.float32)
    y = run_op(lambda g, x: gate_times_up(g, g.scope("/m"), x, gate.size, "silu", kernel=True), {"x": x})
    expected = activation_ref(x[:, :gate.size], "silu") * x[:, gate.size:].astype(np.float64)
    assert_close(y, expected.astype(np.float32), rtol=1e-6, atol=1e-30)


def test_names_and_weight_layout():
    gate_up, down = weights(np.random.default_rng(0), 8, 12)
    feeds = {"x": np.zeros((2, 8), np.float32)}
    g, _ = build(lambda g, x: gated_mlp(g, x, gate_up, down, "silu", name="/m", weight_name="layers.0.mlp",
                                        plugin=True), feeds)
    inits = {t.name: list(t.dims) for t in g.initializers if not t.name.startswith("/model/constants/")}
    assert inits == {"layers.0.mlp.gate_up.weight": [8, 24], "layers.0.mlp.down.weight": [12, 8]}
    assert node_names(lambda g, x: gated_mlp(g, x, gate_up, down, "silu", name="/m", weight_name="w", plugin=True),
                      feeds) == ["/m/MatMul", "/m/Split", "/m/Sigmoid", "/m/Mul", "/m/Mul_1", "/m/MatMul_1"]
    assert node_names(lambda g, x: gated_mlp(g, x, gate_up, down, "silu", name="/m", weight_name="w", plugin=True,
                                             kernel=True), feeds) == ["/m/MatMul", "/m/SwiGLU", "/m/MatMul_1"]


def test_rejects_bad_input():
    gate_up, down = weights(np.random.default_rng(0), 8, 12)
    feeds = {"x": np.zeros((2, 8), np.float32)}
    with pytest.raises(EngineError, match="relu"):
        build(lambda g, x: gated_mlp(g, x, gate_up, down, "relu", name="/m", weight_name="w", plugin=True), feeds)
    with pytest.raises(EngineError, match="gated MLP"):
        build(lambda g, x: gated_mlp(g, x, gate_up, down.T, "silu", name="/m", weight_name="w", plugin=True), feeds)
