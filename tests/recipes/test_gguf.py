"""`engine convert --gguf`: GGUFSource against transformers' own GGUF loader.

- tiny GGUFs of every supported architecture (written like llama.cpp does, F32 / F16 / Q8_0): the tensors equal
  those transformers loads from the same file, and the original weights (llama's q/k permutation undone);
- the real SmolLM2-135M-Instruct Q4_1 GGUF: its checkpoint (config, generation defaults, every tensor, at tp 1 and
  tp 3) equals the checkpoint converted from the HF model transformers makes from the same file, and its tokenizer
  encodes like that model's;
- the two shortcuts that make opening a file fast equal what they replace: the config dict equals
  load_gguf_checkpoint's (tiny files, edge cases of its rules, the real file), the tokenizer files equal those
  AutoTokenizer makes from the same file; types transformers' fast tensor-table reader cannot size still load;
- corrupt, truncated and unsupported files are refused with exit status 1 and leave no output directory.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.builder.rank_tensors import rank_tensors
from engine.core.artifacts import load_checkpoint_config, rank_file
from engine.core.errors import EngineError
from engine.recipes.convert import ConvertConfig, convert
from engine.recipes.gguf_source import GGUFSource
from engine.recipes.gguf_tables import GGUF_ARCHITECTURES, gguf_config_dict
from engine.recipes.sources import HFDirSource
from tests.tiny_gguf import SPECS, write_tiny_gguf

ENGINE = Path(sys.executable).with_name("engine")  # the installed console script
SAMPLES = ["The capital of France is Paris.", "  leading spaces and\ttabs\nnew lines",
           "naïve café — über 東京 ✓ emoji 🙂", "def f(x):\n    return x ** 2  # 12345678"]


def run_engine(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENGINE), *args], capture_output=True, text=True, timeout=600)


def read_ranks(ckpt_dir: Path) -> list[dict[str, torch.Tensor]]:
    """Every rank's tensors as the builder reads them: a GGUF checkpoint's kept blocks dequantized."""
    cfg = load_checkpoint_config(ckpt_dir)
    tp = cfg.mapping.tp_size
    return [{n: torch.from_numpy(t) for n, t in rank_tensors(ckpt_dir, cfg, tp, r).items()} for r in range(tp)]


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ca, cb = load_checkpoint_config(a), load_checkpoint_config(b)
    assert (ca.model, ca.generation, ca.dtype, ca.mapping) == (cb.model, cb.generation, cb.dtype, cb.mapping)
    for ra, rb in zip(read_ranks(a), read_ranks(b), strict=True):
        assert ra.keys() == rb.keys()
        for name in ra:
            assert torch.equal(ra[name], rb[name]), name


# ---- tiny GGUFs ------------------------------------------------------------------------------------------------

# family -> the HF architecture transformers makes of its GGUF (llama named "mistral" is Mistral)
HF_ARCHITECTURES = {**GGUF_ARCHITECTURES, "mistral": "MistralForCausalLM"}
MODEL_TYPES = {arch: arch for arch in SPECS} | {"gemma3": "gemma3_text"}   # a GGUF's Gemma 3 is its text model


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("arch", sorted(SPECS))
def test_tiny_gguf_tensors_match_transformers(tmp_path, arch, qtype):
    from tests.recipes.test_gguf_families import gguf_reference
    path, ref = gguf_reference(tmp_path, arch, qtype)
    stored = write_tiny_gguf(tmp_path / "again.gguf", arch, qtype)   # the same tensors, as written
    ref_tensors = ref.state_dict()
    with GGUFSource(path) as source:
        assert set(source.names()) == set(stored)
        for name in source.names():
            got = source.get(name)
            assert got.dtype == torch.float32
            assert torch.equal(got, ref_tensors[name]), name
            # llama.cpp's q/k permutation and Gemma's 1 + w undone exactly
            assert torch.equal(got, stored[name]), name
        hf = source.hf_config()
        assert hf["architectures"] == [HF_ARCHITECTURES[arch]] and hf["torch_dtype"] == "float32"
        # what transformers makes of the same metadata, but for how it was loaded (quantizer, path, dtype)
        expected = {k: v for k, v in ref.config.to_dict().items()
                    if k not in ("quantization_config", "_name_or_path", "architectures", "dtype", "torch_dtype",
                                 "_attn_implementation_autoset")}
        assert {k: hf.get(k) for k in expected} == expected
        ckpt = convert(source, ConvertConfig(output_dir=tmp_path / "ckpt", tp=2))
    assert ckpt.model.num_kv_heads == 2 and ckpt.mapping.tp_size == 2
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in (tmp_path / "ckpt").iterdir()}


def test_llama_q_k_rows_are_permuted_in_the_file(tmp_path):
    """The un-permutation above is not vacuous: the file's q/k rows really are in llama.cpp's order."""
    from gguf import GGUFReader
    path = tmp_path / "m.gguf"
    stored = write_tiny_gguf(path, "llama", "F32")
    raw = {t.name: torch.from_numpy(t.data.copy()) for t in GGUFReader(str(path)).tensors}
    assert not torch.equal(raw["blk.0.attn_q.weight"], stored["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(raw["blk.0.attn_k.weight"], stored["model.layers.0.self_attn.k_proj.weight"])
    assert torch.equal(raw["blk.0.attn_v.weight"], stored["model.layers.0.self_attn.v_proj.weight"])


def test_tokenizer_dir_is_removed_on_close(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama")
    with GGUFSource(path) as source:
        tok_dir = source.tokenizer_dir()
        config = json.loads((tok_dir / "tokenizer_config.json").read_text())
        assert config["chat_template"] == (tok_dir / "chat_template.jinja").read_text()
    assert not tok_dir.exists()


@pytest.mark.parametrize("qtype", ["Q5_1", "BF16"])
def test_types_only_gguf_can_size_match_transformers(tmp_path, qtype):
    """transformers' fast tensor-table reader refuses these types; its legacy loader (the reference) reads them."""
    from transformers import AutoModelForCausalLM
    path = tmp_path / "m.gguf"
    stored = write_tiny_gguf(path, "llama", qtype)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).state_dict()
    with GGUFSource(path) as source:
        assert set(source.names()) == set(stored)
        for name in source.names():
            got = source.get(name)
            assert torch.equal(got, ref[name]) and torch.equal(got, stored[name]), name


