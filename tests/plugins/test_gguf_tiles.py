"""plugins.gguf_tiles: GGUF's block formats (Q4_0 .. Q8_0, Q4_K, Q5_K, Q6_K) packed for the engine's QuantMatMul and
QuantGather, against their references: gguf's own dequantization for the weights (exact), and int8 activations per
block times those weights for the products, on each code path (AVX-512 VNNI, AVX2, and the plain loops of CPUs with
neither)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine.plugins.graph import ENGINE_DOMAIN
from engine.plugins import gguf_tiles, native
from engine.quantization.gguf_blocks import decode

from .runner import AVX2_ONLY, PLAIN, library_without, run_op

KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# bytes of one K-quant block of 256 and where its float16 scales are (llama.cpp's block_q*_K)
K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}


def raw_weight(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [N, row bytes] of a valid GGUF tensor: gguf's quantizer where it has one, else random K-quant blocks
    whose float16 scale fields hold small finite values."""
    rng = np.random.default_rng(seed)
    if kind not in K_BLOCKS:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return gguf_quantize(w, GGMLQuantizationType[kind])
    size, halves = K_BLOCKS[kind]
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for at in halves:
        scale = rng.uniform(1e-4, 2e-3, (n, k // 256)).astype(np.float16)
        blocks[:, :, at:at + 2] = scale.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


def quant_matmul(x: np.ndarray, blocks: np.ndarray, f: gguf_tiles.Format, n: int, float_x: bool = False) -> np.ndarray:
    return run_op(lambda g, xs: gguf_tiles.gguf_node(g.scope("/proj"), xs, g.weight("proj.weight", blocks), n, f,
                                                     float_x=float_x), {"x": x}, threads=2)


def quant_gather(blocks: np.ndarray, f: gguf_tiles.Format, ids: np.ndarray) -> np.ndarray:
    return run_op(lambda g, i: g.scope("/embed")("QuantGather", [g.weight("embed.weight", blocks), i],
                                                 domain=ENGINE_DOMAIN, **f.attributes()), {"ids": ids})


def check_products(kind: str, rows: tuple[int, ...] = (1, 3, 11, 21)) -> None:
    """Int8 activations against gguf_tiles.reference; float32 ones (float_x, the accuracy report's reference)
    against the float64 product of x and gguf's own dequantization."""
    n, k = 40, 512   # a partial last tile of 16 columns; two K-quant super-blocks
    raw = raw_weight(kind, n, k, 1)
    dec = decode(raw, kind, k)
    blocks, f = gguf_tiles.pack(dec)
    weights = gguf_dequantize(raw, GGMLQuantizationType[kind]).astype(np.float64)
    for t in rows + (70,):   # 70: two row chunks of the kernel's items
        x = np.random.default_rng(t).standard_normal((t, k)).astype(np.float32)
        for float_x, expected in ((False, gguf_tiles.reference(x, dec)), (True, (x @ weights.T).astype(np.float32))):
            scale = np.abs(expected).max()
            np.testing.assert_allclose(quant_matmul(x, blocks, f, n, float_x), expected, rtol=1e-5,
                                       atol=1e-5 * scale, err_msg=f"{kind}, {t} rows, float_x {float_x}")


needs_int8_dot = pytest.mark.skipif(not native.has_int8_dot(), reason="no AVX-512 VNNI or AVX2 on this CPU")


@pytest.mark.parametrize("kind", KINDS)
def test_products_match_the_reference(kind):
    check_products(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_gather_is_gguf_dequantization_exactly(kind):
    n, k = 40, 512
    raw = raw_weight(kind, n, k, 2)
    blocks, f = gguf_tiles.pack(decode(raw, kind, k))
    ids = np.array([0, 39, 17, 16, 17], dtype=np.int64)
    expected = gguf_dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32)[ids]
    np.testing.assert_array_equal(quant_gather(blocks, f, ids), expected)


def test_stored_bytes_are_the_packed_size():
    for kind in KINDS:
        blocks, _ = gguf_tiles.pack(decode(raw_weight(kind, 40, 512, 3), kind, 512))
        assert blocks.nbytes == gguf_tiles.stored_bytes(kind, 40, 512), kind


@needs_int8_dot
@pytest.mark.parametrize("flags", [AVX2_ONLY, PLAIN], ids=["avx2", "plain"])
def test_narrower_cpus_compute_the_same(monkeypatch, tmp_path, flags):
    library_without(monkeypatch, tmp_path, *flags)
    for kind in ("Q5_0", "Q4_K", "Q5_K", "Q6_K"):
        check_products(kind, rows=(1, 5))
