"""--dtype gguf on tiny GGUF files that mix block kinds as a Q4_K_M file does (tests/tiny_gguf.MIX): the checkpoint
keeps each weight's blocks as the file stores them (no float copy), the engine runs every kept weight on its own
kind's tiles, and its logits stay within int8 activation rounding of the float32 engine of the same weights, which
reads the same checkpoint dequantized exactly as gguf dequantizes it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from engine.builder.build import build_engine
from engine.builder.rank_tensors import rank_tensors
from engine.core.artifacts import load_checkpoint_config
from engine.core.errors import EngineError
from engine.core.model_config import QuantConfig
from engine.plugins import gguf_tiles, native
from engine.recipes.convert import ConvertConfig, convert
from engine.recipes.gguf_source import GGUFSource
from engine.runtime.perplexity import ScoringSession
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD
from tests.tiny_gguf import MIX, SPECS, write_tiny_gguf

from .engines import NO_REPORT, relative_rms

pytestmark = pytest.mark.skipif(not native.has_int8_dot(), reason="--dtype gguf runs on AVX-512 VNNI or AVX2 kernels")
# int8 activations per block of 32 against float32 ones on the tiny random models: measured 1.3-2.0%
LOGITS_RELATIVE_RMS = 0.03


# families whose GGUF holds q, k and v apart (Phi-3's fused attn_qkv is one kind: test_gguf_families covers it)
FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module", params=FAMILIES)
def gguf_checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    arch, root = request.param, tmp_path_factory.mktemp(f"gguf_{request.param}")
    write_tiny_gguf(root / "tiny.gguf", arch, "mix")
    with GGUFSource(root / "tiny.gguf") as source:
        convert(source, ConvertConfig(root / "ckpt"))
    return arch, root / "ckpt"


def build(ckpt: Path, out: Path, mode: str | None, **quant) -> Path:
    build_engine(ckpt, out, TEST_BUILD, ALL_PLUGINS, quant=QuantConfig(mode=mode, **quant), accuracy=NO_REPORT)
    return out


def test_checkpoint_keeps_the_files_blocks(gguf_checkpoint):
    arch, ckpt = gguf_checkpoint
    kinds = rank_tensors(ckpt, load_checkpoint_config(ckpt), 1, 0).gguf_kinds()
    # q and k share a kind and v has another: stored apart; gate and up share one: stacked
    assert kinds["layers.0.attention.q.weight"] == kinds["layers.0.attention.k.weight"] == MIX["q_proj"]
    assert kinds["layers.0.attention.v.weight"] == MIX["v_proj"]
    assert kinds["layers.1.mlp.gate_up.weight"] == MIX["gate_proj"]
    assert kinds["layers.1.mlp.down.weight"] == MIX["down_proj"]
    assert kinds["vocab_embedding.weight"] == MIX["embed_tokens"]
    assert ("lm_head.weight" in kinds) == (not SPECS[arch]["tied"])


def test_engine_runs_each_kind_on_its_tiles_within_rounding_of_float32(gguf_checkpoint, tmp_path):
    arch, ckpt = gguf_checkpoint
    engine, reference = build(ckpt, tmp_path / "gguf", "gguf"), build(ckpt, tmp_path / "float", None)
    model = onnx.load(str(engine / "rank0.onnx"))
    formats = {dataclasses.astuple(gguf_tiles.FORMATS[k]) for k in MIX.values()}
    assert formats <= weight_formats(model), (formats, weight_formats(model))
    assert not any(n.op_type in ("MatMul", "Gemm") for n in model.graph.node)
    vocab = load_checkpoint_config(ckpt).model.vocab_size
    for ids in np.random.default_rng(4).integers(0, vocab, (2, 23)).tolist():
        actual = ScoringSession(engine, len(ids)).logits(ids)
        expected = ScoringSession(reference, len(ids)).logits(ids)
        assert relative_rms(actual, expected) <= LOGITS_RELATIVE_RMS


def test_float_activations_over_the_tiles_are_the_float32_engine(gguf_checkpoint, tmp_path):
    """The accuracy report's reference for gguf builds (builder/reference.reference_quant): the kept tiles with
    float32 activations compute what the float32 engine of the same checkpoint computes, up to the order of sums."""
    _, ckpt = gguf_checkpoint
    engine = build(ckpt, tmp_path / "ref", "gguf", float_activations=True)
    reference = build(ckpt, tmp_path / "float", None)
    vocab = load_checkpoint_config(ckpt).model.vocab_size
    for ids in np.random.default_rng(5).integers(0, vocab, (2, 23)).tolist():
        actual = ScoringSession(engine, len(ids)).logits(ids)
        expected = ScoringSession(reference, len(ids)).logits(ids)
        assert relative_rms(actual, expected) <= 1e-5


def weight_formats(model: onnx.ModelProto) -> set[tuple[int, int, int, int]]:
    """(bits, group_size, offsets, scales) of every weight the engine's Quant* nodes read, fused ones included."""
    found = set()
    for node in model.graph.node:
        attributes = {a.name: a.i for a in node.attribute}
        for prefix in ("", "down_"):
            if node.op_type.startswith("Quant") and prefix + "bits" in attributes:
                found.add(tuple(attributes.get(prefix + a, 0) for a in ("bits", "group_size", "offsets", "scales")))
    return found


