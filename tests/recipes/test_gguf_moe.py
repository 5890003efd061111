"""`engine convert --gguf` of mixture-of-experts files (qwen2moe, qwen3moe, Mixtral as llama) from tiny files written
as llama.cpp writes them (tests/tiny_gguf_moe.py: experts merged into 3-D `ffn_*_exps`, quantized):

- the checkpoint (2-D blocks kept, or --dtype float32) read as the builder reads it equals the checkpoint of the HF
  model holding the stored weights, tensor for tensor, and the model config too; the experts' quantized kinds are
  recorded as dequantized;
- its engines (the MoE kernel and the reference lowering) decode greedily as transformers does on those weights;
  an int4_wo build re-quantizes the experts within the dense tolerance; --dtype gguf is refused with what to use.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.builder.build import build_engine
from engine.core.artifacts import load_checkpoint_config
from engine.core.errors import EngineError
from engine.core.model_config import QuantConfig
from engine.quantization.gguf_tensor import dequantized_note
from engine.recipes.convert import ConvertConfig, convert
from engine.recipes.gguf_source import GGUFSource
from engine.recipes.sources import HFDirSource
from engine.runtime.session import EngineSession
from tests.builder.engines import ALL_PLUGINS, NO_PLUGINS, TEST_BUILD, engine_greedy, hf_greedy
from tests.quantization.engines import LOGITS_RELATIVE_RMS, NO_REPORT, relative_rms
from tests.recipes.test_gguf import read_ranks
from tests.tiny_gguf_moe import write_tiny_moe_gguf
from tests.tolerances import assert_logits_close

PROMPT = [5, 17, 42, 99, 7, 250, 13, 64, 301, 8, 77]


@pytest.fixture(scope="module", params=["qwen2moe", "qwen3moe", "mixtral"])
def moe(request, tmp_path_factory):
    """(name, the HF model of the stored weights, {"kept": GGUF checkpoint, "float32": its --dtype float32
    checkpoint, "hf": the HF model's checkpoint})."""
    name, root = request.param, tmp_path_factory.mktemp(f"gguf_{request.param}")
    model = write_tiny_moe_gguf(root / "m.gguf", name, "mix")
    ckpts = {"kept": root / "ckpt", "float32": root / "ckpt_f32", "hf": root / "hf_ckpt"}
    for key, dtype in (("kept", "auto"), ("float32", "float32")):
        with GGUFSource(root / "m.gguf") as source:
            convert(source, ConvertConfig(output_dir=ckpts[key], dtype=dtype))
    model.save_pretrained(root / "hf")
    convert(HFDirSource(root / "hf"), ConvertConfig(output_dir=ckpts["hf"]))
    return name, model, ckpts


@pytest.mark.parametrize("ckpt", ["kept", "float32"])
def test_checkpoint_equals_the_hf_models(moe, ckpt):
    name, model, ckpts = moe
    cfg, ref = load_checkpoint_config(ckpts[ckpt]), load_checkpoint_config(ckpts["hf"])
    assert cfg.model == ref.model and cfg.model.architecture == type(model).__name__
    assert cfg.model.moe is not None
    if ckpt == "kept":   # attention's Q8_0 kept as blocks; the 3-D experts dequantized, and said so
        assert cfg.source["kept"]["Q8_0"] > 0
        layers = range(model.config.num_hidden_layers)
        assert {k for k in cfg.source["dequantized"] if "_exps" in k} == {
            f"blk.{i}.ffn_{p}_exps.weight" for i in layers for p in ("gate", "up", "down")}
        assert "expert tensors of the GGUF file (Q4_1, Q5_1, 3-D) are dequantized" in dequantized_note(cfg.source)
    (ours,), (theirs,) = read_ranks(ckpts[ckpt]), read_ranks(ckpts["hf"])
    assert ours.keys() == theirs.keys()
    for tensor in ours:
        assert torch.equal(ours[tensor], theirs[tensor]), f"{name}: {tensor}"


@pytest.mark.parametrize("plugins", [True, False], ids=["kernel", "reference"])
def test_greedy_decode_matches_transformers(moe, plugins, tmp_path):
    name, model, ckpts = moe
    build_engine(ckpts["kept"], tmp_path / "engine", TEST_BUILD, ALL_PLUGINS if plugins else NO_PLUGINS)
    session = EngineSession(tmp_path / "engine", num_blocks=32)
    tokens, logits = engine_greedy(session, PROMPT, 8, list(range(8)))
    ref_tokens, ref_logits = hf_greedy(model, PROMPT, 8)
    assert_logits_close(logits, ref_logits, what=f"{name} GGUF greedy decode logits")
    assert tokens == ref_tokens


def test_int4_experts_requantized_within_tolerance(moe, tmp_path):
    name, _, ckpts = moe
    logits = {}
    for mode in (None, "int4_wo"):
        out = tmp_path / str(mode)
        build_engine(ckpts["kept"], out, TEST_BUILD, ALL_PLUGINS, accuracy=NO_REPORT, quant=QuantConfig(mode=mode))
        logits[mode] = engine_greedy(EngineSession(out, num_blocks=32), PROMPT, 1, list(range(8)))[1]
    assert relative_rms(logits["int4_wo"], logits[None]) <= LOGITS_RELATIVE_RMS["int4_wo"], name


def test_gguf_blocks_refused_for_experts(moe, tmp_path):
    _, _, ckpts = moe
    with pytest.raises(EngineError, match="--dtype gguf.*dequantized at convert.*int4_wo"):
        build_engine(ckpts["kept"], tmp_path / "e", TEST_BUILD, ALL_PLUGINS, quant=QuantConfig(mode="gguf"))


def test_one_tensor_per_expert_is_refused_with_what_to_do(tmp_path):
    """Older llama.cpp Mixtral files store blk.N.ffn_gate.E.weight per expert, which the engine does not read."""
    from tests.recipes.test_gguf_families import _minimal_gguf
    path = _minimal_gguf(tmp_path / "m.gguf", "llama", {"expert_count": 4, "expert_used_count": 2},
                         ("blk.0.ffn_gate.0.weight",))
    with pytest.raises(EngineError, match="one tensor per expert \\(blk.0.ffn_gate.0.weight\\).*--model-dir"):
        GGUFSource(path)
