"""`engine convert --gguf` for every family of tests/tiny_gguf.SPECS (llama, qwen2, qwen3, mistral, gemma2, gemma3,
phi3), from tiny Q8_0 files written as llama.cpp writes them:

- converted at tp 1 the file's Q8_0 blocks stay blocks (GGUFTensor), and the checkpoint read as the builder reads it
  (blocks dequantized) equals the checkpoint converted from the model transformers' GGUF loader makes from the
  file: every tensor (Gemma's norms - 1, llama's q/k un-permutation, Phi-3's fused rows split) and the model config;
- its engine's logits (prefill past Gemma's sliding window, then greedy decoding) match that transformers model;
- hyperparameters transformers' GGUF config cannot read are refused rather than guessed.

Mistral is llama written under the name "mistral": transformers makes a MistralConfig of it but its tensor loader
stops (gguf-py has no "mistral" architecture), so its reference is the MistralForCausalLM of that config holding
the tensors transformers loads from the same file named otherwise (a llama).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.builder.build import build_engine
from engine.core.artifacts import load_checkpoint_config
from engine.core.errors import EngineError
from engine.recipes.convert import ConvertConfig, convert
from engine.recipes.gguf_source import GGUFSource
from engine.recipes.sources import HFDirSource
from engine.runtime.session import EngineSession
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD, engine_greedy, hf_greedy, hf_last_logits
from tests.recipes.test_gguf import read_ranks
from tests.tiny_gguf import SPECS, write_tiny_gguf
from tests.tolerances import assert_logits_close

EAGER = dict(dtype=torch.float32, attn_implementation="eager")


def gguf_reference(root: Path, arch: str, qtype: str) -> tuple[Path, torch.nn.Module]:
    """A tiny GGUF of `arch` and the float32 model transformers' GGUF loader makes from it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = root / "m.gguf"
    write_tiny_gguf(path, arch, qtype)
    if arch != "mistral":
        return path, AutoModelForCausalLM.from_pretrained(str(root), gguf_file=path.name, **EAGER).eval()
    with pytest.raises(NotImplementedError, match="mistral"):
        AutoModelForCausalLM.from_pretrained(str(root), gguf_file=path.name, **EAGER)
    twin = root / "twin" / "m.gguf"
    write_tiny_gguf(twin, arch, qtype, name="tiny mistral")
    llama = AutoModelForCausalLM.from_pretrained(str(twin.parent), gguf_file=twin.name, **EAGER)
    config = AutoConfig.from_pretrained(str(root), gguf_file=path.name)
    assert config.model_type == "mistral"
    model = AutoModelForCausalLM.from_config(config, **EAGER)
    model.load_state_dict(llama.state_dict())
    return path, model.eval()


@pytest.fixture(scope="module", params=sorted(SPECS))
def family(request, tmp_path_factory):
    """(arch, the transformers model, the Q8_0 file's tp-1 checkpoint, the checkpoint of transformers' model)."""
    arch, root = request.param, tmp_path_factory.mktemp(f"gguf_{request.param}")
    path, model = gguf_reference(root, arch, "Q8_0")
    with GGUFSource(path) as source:
        convert(source, ConvertConfig(output_dir=root / "ckpt"))
    if hasattr(model.config, "quantization_config"):   # dequantized weights: saved as a plain float32 model
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(root / "hf")
    convert(HFDirSource(root / "hf"), ConvertConfig(output_dir=root / "hf_ckpt"))
    return arch, model, root / "ckpt", root / "hf_ckpt"


def test_kept_blocks_equal_transformers_gguf_load(family):
    arch, model, ckpt, hf_ckpt = family
    cfg, ref = load_checkpoint_config(ckpt), load_checkpoint_config(hf_ckpt)
    assert cfg.source["kept"]["Q8_0"] > 0   # blocks really kept, so the reading below dequantizes them
    assert cfg.model == ref.model and cfg.model.architecture == type(model).__name__
    (ours,), (theirs,) = read_ranks(ckpt), read_ranks(hf_ckpt)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), f"{arch}: {name}"


def test_engine_logits_match_transformers_gguf_load(family, tmp_path):
    arch, model, ckpt, _ = family
    engine = tmp_path / "engine"
    build_engine(ckpt, engine, TEST_BUILD, ALL_PLUGINS)
    session = EngineSession(engine, num_blocks=64)
    vocab = load_checkpoint_config(ckpt).model.vocab_size
    rng = np.random.default_rng(3)
    batch = [rng.integers(3, vocab, n).tolist() for n in (5, 13, 30)]   # shorter and longer than the window of 8
    from engine.runtime.step_inputs import SeqChunk
    tables = [list(range(0, 2)), list(range(2, 6)), list(range(6, 14))]
    for row, ids in zip(session.run([SeqChunk(ids, 0, t, True) for ids, t in zip(batch, tables)]), batch):
        assert_logits_close(row, hf_last_logits(model, ids), what=f"{arch} prefill of {len(ids)} tokens")
    tokens, logits = engine_greedy(session, batch[1], 8, list(range(20, 26)))
    ref_tokens, ref_logits = hf_greedy(model, batch[1], 8)
    assert_logits_close(logits, ref_logits, what=f"{arch} greedy decode logits")
    assert tokens == ref_tokens


# ---- what transformers' GGUF config cannot read ------------------------------------------------------------------

def _minimal_gguf(path: Path, arch: str, keys: dict, tensors: tuple[str, ...] = ()) -> Path:
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": 2, "embedding_length": 64, "attention.head_count": 4, **keys}.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    w.add_token_list([f"t{i}" for i in range(11)])
    w.add_tensor("token_embd.weight", np.zeros((11, 64), dtype=np.float32))
    for name in tensors:
        w.add_tensor(name, np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch, keys, tensors, needle", [
    # Gemma 27B: llama.cpp scales q by (hidden / heads) ** -0.5, transformers by its default 256 ** -0.5
    ("gemma2", {"attention.key_length": 128}, (), "gemma2.attention.key_length = 128.*query_pre_attn_scalar = 256"),
    ("gemma3", {"attention.key_length": 128}, (), "gemma3.attention.key_length = 128.*query_pre_attn_scalar = 256"),
    ("gemma2", {"attention.key_length": 256, "final_logit_softcapping": 20.0}, (),
     "final_logit_softcapping = 20.0.*final_logit_softcapping = 30.0"),
    ("phi3", {"rope.dimension_count": 12}, (), "phi3.rope.dimension_count = 12.*head_dim = 16"),   # Phi-4-mini
    ("phi3", {"rope.dimension_count": 16}, ("rope_factors_long.weight", "rope_factors_short.weight"),
     "rope factors \\(rope_factors_long.weight\\)"),   # Phi-3 128k's longrope
])
def test_unreadable_hyperparameters_are_refused(tmp_path, arch, keys, tensors, needle):
    path = _minimal_gguf(tmp_path / "m.gguf", arch, keys, tensors)
    with pytest.raises(EngineError, match=needle + ".*--model-dir"):
        GGUFSource(path)
