"""plugins.moe: the reference lowering and the engine's MoE kernel against NumPy (softmax, top-k, normalization,
each token through its experts only), and against each other with quantized experts."""
import numpy as np
import pytest

from engine.plugins import native, quant_matmul
from engine.plugins.gated_mlp import gate_times_up, gated_mlp, quant_mlp
from engine.plugins.linear import linear
from engine.plugins.moe import moe_kernel, moe_reference
from engine.quantization.weight_only import WeightOnlyScheme, quantize

from .runner import assert_close, run_op

pytestmark = pytest.mark.skipif(not native.has_int8_dot(), reason="the MoE kernel's projections are QuantMatMul's, "
                                "which run on AVX-512 VNNI or AVX2")


def silu(v):
    return v / (1 + np.exp(-v))


def moe_ref(x, router, gate_up, down, top_k, normalize):
    """transformers' sparse block in float64: softmax over all experts, the top_k (the lower expert on a tie),
    renormalized or not, each token's experts summed in ascending expert order."""
    x64 = x.astype(np.float64)
    logits = x64 @ router.astype(np.float64).T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(p, chosen, -1)
    if normalize:
        weights /= weights.sum(-1, keepdims=True)
    inter = gate_up.shape[1] // 2
    y = np.zeros_like(x64)
    for t in range(x.shape[0]):
        for e in sorted(chosen[t]):
            h = x64[t] @ gate_up[e].astype(np.float64).T
            y[t] += weights[t][list(chosen[t]).index(e)] * ((silu(h[:inter]) * h[inter:]) @ down[e].T)
    return y.astype(np.float32)


def model(rng, hidden, experts, inter):
    router = (rng.standard_normal((experts, hidden)) / np.sqrt(hidden) * 4).astype(np.float32)
    gate_up = (rng.standard_normal((experts, 2 * inter, hidden)) / np.sqrt(hidden)).astype(np.float32)
    down = (rng.standard_normal((experts, hidden, inter)) / np.sqrt(inter)).astype(np.float32)
    return router, gate_up, down


def reference(g, x, router, gate_up, down, top_k, normalize, plugin=False):
    def expert(e, rows):
        return gated_mlp(g, rows, gate_up[e], down[e], "silu", name=f"/moe/experts.{e}", weight_name=f"moe.{e}",
                         plugin=plugin)
    return moe_reference(g, x, router, top_k, normalize, expert, name="/moe", weight_name="moe")


