"""quantization/gguf_blocks: GGUF blocks decoded into their stored integers and scale fields. gguf-py (llama.cpp's
Python package) is the reference: its dequantize must come back bit for bit, and the decoded fields must re-encode
into the very bytes they came from. gguf-py quantizes only Q4_0..Q8_0; the K types are checked on random blocks
(every byte pattern is a valid block once d and dmin are finite float16) and on a real Q4_K_M file (the test cache's
Qwen2.5-Coder-0.5B)."""
from __future__ import annotations


import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine.core.errors import EngineError
from engine.quantization import gguf_blocks
from engine.quantization.gguf_blocks import KEPT, decode, dequantize, row_bytes, scales
from tests import real_model

SIMPLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")    # the kinds gguf-py quantizes
# Byte offsets of the float16 fields d (and dmin / m) in each block.
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _qtype(kind: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[kind]


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """n rows of random `kind` blocks, uint8 [n, row_bytes]: random bytes, the float16 fields made finite (zeros,
    signed zeros, subnormals and large values among them)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[_qtype(kind)]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in HALVES[kind]:
        halves = (rng.standard_normal(raw.shape[:2]) * 10.0 ** rng.integers(-6, 3, raw.shape[:2])).astype(np.float16)
        halves.flat[:4] = [0.0, -0.0, 6e-8, 1000.0]
        raw[..., at:at + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def quantized(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """gguf-py's quantization of a random float weight with rows of every magnitude and one row of zeros."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 10.0 ** rng.integers(-3, 2, (n, 1))).astype(np.float32)
    w[0] = 0
    w[1, :7] = 0.5   # a block with repeated values
    return gguf_quantize(w, _qtype(kind))


def encode(dec: gguf_blocks.Decoded) -> np.ndarray:
    """The blocks' bytes back from the decoded fields (the inverse of llama.cpp's layouts), uint8 [N, row_bytes]."""
    n, k = dec.shape
    nb = k // dec.block
    q = dec.q.reshape(n, nb, dec.block)
    half = lambda a: a.astype("<f2").view(np.uint8).reshape(n, nb, 2)          # noqa: E731
    nib = lambda v: (v[..., :v.shape[-1] // 2] & 15) | (v[..., v.shape[-1] // 2:] << 4)   # noqa: E731
    if dec.kind == "Q8_0":
        parts = [half(dec.d), q ^ np.uint8(128)]
    elif dec.block == 32:
        qh = np.packbits((q >> 4) & 1, axis=-1, bitorder="little") if dec.bits == 5 else None
        parts = [half(dec.d)] + ([half(dec.dmin)] if dec.dmin is not None else []) + \
                ([qh] if qh is not None else []) + [nib(q & 15)]
    elif dec.kind in ("Q4_K", "Q5_K"):
        sc, mn = dec.sc.reshape(n, nb, 8), dec.mn.reshape(n, nb, 8)
        packed = [sc[..., :4] | (sc[..., 4:] >> 4) << 6, mn[..., :4] | (mn[..., 4:] >> 4) << 6,
                  (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4]
        qs = nib((q & 15).reshape(n, nb, 4, 64)).reshape(n, nb, 128)
        qh = sum(((q.reshape(n, nb, 8, 32)[:, :, s] >> 4) & 1) << s for s in range(8)).astype(np.uint8)
        parts = [half(dec.d), half(dec.dmin), *packed] + ([qh] if dec.kind == "Q5_K" else []) + [qs]
    else:   # Q6_K
        halves = q.reshape(n, nb, 2, 128)
        ql = nib(halves & 15).reshape(n, nb, 128)
        qh = sum(((halves[..., 32 * s:32 * s + 32] >> 4) & 3) << (2 * s) for s in range(4)).astype(np.uint8)
        parts = [ql, qh.reshape(n, nb, 64), dec.sc.reshape(n, nb, 16).view(np.uint8), half(dec.d)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def check(raw: np.ndarray, kind: str, k: int) -> gguf_blocks.Decoded:
    """Everything the module promises about one tensor of `kind` blocks."""
    dec = decode(raw, kind, k)
    n = raw.size // row_bytes(kind, k)
    # exact: the same float32 bits as gguf-py / llama.cpp (signed zeros included)
    w = dequantize(dec)
    ref = gguf_dequantize(raw, _qtype(kind)).reshape(n, k)
    assert w.dtype == np.float32 and w.shape == (n, k)
    np.testing.assert_array_equal(w.view(np.uint32), ref.view(np.uint32))
    # the stored integers and fields themselves: they re-encode into the same bytes
    np.testing.assert_array_equal(encode(dec), raw.reshape(n, -1))
    # scales(): w = scale * q + minimum, up to float32 rounding of llama.cpp's own order
    scale, minimum = scales(dec)
    assert scale.dtype == minimum.dtype == np.float32 and scale.shape == minimum.shape == (n, k // dec.sub)
    s64, m64 = (np.repeat(a.astype(np.float64), dec.sub, axis=1) for a in (scale, minimum))
    exact = s64 * dec.q + m64
    slack = 2 * np.finfo(np.float32).eps * (np.abs(s64 * dec.q) + np.abs(m64)) + np.finfo(np.float32).tiny
    assert (np.abs(exact - w) <= slack).all()
    return dec


def check_fields(dec: gguf_blocks.Decoded, kind: str, n: int, k: int) -> None:
    bits, zero, block, sub = {"Q4_0": (4, 8, 32, 32), "Q4_1": (4, 0, 32, 32), "Q5_0": (5, 16, 32, 32),
                              "Q5_1": (5, 0, 32, 32), "Q8_0": (8, 128, 32, 32), "Q4_K": (4, 0, 256, 32),
                              "Q5_K": (5, 0, 256, 32), "Q6_K": (6, 32, 256, 16)}[kind]
    assert (dec.kind, dec.bits, dec.zero, dec.block, dec.sub) == (kind, bits, zero, block, sub)
    assert dec.shape == (n, k) and dec.q.dtype == np.uint8 and dec.q.shape == (n, k)
    assert int(dec.q.max()) < 1 << bits
    assert dec.d.dtype == np.float16 and dec.d.shape == (n, k // block)
    k_type = kind.endswith("_K")
    assert (dec.sc is not None) == k_type
    if k_type:
        assert dec.sc.shape == (n, k // sub) and dec.sc.dtype == (np.int8 if kind == "Q6_K" else np.uint8)
    assert (dec.dmin is not None) == (kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"))
    if dec.dmin is not None:
        assert dec.dmin.dtype == np.float16 and dec.dmin.shape == (n, k // block)
    assert (dec.mn is not None) == (kind in ("Q4_K", "Q5_K"))
    if dec.mn is not None:
        assert dec.mn.dtype == np.uint8 and dec.mn.shape == (n, k // sub) and int(dec.mn.max()) <= 63
    if kind in ("Q4_K", "Q5_K"):
        assert int(dec.sc.max()) <= 63


def test_layout_is_ggufs():
    for kind in KEPT:
        block, size = GGML_QUANT_SIZES[_qtype(kind)]
        assert gguf_blocks._LAYOUT[kind][2] == block and row_bytes(kind, 3 * block) == 3 * size


@pytest.mark.parametrize("kind", SIMPLE)
def test_ggufs_quantization(kind):
    raw = quantized(kind, 40, 512)
    dec = check(raw, kind, 512)
    check_fields(dec, kind, 40, 512)
    assert not dec.q[0].any() if kind in ("Q4_1", "Q5_1") else (dec.q[0] == dec.zero).all()


@pytest.mark.parametrize("kind", KEPT)
def test_random_blocks(kind, monkeypatch):
    k = 2 * GGML_QUANT_SIZES[_qtype(kind)][0]
    monkeypatch.setattr(gguf_blocks, "_SLAB", 3 * k)     # many slabs, the last one short
    raw = random_blocks(kind, 31, k)
    check_fields(check(raw, kind, k), kind, 31, k)


@pytest.mark.parametrize("kind", KEPT)
def test_flat_bytes_and_memory_map(kind, tmp_path):
    k = 512
    raw = random_blocks(kind, 7, k, seed=1)
    path = tmp_path / "blocks.bin"
    raw.tofile(path)
    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    flat, whole = decode(mapped, kind, k), decode(raw, kind, k)
    for name in ("q", "d", "sc", "dmin", "mn"):
        a, b = getattr(flat, name), getattr(whole, name)
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("kind", KEPT)
def test_scales_fold_the_zero_point(kind):
    dec = decode(random_blocks(kind, 5, 256, seed=2), kind, 256)
    scale, minimum = scales(dec)
    d = np.repeat(dec.d.astype(np.float32), dec.block // dec.sub, axis=1)
    if kind in ("Q4_0", "Q5_0", "Q8_0"):
        np.testing.assert_array_equal(scale, d)
        np.testing.assert_array_equal(minimum, -dec.zero * d)
    elif kind in ("Q4_1", "Q5_1"):
        np.testing.assert_array_equal(scale, d)
        np.testing.assert_array_equal(minimum, dec.dmin.astype(np.float32))
    elif kind == "Q6_K":
        np.testing.assert_array_equal(scale, d * dec.sc.astype(np.float32))
        np.testing.assert_array_equal(minimum, -32 * scale)
    else:
        dmin = np.repeat(dec.dmin.astype(np.float32), 8, axis=1)
        np.testing.assert_array_equal(scale, d * dec.sc.astype(np.float32))
        np.testing.assert_array_equal(minimum, -(dmin * dec.mn.astype(np.float32)))


@pytest.mark.parametrize("kind", ["F16", "Q2_K", "IQ4_NL", "q4_0"])
def test_refuses_other_kinds(kind):
    with pytest.raises(EngineError, match=kind):
        decode(np.zeros((1, 18), np.uint8), kind, 32)
    with pytest.raises(EngineError, match=kind):
        row_bytes(kind, 32)


def test_refuses_wrong_sizes():
    with pytest.raises(EngineError, match="Q4_K.*256.*100 values"):
        decode(np.zeros((1, 144), np.uint8), "Q4_K", 100)
    with pytest.raises(EngineError, match="Q6_K"):
        row_bytes("Q6_K", 0)
    with pytest.raises(EngineError, match="210 bytes.*rows of 209 bytes"):
        decode(np.zeros((3, 209), np.uint8), "Q6_K", 256)
    with pytest.raises(EngineError, match="34 bytes.*found 35 bytes"):
        decode(np.zeros(35, np.uint8), "Q8_0", 32)
    with pytest.raises(EngineError, match="uint8.*float32"):
        decode(np.zeros((1, 18), np.float32), "Q4_0", 32)


@pytest.mark.slow
def test_real_file():
    """Every kept type in a real llama.cpp file (Qwen2.5-Coder-0.5B Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0, the test cache's
    copy, tests/real_model.py), on its smallest tensor of it."""
    path = real_model.qwen_05b_gguf()
    smallest = {}
    for t in GGUFReader(path).tensors:
        kind = t.tensor_type.name
        if kind in KEPT and (kind not in smallest or t.n_bytes < smallest[kind].n_bytes):
            smallest[kind] = t
    assert set(smallest) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    for kind, t in smallest.items():
        k = int(t.shape[0])
        check_fields(check(t.data, kind, k), kind, t.data.shape[0], k)