def _legacy_config(path: Path) -> dict:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    return load_gguf_checkpoint(str(path), return_tensors=False)["config"]


def _config_dict(path: Path) -> dict:
    from transformers.integrations.gguf import read_gguf_metadata
    return gguf_config_dict(*read_gguf_metadata(str(path)))


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_config_dict_equals_load_gguf_checkpoint(tmp_path, arch):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, arch, "Q8_0")
    expected = _legacy_config(path)
    assert _config_dict(path) == expected
    assert expected["model_type"] == MODEL_TYPES[arch] and expected["num_hidden_layers"] == 2  # not two empty dicts


@pytest.mark.parametrize("name, untied", [("mistral", False), ("Mistral 7B", True)])
def test_config_dict_follows_load_gguf_checkpoint_rules(tmp_path, name, untied):
    """llama named exactly "mistral" is mistral; a one-element array is its element, a longer one a list; the
    vocabulary size comes from the token list when no key states it; tied unless there is an output.weight."""
    import gguf
    import numpy as np
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_array("llama.attention.head_count_kv", [1])
    w.add_array("llama.feed_forward_length", [16, 32])
    w.add_rope_freq_base(1e6)
    w.add_token_list([f"t{i}" for i in range(11)])
    w.add_tensor("token_embd.weight", np.zeros((11, 8), dtype=np.float32))
    if untied:
        w.add_tensor("output.weight", np.zeros((11, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    expected = _legacy_config(path)
    assert _config_dict(path) == expected
    assert expected["model_type"] == ("mistral" if name == "mistral" else "llama")
    assert (expected["num_key_value_heads"], expected["intermediate_size"], expected["vocab_size"]) == (1, [16, 32], 11)
    assert expected["tie_word_embeddings"] is not untied


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_tokenizer_files_equal_auto_tokenizer(tmp_path, arch):
    from transformers import AutoTokenizer
    path = tmp_path / "g" / "m.gguf"
    write_tiny_gguf(path, arch)
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    ref.save_pretrained(str(tmp_path / "ref"))
    expected = json.loads((tmp_path / "ref" / "tokenizer_config.json").read_text())
    expected.pop("local_files_only")
    expected["chat_template"] = ref.chat_template
    with GGUFSource(path) as source:
        ours = source.tokenizer_dir()
        assert json.loads((ours / "tokenizer_config.json").read_text()) == expected
        for name in ("tokenizer.json", "chat_template.jinja"):
            assert (ours / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), name


# ---- refusals ---------------------------------------------------------------------------------------------------

def _unsupported_gguf(path: Path) -> Path:
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _broken(tmp_path: Path, how: str) -> Path:
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good, "qwen2", "Q8_0")
    data = good.read_bytes()
    bad = tmp_path / f"{how}.gguf"
    if how == "half":
        bad.write_bytes(data[: len(data) // 2])
    elif how == "header-only":
        bad.write_bytes(data[:200])
    elif how == "magic":
        bad.write_bytes(b"XXXX" + data[4:])
    elif how == "empty":
        bad.write_bytes(b"")
    elif how == "mamba":
        _unsupported_gguf(bad)
    return bad


@pytest.mark.parametrize("how", ["half", "header-only", "magic", "empty", "mamba"])
def test_bad_gguf_is_an_engine_error(tmp_path, how):
    bad = _broken(tmp_path, how)
    with pytest.raises(EngineError) as e:
        GGUFSource(bad)
    assert str(bad) in str(e.value)
    if how == "mamba":
        assert "'mamba'" in str(e.value) and "llama" in str(e.value)


def test_rope_scaling_is_refused(tmp_path):
    """transformers ignores a GGUF's rope scaling keys; a model converted without them would be silently wrong."""
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "llama", rope_scaling=("linear", 2.0))
    with pytest.raises(EngineError, match="rope scaling 'linear'.*--model-dir"):
        GGUFSource(path)


@pytest.mark.parametrize("how", ["half", "magic", "mamba"])
def test_cli_refuses_bad_gguf(tmp_path, how):
    bad = _broken(tmp_path, how)
    out = tmp_path / "out"
    r = run_engine("convert", "--gguf", str(bad), "--output-dir", str(out))
    assert r.returncode == 1, r.stderr
    assert "error:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))) == []


def test_cli_missing_gguf_is_a_usage_error(tmp_path):
    r = run_engine("convert", "--gguf", str(tmp_path / "nope.gguf"), "--output-dir", str(tmp_path / "out"))
    assert r.returncode == 2 and "nope.gguf" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


# ---- the real model: SmolLM2-135M-Instruct, Q4_1 -----------------------------------------------------------------

@pytest.fixture(scope="module")
def real_ckpts(tmp_path_factory, smollm2_gguf, smollm2_checkpoint):
    """tp=1 checkpoints from the GGUF (Python API) and from the HF dir transformers made from it."""
    root = tmp_path_factory.mktemp("smollm2")
    with GGUFSource(smollm2_gguf) as source:
        convert(source, ConvertConfig(output_dir=root / "gguf"))
    return root / "gguf", smollm2_checkpoint


@pytest.mark.slow
def test_real_gguf_checkpoint_equals_hf_checkpoint(real_ckpts, smollm2_gguf):
    gguf_ckpt, hf_ckpt = real_ckpts
    assert_same_checkpoint(gguf_ckpt, hf_ckpt)
    cfg = load_checkpoint_config(gguf_ckpt)
    m = cfg.model
    assert (m.architecture, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 49152)
    assert m.tie_word_embeddings and m.rope.theta == 100000.0 and cfg.dtype == "float32"
    assert (cfg.generation.bos_token_id, cfg.generation.eos_token_ids, cfg.generation.pad_token_id) == (1, (2,), 2)
    # SmolLM2's Q4_1 layers and its Q8_0 embedding stay the file's blocks
    assert cfg.source == {"kind": "gguf", "name": smollm2_gguf.name, "kept": {"Q4_1": 120, "Q8_0": 1}}
    assert cfg.manifest.source_digest == "sha256:" + hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()


@pytest.mark.slow
def test_real_gguf_tokenizer_matches_hf(real_ckpts, smollm2_gguf):
    from gguf import GGUFReader
    from transformers import AutoTokenizer
    gguf_ckpt, hf_ckpt = real_ckpts
    template = GGUFReader(str(smollm2_gguf)).fields["tokenizer.chat_template"].contents()
    assert json.loads((gguf_ckpt / "tokenizer_config.json").read_text())["chat_template"] == template
    assert (gguf_ckpt / "chat_template.jinja").read_text() == template
    assert json.loads((gguf_ckpt / "tokenizer.json").read_text()) == json.loads((hf_ckpt / "tokenizer.json").read_text())
    ours, ref = AutoTokenizer.from_pretrained(str(gguf_ckpt)), AutoTokenizer.from_pretrained(str(hf_ckpt))
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    for text in SAMPLES + [rendered]:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    assert ours.encode(rendered)[0] == ours.convert_tokens_to_ids("<|im_start|>") == 1


@pytest.mark.slow
def test_real_gguf_config_dict_equals_load_gguf_checkpoint(smollm2_gguf):
    assert _config_dict(smollm2_gguf) == _legacy_config(smollm2_gguf)


@pytest.mark.slow
def test_real_gguf_cli_tp3(tmp_path, smollm2_gguf, smollm2_hf_dir):
    """9 heads and 3 KV heads over 3 ranks, through the CLI, equal to the HF dir's tp=3 checkpoint."""
    out = tmp_path / "gguf-tp3"
    r = run_engine("convert", "--gguf", str(smollm2_gguf), "--output-dir", str(out), "--tp", "3")
    assert r.returncode == 0, r.stderr
    assert "LlamaForCausalLM" in r.stdout
    cfg = load_checkpoint_config(out)
    assert cfg.mapping.tp_size == 3 and [rank_file(i) in {p.name for p in out.iterdir()} for i in range(3)] == [True] * 3
    ref = tmp_path / "hf-tp3"
    convert(HFDirSource(smollm2_hf_dir), ConvertConfig(output_dir=ref, tp=3))
    assert_same_checkpoint(out, ref)
    assert read_ranks(out)[0]["layers.0.attention.qkv.weight"].shape == ((3 + 1 + 1) * 64, 576)
