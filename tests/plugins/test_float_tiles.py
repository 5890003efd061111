"""QuantMatMul's float32 tiles (bits=32, plugins/kernels/float_tiles.h): a float32 engine's projections, against the
float64 product, in every pass shape, on each vector code, and in every fused form the quantized tiles have."""
import numpy as np
import pytest

from engine.plugins.graph import Graph
from engine.plugins import native, quant_matmul
from engine.plugins.linear import linear

from .runner import AVX2_ONLY, PLAIN, assert_close, library_without, run_op
from .test_quant_matmul import mlp_graph, normed_projection_of

pytestmark = pytest.mark.skipif(not native.has_int8_dot(), reason="float32 tiles run where the CPU has AVX2 or "
                                "AVX-512 (plugins/quant_matmul.float_runs)")


def weight(n: int, k: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)


def projection(g, x: str, w: np.ndarray, stem: str, **extra) -> str:
    tiles = g.weight(f"{stem}.weight", quant_matmul.pack_float(w))
    return quant_matmul.float_node(g.scope(f"/{stem}"), x, tiles, *w.shape, **extra)


def float_op(x: np.ndarray, w: np.ndarray, **run) -> np.ndarray:
    return run_op(lambda g, xs: projection(g, xs, w, "proj"), {"x": x}, **run)


def exact(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)


# passes of 10 rows (AVX-512; 4 on AVX2), then of 4, then 3, 2 or 1 (1-3 rows: 2-4 chains of sums); chunks of 64
# rows (70 on AVX-512: 60 + 4, then 4 + 2)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 7, 9, 10, 16, 19, 33, 64, 70, 300])
@pytest.mark.parametrize("n, k", [(48, 64), (40, 99)])   # K past the chains' steps; a partial last tile
def test_matches_the_float64_product(tokens, n, k):
    x = np.random.default_rng(tokens).standard_normal((tokens, k)).astype(np.float32)
    w = weight(n, k, k)
    want = exact(x, w)
    got = float_op(x, w, threads=2)
    assert_close(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    np.testing.assert_array_equal(float_op(x, w, pool=2), got)   # the engine's own pool: the same floats


def test_pack_float_lays_out_tiles_of_16_columns():
    w = weight(40, 5, 1)
    tiles = quant_matmul.pack_float(w).view(np.float32).reshape(3, 5, 16)   # [tile, k, column]
    np.testing.assert_array_equal(tiles[1, :, 3], w[19])
    np.testing.assert_array_equal(tiles[2, :, 8:], 0)   # zero columns fill the last tile


@pytest.mark.parametrize("without", [AVX2_ONLY, PLAIN], ids=["avx2", "plain"])
def test_narrower_cpus_compute_the_same(tmp_path, monkeypatch, without):
    x = np.random.default_rng(2).standard_normal((13, 99)).astype(np.float32)
    w = weight(40, 99, 3)
    vector = float_op(x, w)
    library_without(monkeypatch, tmp_path, *without)
    narrower = float_op(x, w)
    assert_close(narrower, vector, rtol=1e-5, atol=1e-5 * float(np.abs(vector).max()))


def test_gather_reads_rows_of_the_tiles():
    """QuantGather of the tiles (a tied embedding reading the float32 lm_head's) gives the weight's rows exactly."""
    w = weight(40, 24, 4)
    ids = np.array([0, 39, 17, 17, 16], dtype=np.int64)
    rows = run_op(lambda g, i: quant_matmul.float_gather(g.scope("/embed"), g.weight("table",
                                                                                     quant_matmul.pack_float(w)),
                                                         i, 24), {"ids": ids})
    np.testing.assert_array_equal(rows, w[ids])


@pytest.mark.parametrize("tokens", [1, 6, 70])
def test_fused_forms_equal_their_nodes(tokens):
    """swiglu=1, QuantMLP and the *AddRMSNorm epilogues over float32 tiles give bit for bit what the unfused nodes
    give (a float32 engine's layer: plugins/gated_mlp.py, rms_norm.py)."""
    rng = np.random.default_rng(tokens)
    x, r = rng.standard_normal((tokens, 64)).astype(np.float32), rng.standard_normal((tokens, 48)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, 48).astype(np.float32)
    gate_up, down = weight(256, 64, 5), weight(48, 128, 6)

    def mlp(fold: bool, with_norm: bool):
        return mlp_graph(x, r, norm, gate_up, down, fold=fold, norm=with_norm, projection=projection, threads=2)

    unfused, ops = mlp(False, False)
    assert ops == ["QuantMatMul", "QuantMatMul"]
    hidden = exact(x, gate_up)
    silu = hidden[:, :128] / (1 + np.exp(-hidden[:, :128].astype(np.float64))) * hidden[:, 128:]
    want = exact(silu.astype(np.float32), down)
    assert_close(unfused, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    folded, ops = mlp(True, False)
    assert ops == ["QuantMLP"]
    np.testing.assert_array_equal(folded, unfused)
    (normed, total), ops = mlp(True, True)
    assert ops == ["QuantMLPAddRMSNorm"]
    (want_normed, want_total), _ = normed_projection_of(unfused, r, norm)
    np.testing.assert_array_equal(total, want_total)
    np.testing.assert_array_equal(normed, want_normed)


@pytest.mark.parametrize("n, kernel, op", [(48, True, "QuantMatMul"), (48, False, "MatMul"), (40, True, "MatMul")])
def test_linear_takes_the_tiles_where_they_run(n, kernel, op):
    """A float32 projection is QuantMatMul's float32 tiles with the engine's kernels when its columns are whole
    tiles (the memory plan counts the float32 weight, unpadded); MatMul of W^T otherwise."""
    g = Graph("linear")
    x = g.input("x", 1, ["T", 32])
    linear(g, x, weight(n, 32, 7), None, name="/proj", weight_name="proj.weight", kernel=kernel)
    assert [nd.op_type for nd in g.nodes] == [op]
    assert [len(t.raw_data) for t in g.initializers] == [n * 32 * 4]
