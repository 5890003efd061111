"""plugins.linear quantized: MatMulNBits (plugin) and blocked DequantizeLinear + MatMul (reference) against
NumPy dequantize + matmul and against each other; GatherBlockQuantized sharing the lm_head's packed table."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from engine.plugins.linear import linear, quantized_gather, quantized_linear, scale_name_for
from engine.quantization.weight_only import WeightOnlyScheme, dequantize, quantize
from tests.plugins.runner import assert_close, build, run_op


def _case(tokens, k, n, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((tokens, k)).astype(np.float32),
            (rng.standard_normal((n, k)) * 0.1).astype(np.float32), rng.standard_normal(n).astype(np.float32))


@pytest.mark.parametrize("bits,group", [(4, 16), (4, 32), (4, 128), (8, 32), (8, 64)])
@pytest.mark.parametrize("tokens", [1, 9])
def test_plugin_and_reference_match_numpy_dequantize(bits, group, tokens):
    x, w, b = _case(tokens, 128, 96, bits * 1000 + group + tokens)
    expected = x.astype(np.float64) @ dequantize(quantize(w, WeightOnlyScheme(bits, group))).T.astype(np.float64) + b
    scale = np.abs(expected).max()
    results = {}
    for plugin in (True, False):
        scheme = WeightOnlyScheme(bits, group, accuracy_level=0)
        # ORT's optimizer fuses DequantizeLinear + MatMul into MatMulNBits (at accuracy level 4): the reference
        # runs unoptimized so that it stays the plain lowering.
        level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL if plugin else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        results[plugin] = run_op(lambda g, x: linear(g, x, w, b, name="/p", weight_name="l.weight", scheme=scheme,
                                                     plugin=plugin), {"x": x}, level=level)
        assert_close(results[plugin], expected.astype(np.float32), rtol=1e-4, atol=1e-5 * scale)
    assert_close(results[True], results[False], rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("bits", [4, 8])
def test_accuracy_level_4_within_int8_activation_rounding(bits):
    """Level 4 quantizes activations to int8 per block: close to the weight-only result, not equal."""
    x, w, _ = _case(5, 256, 64, bits)
    q = quantize(w, WeightOnlyScheme(bits, 32))
    expected = x @ dequantize(q).T
    y = run_op(lambda g, x: quantized_linear(g, x, q, None, name="/p", weight_name="l.weight", accuracy_level=4),
               {"x": x})
    rel = np.abs(y - expected).max() / np.abs(expected).max()
    assert rel < 2e-2, rel


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("plugin", [True, False])
def test_stored_tensors_have_the_quantized_dtype(bits, plugin):
    x, w, _ = _case(2, 64, 48, 0)
    g, _ = build(lambda g, x: linear(g, x, w, None, name="/p", weight_name="l.weight",
                                     scheme=WeightOnlyScheme(bits, 32), plugin=plugin), {"x": x})
    inits = {t.name: t for t in g.initializers}
    weight, scales = inits["l.weight"], inits[scale_name_for("l.weight")]
    assert scales.data_type == onnx.TensorProto.FLOAT
    if plugin:
        assert weight.data_type == onnx.TensorProto.UINT8 and list(weight.dims) == [48, 2, 32 * bits // 8]
        assert [n.op_type for n in g.nodes if n.op_type != "Identity"] == ["MatMulNBits"]
    else:
        assert weight.data_type == (onnx.TensorProto.INT4 if bits == 4 else onnx.TensorProto.INT8)
        assert [n.op_type for n in g.nodes if n.op_type != "Identity"] == ["DequantizeLinear", "MatMul"]
    assert len(weight.raw_data) == 48 * 64 * bits // 8


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("plugin", [True, False])
def test_gather_shares_the_lm_head_table(bits, plugin):
    rng = np.random.default_rng(bits)
    table = quantize((rng.standard_normal((100, 64)) * 0.2).astype(np.float32), WeightOnlyScheme(bits, 16))
    ids = np.array([0, 7, 99, 7], dtype=np.int64)
    deq = dequantize(table)

    def fn(g, ids):
        rows = quantized_gather(g, table, ids, name="/embed", weight_name="vocab_embedding.weight", plugin=plugin)
        logits = quantized_linear(g, rows, table, None, name="/lm_head", weight_name="vocab_embedding.weight",
                                  accuracy_level=0, plugin=plugin, shared=True)
        return rows, logits

    g, _ = build(fn, {"ids": ids})
    assert sum(t.name == "vocab_embedding.weight" for t in g.initializers) == 1   # stored once
    rows, logits = run_op(fn, {"ids": ids}, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    assert_close(rows, deq[ids], rtol=0, atol=0)
    assert_close(logits, (deq[ids].astype(np.float64) @ deq.T).astype(np.float32), rtol=1e-4, atol=1e-4)