def float_kernel(g, x, router, gate_up, down, top_k, normalize):
    (_, n_up, h), (_, n_down, inter) = gate_up.shape, down.shape
    tiles = [np.stack([quant_matmul.pack_float(w) for w in ws]) for ws in (gate_up, down)]
    swiglu = {"swiglu": 1} if (n_up // 2) % 16 == 0 else {}
    return moe_kernel(g, x, router, *tiles, top_k=top_k, normalize=normalize, name="/moe", weight_name="moe",
                      gate_up_attrs=dict(N=n_up, bits=32, group_size=h, offsets=0, **swiglu),
                      down_attrs=dict(N=n_down, bits=32, group_size=inter, offsets=0))


CASES = [  # tokens, hidden, experts, inter, top_k; inter 24: gate|up not whole tiles, SwiGLU after the projection
    (1, 32, 4, 16, 2), (7, 64, 8, 32, 2), (33, 64, 8, 24, 3), (50, 48, 6, 16, 1), (9, 64, 4, 32, 4)]


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("tokens,hidden,experts,inter,top_k", CASES)
@pytest.mark.parametrize("lowering", ["reference", "fused", "kernel", "kernel-own-pool"])
def test_moe_against_numpy(lowering, tokens, hidden, experts, inter, top_k, normalize):
    rng = np.random.default_rng(tokens)
    router, gate_up, down = model(rng, hidden, experts, inter)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    if lowering.startswith("kernel"):
        y = run_op(lambda g, x: float_kernel(g, x, router, gate_up, down, top_k, normalize), {"x": x},
                   threads=2, pool=2 if lowering == "kernel-own-pool" else None)
    else:
        y = run_op(lambda g, x: reference(g, x, router, gate_up, down, top_k, normalize, lowering == "fused"),
                   {"x": x}, threads=2)
    assert_close(y, moe_ref(x, router, gate_up, down, top_k, normalize), rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("lowering", ["reference", "kernel"])
def test_ties_take_the_lower_expert(lowering):
    """Experts 1 and 2 route alike (equal router rows): the lower one is taken, as ONNX TopK and torch.topk do."""
    rng = np.random.default_rng(3)
    router, gate_up, down = model(rng, 32, 4, 16)
    router[2] = router[1]
    router[0] = router[3] = -router[1]   # 1 and 2 win whatever x is, when x . router[1] > 0
    x = rng.standard_normal((6, 32)).astype(np.float32)
    x *= np.sign(x @ router[1])[:, None]
    fn = float_kernel if lowering == "kernel" else reference
    y = run_op(lambda g, x: fn(g, x, router, gate_up, down, 1, False), {"x": x})
    assert_close(y, moe_ref(x, router, gate_up, down, 1, False), rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("lowering", ["reference", "kernel"])
def test_groups_of_experts_add_up_to_all_of_them(lowering):
    """Expert parallelism: each rank routes over all experts and computes its group's (first_expert, the stack's
    length); the groups' outputs sum to the whole."""
    rng = np.random.default_rng(4)
    router, gate_up, down = model(rng, 64, 8, 32)
    x = rng.standard_normal((11, 64)).astype(np.float32)

    def group(g, x, first, count):
        if lowering == "kernel":
            tiles = [np.stack([quant_matmul.pack_float(w) for w in ws[first:first + count]]) for ws in (gate_up, down)]
            return moe_kernel(g, x, router, *tiles, top_k=2, normalize=True, name="/moe", weight_name="moe",
                              gate_up_attrs=dict(N=64, bits=32, group_size=64, offsets=0, swiglu=1),
                              down_attrs=dict(N=64, bits=32, group_size=32, offsets=0), first_expert=first)

        def expert(e, rows):
            return gated_mlp(g, rows, gate_up[e], down[e], "silu", name=f"/moe/experts.{e}", weight_name=f"moe.{e}",
                             plugin=True)
        return moe_reference(g, x, router, 2, True, expert, name="/moe", weight_name="moe",
                             computed=range(first, first + count))

    parts = [run_op(lambda g, x: group(g, x, first, 4), {"x": x}) for first in (0, 4)]
    assert_close(parts[0] + parts[1], moe_ref(x, router, gate_up, down, 2, True), rtol=1e-4, atol=5e-5)
    assert not np.allclose(parts[0], 0) and not np.allclose(parts[1], 0)


def quantized_reference(g, x, router, gate_up, down, scheme):
    """Each expert a QuantMLP of the engine's QuantMatMul: the kernel's projections node by node."""
    def expert(e, rows):
        name = f"/moe/experts.{e}"
        fused = linear(g, rows, gate_up[e], None, name=f"{name}/gate_up", weight_name=f"moe.{e}.gate_up.weight",
                       scheme=scheme, kernel=True)
        hidden = gate_times_up(g, g.scope(name), fused, gate_up.shape[1] // 2, "silu", kernel=True)
        out = linear(g, hidden, down[e], None, name=f"{name}/down", weight_name=f"moe.{e}.down.weight", scheme=scheme,
                     kernel=True)
        return quant_mlp(g, out, name=f"{name}/QuantMLP")
    return moe_reference(g, x, router, 2, True, expert, name="/moe", weight_name="moe")


def quantized_kernel(g, x, router, gate_up, down, scheme):
    packed = []
    for ws in (gate_up, down):
        qs = [quantize(w, scheme, name="w") for w in ws]
        packed.append((np.stack([quant_matmul.pack(q) for q in qs]),
                       dict(N=ws.shape[1], bits=scheme.bits, group_size=scheme.group_size, offsets=0)))
    (up_tiles, up_attrs), (down_tiles, down_attrs) = packed
    return moe_kernel(g, x, router, up_tiles, down_tiles, top_k=2, normalize=True, name="/moe", weight_name="moe",
                      gate_up_attrs={**up_attrs, "swiglu": 1}, down_attrs=down_attrs)


@pytest.mark.parametrize("tokens", [1, 5, 70])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kernel_equals_its_projections_node_by_node(bits, tokens):
    """int8 / int4 experts: the MoE node computes what QuantMLP nodes over each expert's gathered rows compute."""
    rng = np.random.default_rng(bits + tokens)
    router, gate_up, down = model(rng, 64, 8, 32)
    scheme = WeightOnlyScheme(bits, 32, accuracy_level=4)
    x = rng.standard_normal((tokens, 64)).astype(np.float32)
    ours = run_op(lambda g, x: quantized_kernel(g, x, router, gate_up, down, scheme), {"x": x}, threads=2)
    nodes = run_op(lambda g, x: quantized_reference(g, x, router, gate_up, down, scheme), {"x": x}, threads=2)
    assert_close(ours, nodes, rtol=1e-5, atol=1e-5)
    # and near the float32 experts: RTN of N(0, 1) weights, two projections deep (a wrong layout is ~100% off)
    exact = moe_ref(x, router, gate_up, down, 2, True)
    assert np.sqrt(np.mean((ours - exact) ** 2) / np.mean(exact ** 2)) < (0.05 if bits == 8 else 0.5)
