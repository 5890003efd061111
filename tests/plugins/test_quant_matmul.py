"""plugins.quant_matmul: the engine's QuantMatMul op against its float64 references, against MatMulNBits (the op it
replaces) and in each of its code paths: AMX's bfloat16 tiles (calls of many rows), AMX's int8 tiles, AVX-512 VNNI,
AVX2 and the plain loops of CPUs with none of them."""
import ctypes

import numpy as np
import pytest

from engine.plugins.graph import ENGINE_DOMAIN
from engine.plugins import native, quant_matmul
from engine.plugins.linear import quantized_linear
from engine.quantization.weight_only import (QuantizedWeight, WeightOnlyScheme, block_grid, dequantize, quantize,
                                             unpack)

from .bf16_reference import reference_bf16
from .runner import PLAIN, assert_close, library_without, run_op


def q4_1_weight(n: int, k: int, seed: int) -> QuantizedWeight:
    """A weight on GGUF Q4_1's grid (d, m float16 per block of 32, every block spanning q = 0..15), kept."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.001, 0.01, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.05, 0.0, (n, k // 32, 1)).astype(np.float16).astype(np.float32)
    codes = rng.integers(0, 16, (n, k // 32, 32))
    codes[..., 0], codes[..., 1] = 0, 15
    q = block_grid((codes * d + m).reshape(n, k).astype(np.float32), 32)
    assert q is not None and q.offsets is not None
    return q


def rtn_weight(n: int, k: int, bits: int, group: int, seed: int) -> QuantizedWeight:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return quantize(w, WeightOnlyScheme(bits, group, accuracy_level=4))


def quant_matmul_op(x: np.ndarray, q: QuantizedWeight, threads: int = 2, pool: int | None = None) -> np.ndarray:
    n, _ = q.shape
    return run_op(lambda g, xs: g.scope("/proj")("QuantMatMul", [xs, g.weight("proj.weight", quant_matmul.pack(q))],
                                                 domain=ENGINE_DOMAIN, N=n, bits=q.bits, group_size=q.group_size,
                                                 offsets=int(q.offsets is not None)), {"x": x}, threads=threads,
                  pool=pool)


AMX = {"amx_tile", "amx_int8"} <= set(native._cpu_flags().split())
AMX_BF16 = quant_matmul.has_bf16_tiles()
BF16_ROWS = quant_matmul.BF16_ROWS if AMX_BF16 else None   # calls of as many rows take bfloat16 tiles


def expected(x: np.ndarray, q: QuantizedWeight) -> np.ndarray:
    """What the op computes for this many rows on this CPU."""
    bf16 = BF16_ROWS is not None and x.shape[0] >= BF16_ROWS
    return (reference_bf16 if bf16 else quant_matmul.reference)(x, q)


WEIGHTS = {  # name -> (n, k) -> QuantizedWeight; n = 40 or 44: the last tile of 16 columns is partial
    "q4_1": lambda n, k: q4_1_weight(n, k, 1),
    "int4_g32": lambda n, k: rtn_weight(n, k, 4, 32, 2),
    "int8_g32": lambda n, k: rtn_weight(n, k, 8, 32, 3),
    "int4_g128": lambda n, k: rtn_weight(n, k, 4, 128, 4),
    "int8_g64": lambda n, k: rtn_weight(n, k, 8, 64, 5),
}


@pytest.mark.parametrize("weight", sorted(WEIGHTS))
# rows in groups of 4 (a short last group), chunks of 64 rows; on AVX-512 VNNI passes of 10 and 8 rows (16: 8 + 8,
# 32: 10 + 10 + 8 + 4, 63: 5 x 10 + 8 + 4 + 1); on AMX groups of 16 (the rest in groups of 4), and from 64 rows
# bfloat16 tiles: pairs of row groups, a short last group
@pytest.mark.parametrize("tokens", [1, 3, 6, 16, 32, 63, 70, 300])
# the last tile of 16 columns partial: 8 columns (one AVX2 half), or 12 (one and two rows take both halves in one
# pass, the second partial)
@pytest.mark.parametrize("n", [40, 44])
def test_matches_float64_reference(weight, tokens, n):
    q = WEIGHTS[weight](n, 256)
    x = np.random.default_rng(tokens).standard_normal((tokens, 256)).astype(np.float32)
    x[0, :32] = 0   # a block of zeros: scale 0, nothing added
    want = expected(x, q)
    assert_close(quant_matmul_op(x, q), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 9])
def test_matches_matmulnbits_at_accuracy_level_4(bits, tokens):
    """The op it replaces rounds the activations to int8 the same way: equal up to float summation order."""
    q = rtn_weight(96, 128, bits, 32, 7)
    x = np.random.default_rng(8).standard_normal((tokens, 128)).astype(np.float32)
    nbits = run_op(lambda g, xs: quantized_linear(g, xs, q, None, name="/proj", weight_name="proj.weight",
                                                  accuracy_level=4), {"x": x})
    assert_close(quant_matmul_op(x, q), nbits, rtol=1e-5, atol=1e-5 * float(np.abs(nbits).max()))


@pytest.mark.parametrize("reference, bound", [(quant_matmul.reference, 2e-2), (reference_bf16, 5e-3)])
def test_references_are_close_to_the_exact_product(reference, bound):
    """The references themselves, against the exact product of the quantized weight: int8 activations per block
    cost about 1% of the largest output, bfloat16 activations and weights about a quarter of that."""
    q = q4_1_weight(64, 576, 9)
    x = np.random.default_rng(10).standard_normal((80, 576)).astype(np.float32)
    x[:, ::37] *= 8   # a few outlier channels, as real activations have
    exact = x.astype(np.float64) @ dequantize(q).astype(np.float64).T
    error = np.abs(reference(x, q) - exact).max() / np.abs(exact).max()
    assert bound / 100 < error < bound


@pytest.mark.parametrize("weight", ["q4_1", "int4_g32", "int8_g64"])
def test_pack_round_trips(weight):
    q = WEIGHTS[weight](40, 256)
    values, d, m = quant_matmul.unpack_blocks(quant_matmul.pack(q), 40, q.bits, q.group_size, q.offsets is not None)
    np.testing.assert_array_equal(values, unpack(q))
    np.testing.assert_array_equal(d, q.scales)
    if q.offsets is None:
        assert m is None
    else:   # the float16 minima block_grid found: offsets = m + 8 d up to the offsets' float32 rounding
        np.testing.assert_allclose(m + 8 * d, q.offsets, rtol=2**-22, atol=0)


@pytest.mark.parametrize("without", [("-mno-avx512vnni",), PLAIN], ids=["avx2", "plain"])   # AVX2 tiles; plain loops
def test_narrower_cpus_compute_the_same(tmp_path, monkeypatch, without):
    """The kernel library compiled for a CPU without AVX-512 VNNI, or without AVX2 too, computes the same as the
    vector code of this one: every weight kind, a row group of 4 and a short one, a partial last tile."""
    x = np.random.default_rng(11).standard_normal((6, 256)).astype(np.float32)
    weights = [WEIGHTS[name](40, 256) for name in sorted(WEIGHTS)]
    vector = [quant_matmul_op(x, q) for q in weights]
    library_without(monkeypatch, tmp_path, *without)
    narrower = [quant_matmul_op(x, q) for q in weights]
    for a, b in zip(narrower, vector):
        assert_close(a, b, rtol=1e-6, atol=1e-6 * float(np.abs(b).max()))


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles (amx_tile, amx_int8)")
def test_amx_is_used_on_this_cpu():
    """The kernel was granted the tile registers, so the AMX tests below run the AMX code."""
    library = ctypes.CDLL(str(native.library()))
    assert library.EngineQuantMatMulAmx() == 1
    assert library.EngineQuantMatMulBf16Rows() == (BF16_ROWS or 0)


@pytest.mark.skipif(not AMX_BF16, reason="this CPU has no AMX bfloat16 tiles (amx_bf16, avx512_bf16)")
@pytest.mark.parametrize("tokens, k", [(64, 256), (97, 640), (300, 256)])
def test_bf16_tiles_match_their_reference(tokens, k):
    """Calls of >= 64 rows on AMX-BF16: every weight kind, a short last row group (97 rows), K in passes of 256 with
    a short last one (640), a partial and an odd last tile (N = 40: a pair of tiles and one alone)."""
    x = np.random.default_rng(tokens).standard_normal((tokens, k)).astype(np.float32)
    for name in sorted(WEIGHTS):
        q = WEIGHTS[name](40, k)
        want = reference_bf16(x, q)
        assert_close(quant_matmul_op(x, q), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.skipif(not AMX, reason="this CPU has no AMX tiles (amx_tile, amx_int8)")
@pytest.mark.parametrize("tokens", [16, 38, 300])   # one group of 16; 2 groups + 6 rows for VNNI; over one item
def test_amx_rows_equal_the_vnni_code(tmp_path, monkeypatch, tokens):
    """Rows 16 at a time on AMX's int8 tiles (the library built without AMX-BF16, so at every row count) give
    exactly the VNNI code's floats (the same integer dots, scaled in the same order), for every weight kind: groups
    of 32 and of 64 / 128 (two tile products a block), a partial last tile."""
    x = np.random.default_rng(tokens).standard_normal((tokens, 256)).astype(np.float32)
    weights = [WEIGHTS[name](40, 256) for name in sorted(WEIGHTS)]
    no_amx_bf16 = library_without(monkeypatch, tmp_path, "-mno-amx-bf16")
    assert ctypes.CDLL(str(no_amx_bf16)).EngineQuantMatMulBf16Rows() == 0
    amx = [quant_matmul_op(x, q) for q in weights]
    no_amx = library_without(monkeypatch, tmp_path, "-mno-amx-tile", "-mno-amx-int8")
    assert ctypes.CDLL(str(no_amx)).EngineQuantMatMulAmx() == 0
    for a, b in zip(amx, [quant_matmul_op(x, q) for q in weights]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("weight", ["int4_g32", "int8_g64", "q4_1"])
def test_gather_reads_rows_of_the_same_blocks(weight):
    """QuantGather (a tied embedding reading the quantized lm_head's blocks) gives the dequantized rows."""
    q = WEIGHTS[weight](40, 256)
    ids = np.array([0, 39, 17, 17, 16], dtype=np.int64)
    rows = run_op(lambda g, i: g.scope("/embed")("QuantGather", [g.weight("table", quant_matmul.pack(q)), i],
                                                 domain=ENGINE_DOMAIN, bits=q.bits, group_size=q.group_size,
                                                 offsets=int(q.offsets is not None)), {"ids": ids})
    expected = dequantize(q)[ids]
    if q.offsets is None:   # (q - zero point) * d, as dequantize rounds it
        np.testing.assert_array_equal(rows, expected)
    else:
        assert_close(rows, expected, rtol=1e-6, atol=1e-6 * float(np.abs(expected).max()))


def gated_op(x: np.ndarray, q: QuantizedWeight, fused: bool) -> np.ndarray:
    """silu(gate) * up of the projection by q ([gate; up] rows): QuantMatMul's swiglu=1 epilogue, or its
    projection into the SwiGLU op."""
    n, _ = q.shape

    def graph(g, xs):
        extra = {"swiglu": 1} if fused else {}
        y = g.scope("/proj")("QuantMatMul", [xs, g.weight("proj.weight", quant_matmul.pack(q))], domain=ENGINE_DOMAIN,
                             N=n, bits=q.bits, group_size=q.group_size, offsets=int(q.offsets is not None), **extra)
        return y if fused else g.scope("/act")("SwiGLU", [y], domain=ENGINE_DOMAIN)

    return run_op(graph, {"x": x})


@pytest.mark.parametrize("tokens", [1, 6, 70, 300])   # vector tiles in pairs (AMX int8: staged); bfloat16 tiles
def test_swiglu_epilogue_equals_the_swiglu_op(tokens):
    """swiglu=1 gives exactly SwiGLU(QuantMatMul): the same projection, the same silu(gate) * up (swiglu.h), for
    every weight kind; N = 96: gate and up of 3 tiles each, so the bfloat16 tiles pair tile i with tile i + 3."""
    x = np.random.default_rng(tokens).standard_normal((tokens, 256)).astype(np.float32)
    for name in sorted(WEIGHTS):
        q = WEIGHTS[name](96, 256)
        fused = gated_op(x, q, True)
        assert fused.shape == (tokens, 48)
        np.testing.assert_array_equal(fused, gated_op(x, q, False))


def normed_projection(x: np.ndarray, r: np.ndarray, w: np.ndarray, q: QuantizedWeight, *, reader: bool = False):
    """add_rms_norm (plugins/rms_norm.py) of a QuantMatMul's output: with the engine's kernels it becomes one
    QuantMatMulAddRMSNorm node; `reader`: another node reads the projection too, which keeps it a QuantMatMul and
    an AddRMSNorm. Returns (normed, total) and the graph's node types."""
    from engine.plugins.rms_norm import add_rms_norm
    n, _ = q.shape
    ops = []

    def graph(g, xs, rs):
        y = g.scope("/proj")("QuantMatMul", [xs, g.weight("proj.weight", quant_matmul.pack(q))], domain=ENGINE_DOMAIN,
                             N=n, bits=q.bits, group_size=q.group_size, offsets=int(q.offsets is not None))
        if reader:
            g.scope("/other")("Relu", [y])
        out = add_rms_norm(g, y, rs, w, 1e-5, name="/norm", weight_name="norm.weight", plugin=True, kernel=True)
        ops.extend(nd.op_type for nd in g.nodes)
        return out

    return run_op(graph, {"x": x, "r": r}), ops


@pytest.mark.parametrize("tokens", [1, 6, 70])   # one row inline; rows on the pool; bfloat16 tiles where AMX has them
def test_add_rms_norm_epilogue_equals_the_two_ops(tokens):
    """A norm whose x only a QuantMatMul reads is done by that node (QuantMatMulAddRMSNorm), bit for bit what
    QuantMatMul then AddRMSNorm give (add_rms_norm.h's row in both), for every weight kind."""
    rng = np.random.default_rng(tokens)
    x, r = (rng.standard_normal((tokens, 256)).astype(np.float32) for _ in range(2))
    w = rng.uniform(0.5, 1.5, 40).astype(np.float32)
    for name in sorted(WEIGHTS):
        q = WEIGHTS[name](40, 256)   # N = 40: a partial last tile
        (normed, total), ops = normed_projection(x, r[:, :40], w, q)
        assert ops == ["QuantMatMulAddRMSNorm"], ops
        (want_normed, want_total), ops = normed_projection(x, r[:, :40], w, q, reader=True)
        assert ops == ["QuantMatMul", "Relu", "AddRMSNorm"], ops
        np.testing.assert_array_equal(total, want_total)
        np.testing.assert_array_equal(normed, want_normed)
        np.testing.assert_allclose(total, expected(x, q) + r[:, :40], rtol=1e-5, atol=1e-5)


def quant_projection(g, xs: str, q: QuantizedWeight, stem: str, **extra) -> str:
    """QuantMatMul of xs by q's packed blocks, initializer "{stem}.weight"; `extra` attributes (swiglu)."""
    return g.scope(f"/{stem}")("QuantMatMul", [xs, g.weight(f"{stem}.weight", quant_matmul.pack(q))],
                               domain=ENGINE_DOMAIN, N=q.shape[0], bits=q.bits, group_size=q.group_size,
                               offsets=int(q.offsets is not None), **extra)


def mlp_graph(x: np.ndarray, r: np.ndarray, w: np.ndarray, gate_up, down, *, fold: bool, norm: bool,
              projection=quant_projection, threads: int = 1):
    """down(silu(gate) * up) of x as QuantMatMul (swiglu=1) then QuantMatMul, with the residual add and norm after
    it (add_rms_norm) when `norm`; `fold`: through gated_mlp.quant_mlp. `projection(g, x, weight, stem, **extra)`
    makes each QuantMatMul (default: a QuantizedWeight's blocks). Returns the output(s) and the node types."""
    from engine.plugins.gated_mlp import quant_mlp
    from engine.plugins.rms_norm import add_rms_norm
    ops = []

    def graph(g, xs, rs):
        y = projection(g, projection(g, xs, gate_up, "gate_up", swiglu=1), down, "down")
        if fold:
            y = quant_mlp(g, y, name="/mlp/QuantMLP")
        out = add_rms_norm(g, y, rs, w, 1e-5, name="/norm", weight_name="norm.weight", plugin=True,
                           kernel=fold) if norm else y
        ops.extend(nd.op_type for nd in g.nodes)
        return out

    return run_op(graph, {"x": x, "r": r}, threads=threads), ops


@pytest.mark.parametrize("tokens", [1, 6, 70])
def test_quant_mlp_equals_its_two_projections(tokens):
    """A quantized gated MLP folded into one QuantMLP node (plugins/gated_mlp.quant_mlp), with the norm after it
    (QuantMLPAddRMSNorm) or not, gives bit for bit what its two QuantMatMul nodes (then AddRMSNorm) give, for
    weights of each kind in either projection. From 6 rows the SwiGLU tiles of the vector code quantize the hidden
    rows for a down of 32-blocks themselves (an item's 64 columns: whole blocks); 128-blocks and one row (16-column
    items) quantize them in down's own pass."""
    rng = np.random.default_rng(tokens)
    x, r = rng.standard_normal((tokens, 64)).astype(np.float32), rng.standard_normal((tokens, 40)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 40).astype(np.float32)
    for first, second in [("q4_1", "int8_g32"), ("int4_g32", "q4_1"), ("int8_g64", "int4_g128")]:
        gate_up, down = WEIGHTS[first](256, 64), WEIGHTS[second](40, 128)   # I = 128; N = 40: a partial tile
        want, ops = mlp_graph(x, r, w, gate_up, down, fold=False, norm=False)
        assert ops == ["QuantMatMul", "QuantMatMul"]
        got, ops = mlp_graph(x, r, w, gate_up, down, fold=True, norm=False)
        assert ops == ["QuantMLP"]
        np.testing.assert_array_equal(got, want)
        (normed, total), ops = mlp_graph(x, r, w, gate_up, down, fold=True, norm=True)
        assert ops == ["QuantMLPAddRMSNorm"]
        (want_normed, want_total), _ = normed_projection_of(want, r, w)
        np.testing.assert_array_equal(total, want_total)
        np.testing.assert_array_equal(normed, want_normed)


def normed_projection_of(y: np.ndarray, r: np.ndarray, w: np.ndarray):
    """AddRMSNorm of y and r: (normed, total)."""
    from engine.plugins.rms_norm import add_rms_norm
    return run_op(lambda g, ys, rs: add_rms_norm(g, ys, rs, w, 1e-5, name="/norm", weight_name="norm.weight",
                                                 plugin=True, kernel=True), {"y": y, "r": r}), None