def test_kept_embedding_rows_are_the_files_values(gguf_checkpoint, tmp_path):
    """The QuantGather table holds the GGUF embedding exactly: its rows dequantize to the float checkpoint's."""
    _, ckpt = gguf_checkpoint
    engine = build(ckpt, tmp_path / "gguf", "gguf")
    table = next(t for t in onnx.load(str(engine / "rank0.onnx")).graph.initializer
                 if t.name == "vocab_embedding.weight")
    blocks = numpy_helper.to_array(table)
    stored = rank_tensors(ckpt, load_checkpoint_config(ckpt), 1, 0)["vocab_embedding.weight"]
    from tests.plugins.test_gguf_tiles import quant_gather
    ids = np.arange(stored.shape[0], dtype=np.int64)
    rows = quant_gather(blocks, gguf_tiles.FORMATS[MIX["embed_tokens"]], ids)
    np.testing.assert_array_equal(rows, stored)


def test_gguf_needs_a_checkpoint_that_keeps_blocks(tiny, tmp_path):
    with pytest.raises(EngineError, match="--dtype gguf keeps the quantized blocks of a checkpoint converted from a "
                                          "GGUF file"):
        build(tiny.checkpoint("LlamaForCausalLM"), tmp_path / "e", "gguf")


def test_kinds_not_kept_are_float32_and_the_build_says_which(tmp_path):
    """A kind the engine keeps no blocks of (IQ4_NL here) is dequantized at convert, bit for bit gguf's values, and
    convert and the gguf build name the tensors."""
    stored = write_tiny_gguf(tmp_path / "tiny.gguf", "qwen2", "mix", kinds={"o_proj": "IQ4_NL"})
    with GGUFSource(tmp_path / "tiny.gguf") as source:
        ckpt = convert(source, ConvertConfig(tmp_path / "ckpt"))
    assert ckpt.source["dequantized"] == {f"blk.{i}.attn_output.weight": "IQ4_NL" for i in range(2)}
    tensors = rank_tensors(tmp_path / "ckpt", ckpt, 1, 0)
    assert "layers.0.attention.dense.weight" not in tensors.gguf_kinds()
    np.testing.assert_array_equal(tensors["layers.0.attention.dense.weight"],
                                  stored["model.layers.0.self_attn.o_proj.weight"].numpy())
    engine = build(tmp_path / "ckpt", tmp_path / "gguf", "gguf")
    from engine.runtime.engine_dir import load_engine_config
    note = load_engine_config(engine).precision["note"]
    assert "2 tensors of the GGUF file are IQ4_NL" in note and "blk.0.attn_output.weight" in note
