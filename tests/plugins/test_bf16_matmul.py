"""plugins.bf16_matmul: the engine's Bf16MatMul against its float64 reference in each code path (AVX-512 BF16 rows,
AMX-BF16 tiles for calls of many rows, the plain loops of CPUs without them), and Bf16Gather's rows."""
import ml_dtypes
import numpy as np
import pytest

from engine.plugins.graph import ENGINE_DOMAIN
from engine.plugins import bf16_matmul, quant_matmul

from .runner import assert_close, library_without, run_op


def weight(n: int, k: int, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, k)) * 0.05).astype(np.float32)


def bf16_matmul_op(x: np.ndarray, w: np.ndarray, threads: int = 2) -> np.ndarray:
    return run_op(lambda g, xs: g.scope("/proj")("Bf16MatMul", [xs, g.weight("proj.weight", bf16_matmul.pack(w))],
                                                 domain=ENGINE_DOMAIN, N=w.shape[0]), {"x": x}, threads=threads)


def test_pack_round_trips_the_bfloat16_weight():
    w = weight(40, 96, 1)
    tiles = bf16_matmul.pack(w)
    assert tiles.shape == (3, 3, 16, 32) and tiles.dtype == np.uint16
    assert tiles.nbytes == bf16_matmul.stored_bytes(40, 96)
    np.testing.assert_array_equal(bf16_matmul.unpack(tiles, 40), quant_matmul.to_bfloat16(w))
    # column 17 (tile 1, lane 1), k = 32 + 2 * 5 + 1: chunk 1, row 5, element 2 * 1 + 1
    assert tiles[1, 1, 5, 3] == bf16_matmul.bfloat16_bits(w[17:18, 43:44])[0, 0]


def test_rounding_is_ml_dtypes_bfloat16():
    """The packer's bfloat16 bits and to_bfloat16 (QuantMatMul's bfloat16 tiles and both references) round as
    ml_dtypes' float32 -> bfloat16 cast does, on random bit patterns (normals, subnormals, infinities, values that
    round up to infinity) and ties; a NaN stays a NaN (ml_dtypes makes every NaN the same one, the kernels keep its
    payload)."""
    edges = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -0.0, 3.0e-39, np.inf, 3.4e38, np.uint32(0x7F800001).view(np.float32)]
    bits = np.random.default_rng(5).integers(0, 1 << 32, 1 << 16, dtype=np.uint64).astype(np.uint32)
    w = np.concatenate([np.array(edges, dtype=np.float32), bits.view(np.float32)])
    with np.errstate(invalid="ignore"):
        want = w.astype(ml_dtypes.bfloat16)
    nan = np.isnan(w)
    assert nan.any() and np.isinf(want[~nan].astype(np.float32)).any()
    np.testing.assert_array_equal(quant_matmul.to_bfloat16(w), want.astype(np.float32))   # NaNs where w's are
    got = bf16_matmul.bfloat16_bits(w)
    np.testing.assert_array_equal(got[~nan], want.view(np.uint16)[~nan])
    assert list(got[:2]) == [0x3F80, 0x3F82]   # ties to even: 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6


def test_reference_is_close_to_the_exact_product():
    x, w = np.random.default_rng(2).standard_normal((5, 576)).astype(np.float32), weight(64, 576, 3)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    err = np.abs(bf16_matmul.reference(x, w) - exact).max() / np.abs(exact).max()
    assert 1e-4 < err < 2e-2   # bfloat16's 8-bit mantissa on both sides: visibly inexact, still close


AMX_BF16 = quant_matmul.has_bf16_tiles()


@pytest.mark.parametrize("tokens", [1, 3, 4, 9, 63])   # one row; a short group; one group of 4; groups + a rest
@pytest.mark.parametrize("k", [64, 576])
def test_rows_match_the_reference(tokens, k):
    """Any row count on this CPU's code (from 4 rows AMX's where it has AMX-BF16): N = 40, so the last tile of 16
    columns is partial."""
    x = np.random.default_rng(tokens).standard_normal((tokens, k)).astype(np.float32)
    w = weight(40, k, k)
    want = bf16_matmul.reference(x, w)
    assert_close(bf16_matmul_op(x, w), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.skipif(not AMX_BF16, reason="this CPU has no AMX bfloat16 tiles")
@pytest.mark.parametrize("tokens, k, n", [(64, 256, 40), (97, 640, 40), (300, 256, 48)])
def test_many_rows_on_amx_match_the_reference(tokens, k, n):
    """AMX's tiles: a short last row group (97), K in passes of 256 with a short last one (640), tiles in pairs with
    one alone (N = 40: 3 tiles, N = 48: 3 tiles, all whole)."""
    x = np.random.default_rng(tokens).standard_normal((tokens, k)).astype(np.float32)
    w = weight(n, k, tokens)
    want = bf16_matmul.reference(x, w)
    assert_close(bf16_matmul_op(x, w), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.skipif(not AMX_BF16, reason="this CPU has no AMX bfloat16 tiles: the vector code runs every call")
def test_vector_rows_without_amx_match_the_reference(tmp_path, monkeypatch):
    """The library built without AMX-BF16 takes every row count through the vector code (4 rows sharing loads)."""
    library_without(monkeypatch, tmp_path, "-mno-amx-bf16")
    for tokens in (4, 9, 70):
        x = np.random.default_rng(tokens).standard_normal((tokens, 576)).astype(np.float32)
        w = weight(40, 576, tokens)
        want = bf16_matmul.reference(x, w)
        assert_close(bf16_matmul_op(x, w), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


def test_cpus_without_bf16_dot_products_compute_the_same(tmp_path, monkeypatch):
    """The library compiled for a CPU without AVX-512 BF16 (and so without AMX's bfloat16 path): plain loops."""
    x = np.random.default_rng(5).standard_normal((6, 96)).astype(np.float32)
    w = weight(40, 96, 6)
    vector = bf16_matmul_op(x, w)
    library_without(monkeypatch, tmp_path, "-mno-avx512bf16", "-mno-amx-bf16")
    plain = bf16_matmul_op(x, w)
    assert_close(plain, vector, rtol=1e-6, atol=1e-6 * float(np.abs(vector).max()))


def test_gather_reads_rows_of_the_same_tiles():
    w = weight(40, 96, 7)
    ids = np.array([0, 17, 39, 17, 31], dtype=np.int64)
    rows = run_op(lambda g, i: g.scope("/embed")("Bf16Gather", [g.weight("table", bf16_matmul.pack(w)), i],
                                                 domain=ENGINE_DOMAIN), {"ids": ids})
    np.testing.assert_array_equal(rows, quant_matmul.to_bfloat16(w)[ids])
