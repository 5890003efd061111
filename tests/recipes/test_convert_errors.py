"""`convert` on bad input: every case is an EngineError that names the bad value, and leaves no output behind.

"No output" means neither the output directory nor the hidden temporary sibling it is built in
(`.{name}.tmp-*`, see core/artifacts.atomic_output_dir). The good variants of the same inputs (sharded
safetensors with an index, pytorch_model.bin) must convert to exactly the tensors of the plain model.safetensors.
The CLI's rendering of these errors (one line, exit status) is tested in tests/cli/test_cli.py.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.artifacts import load_checkpoint_config, rank_file
from engine.core.errors import EngineError
from engine.recipes import RECIPES
from engine.recipes.convert import ConvertConfig, convert
from engine.recipes.sources import HFDirSource
from tests.tiny_models import make_tiny_model

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory) -> dict[str, torch.Tensor]:
    """rank0 of the tiny model converted from its plain model.safetensors."""
    out = tmp_path_factory.mktemp("ref") / "ckpt"
    convert(HFDirSource(tiny), ConvertConfig(output_dir=out))
    return load_file(out / rank_file(0))


@pytest.fixture
def model(tiny, tmp_path) -> Path:
    """A private copy of the tiny model that a test may break."""
    return Path(shutil.copytree(tiny, tmp_path / "model"))


def run(model_dir: Path, out: Path, **flags):
    return convert(HFDirSource(model_dir), ConvertConfig(output_dir=out, **flags))


def fails(model_dir: Path, out: Path, *needles: str, usage: bool = False, **flags) -> str:
    """Convert, expect an EngineError whose message holds every needle, and no output; return the message."""
    with pytest.raises(EngineError) as info:
        run(model_dir, out, **flags)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert "\n" not in message, message
    assert info.value.usage == usage, message
    assert_no_output(out)
    return message


def assert_no_output(out: Path) -> None:
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers == [], leftovers


def edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def edit_tensors(model_dir: Path, edit) -> None:
    path = model_dir / WEIGHTS
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# ---- config.json --------------------------------------------------------------------------------------------

def test_missing_config_json(model, tmp_path):
    (model / "config.json").unlink()
    with pytest.raises(EngineError, match="has no config.json"):
        HFDirSource(model)


@pytest.mark.parametrize("breakage, needle", [
    ("directory", "is a directory"),          # unreadable: tests run as root, so permissions cannot stop a read
    ("invalid json", "is not valid JSON"),
    ("not an object", "holds a JSON list"),
    ("not utf-8", "is not UTF-8"),
])
def test_unreadable_config_json(model, tmp_path, breakage, needle):
    path = model / "config.json"
    path.unlink()
    if breakage == "directory":
        path.mkdir()
    elif breakage == "invalid json":
        path.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 6')  # truncated
    elif breakage == "not an object":
        path.write_text('["LlamaForCausalLM"]')
    else:
        path.write_bytes(b'{"architectures": ["Llama\xff\xfe"]}')
    with pytest.raises(EngineError) as info:
        HFDirSource(model)
    assert needle in str(info.value) and str(path) in str(info.value)


def test_config_without_architectures(model, tmp_path):
    edit_config(model, architectures=None)
    fails(model, tmp_path / "out", "architectures", "LlamaForCausalLM")


def test_unknown_architecture_names_the_supported_ones(model, tmp_path):
    edit_config(model, architectures=["MambaForCausalLM"])
    message = fails(model, tmp_path / "out", "'MambaForCausalLM' is not supported")
    for arch in RECIPES:
        assert arch in message


def test_missing_required_config_key(model, tmp_path):
    edit_config(model, num_attention_heads=None)
    fails(model, tmp_path / "out", "num_attention_heads")


@pytest.mark.parametrize("key, value, expected", [
    ("hidden_size", "64", "a positive integer"),
    ("num_attention_heads", 4.5, "a positive integer"),
    ("num_key_value_heads", 0, "a positive integer"),
    ("num_hidden_layers", -1, "a positive integer"),
    ("rms_norm_eps", "tiny", "a non-negative number"),
    ("tie_word_embeddings", "no", "true or false"),  # bool("no") would silently tie the embeddings
])
def test_config_value_of_the_wrong_type(model, tmp_path, key, value, expected):
    edit_config(model, **{key: value})
    fails(model, tmp_path / "out", f"{key}={value!r}", expected)


# ---- weight files -------------------------------------------------------------------------------------------

def test_missing_weights(model, tmp_path):
    (model / WEIGHTS).unlink()
    with pytest.raises(EngineError, match=r"no weights in .*model\.safetensors.*pytorch_model\*\.bin"):
        HFDirSource(model)


def _shard(model_dir: Path) -> list[str]:
    """Split model.safetensors into two shards with an index, as save_pretrained does for big models."""
    tensors = load_file(model_dir / WEIGHTS)
    (model_dir / WEIGHTS).unlink()
    names = sorted(tensors)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[:len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for file, half in zip(files, halves):
        save_file({n: tensors[n] for n in half}, model_dir / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in half})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def test_sharded_safetensors_with_index_convert_like_one_file(model, tmp_path, reference):
    _shard(model)
    run(model, tmp_path / "out")
    got = load_file(tmp_path / "out" / rank_file(0))
    assert got.keys() == reference.keys()
    for name in reference:
        assert torch.equal(got[name], reference[name]), name


def test_index_naming_absent_shard(model, tmp_path):
    files = _shard(model)
    (model / files[1]).unlink()
    with pytest.raises(EngineError, match=f"names shards that are missing: {files[1]}"):
        HFDirSource(model)


def test_index_without_weight_map(model, tmp_path):
    _shard(model)
    (model / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(EngineError, match="has no weight_map"):
        HFDirSource(model)


def test_pytorch_bin_fallback_converts_like_safetensors(model, tmp_path, reference):
    tensors = load_file(model / WEIGHTS)
    (model / WEIGHTS).unlink()
    torch.save(tensors, model / "pytorch_model.bin")
    run(model, tmp_path / "out")
    got = load_file(tmp_path / "out" / rank_file(0))
    assert got.keys() == reference.keys()
    for name in reference:
        assert torch.equal(got[name], reference[name]), name


class _RunsCode:
    """A pickle that runs a shell command when loaded without weights_only (what a malicious .bin does)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickle_with_code_is_refused(model, tmp_path):
    marker = tmp_path / "code-ran"
    tensors = load_file(model / WEIGHTS)
    (model / WEIGHTS).unlink()
    torch.save({**tensors, "payload": _RunsCode(marker)}, model / "pytorch_model.bin")
    with pytest.raises(EngineError) as info:
        HFDirSource(model)
    assert "not a weights-only PyTorch checkpoint" in str(info.value)
    assert "system" in str(info.value)  # names what it wanted to call
    assert not marker.exists()
    # the same pickle does run code when loaded the unsafe way, so the refusal above is what protects us
    torch.load(model / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_truncated_pytorch_bin(model, tmp_path):
    tensors = load_file(model / WEIGHTS)
    (model / WEIGHTS).unlink()
    path = model / "pytorch_model.bin"
    torch.save(tensors, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(EngineError) as info:
        HFDirSource(model)
    assert "truncated or corrupt" in str(info.value) and "\n" not in str(info.value)


def _header_len(path: Path) -> int:
    return int.from_bytes(path.read_bytes()[:8], "little")


@pytest.mark.parametrize("damage", ["cut in the data", "cut in the header", "cut in the length",
                                    "corrupt header bytes", "absurd header length"])
def test_damaged_safetensors(model, tmp_path, damage):
    path = model / WEIGHTS
    data = bytearray(path.read_bytes())
    header_end = 8 + _header_len(path)
    if damage == "cut in the data":
        data = data[: header_end + (len(data) - header_end) // 2]
    elif damage == "cut in the header":
        data = data[: header_end // 2]
    elif damage == "cut in the length":
        data = data[:5]
    elif damage == "corrupt header bytes":
        data[8:40] = b"\xff" * 32
    else:
        data[:8] = (1 << 50).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(EngineError) as info:
        source = HFDirSource(model)
        convert(source, ConvertConfig(output_dir=tmp_path / "out"))
    assert str(path) in str(info.value) and "truncated or corrupt" in str(info.value)
    assert_no_output(tmp_path / "out")


# ---- tensors ------------------------------------------------------------------------------------------------

def test_missing_tensor_is_named(model, tmp_path):
    edit_tensors(model, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    fails(model, tmp_path / "out", "layers.1.mlp.up.weight", "model.layers.1.mlp.up_proj.weight")


def test_missing_tensor_fails_with_tp_too(model, tmp_path):
    edit_tensors(model, lambda t: t.pop("model.norm.weight"))
    fails(model, tmp_path / "out", "final_norm.weight (model.norm.weight)", tp=2)


def test_extra_unknown_tensor_is_named(model, tmp_path):
    edit_tensors(model, lambda t: t.update({"model.layers.0.mlp.adapter.weight": torch.zeros(4, 4)}))
    fails(model, tmp_path / "out", "model.layers.0.mlp.adapter.weight")


def test_tensor_of_the_wrong_shape_is_named(model, tmp_path):
    def widen(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)  # config: 2 kv heads * 16 = 32 rows
    edit_tensors(model, widen)
    fails(model, tmp_path / "out", "model.layers.0.self_attn.k_proj.weight", "[64, 64]", "[32, 64]")


def test_tensor_twice_across_shards(model, tmp_path):
    tensors = load_file(model / WEIGHTS)
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, model / "extra.safetensors")
    (model / WEIGHTS).rename(model / "main.safetensors")  # no index: every *.safetensors is read
    with pytest.raises(EngineError, match="model.norm.weight is in both extra.safetensors and main.safetensors"):
        HFDirSource(model)


def test_float64_weights_need_a_dtype(model, tmp_path):
    edit_config(model, dtype=None, torch_dtype=None)
    edit_tensors(model, lambda t: t.update({k: v.double() for k, v in t.items()}))
    fails(model, tmp_path / "out", "are float64", "pass --dtype")
    assert run(model, tmp_path / "out", dtype="float32").dtype == "float32"


# ---- the output directory -----------------------------------------------------------------------------------

def test_existing_output_refused_without_force(model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(EngineError, match="already exists; pass --force") as info:
        run(model, out)
    assert info.value.usage
    assert (out / "keep.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def test_force_replaces_a_complete_checkpoint(model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    run(model, out, force=True, tp=2)
    assert not (out / "old.txt").exists()
    assert load_checkpoint_config(out).mapping.tp_size == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]  # no .out.tmp-* / .out.old-* left
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert (out / rank_file(0)).stat().st_mode & 0o666 == 0o666 & ~umask  # not the safetensors writer's 0600


def test_force_keeps_the_old_directory_when_conversion_fails(model, tmp_path):
    out = tmp_path / "out"
    run(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    edit_tensors(model, lambda t: t.pop("model.layers.0.self_attn.o_proj.weight"))
    with pytest.raises(EngineError, match="layers.0.attention.dense.weight"):
        run(model, out, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]


def test_output_dir_holding_the_source_is_refused_even_with_force(model, tmp_path):
    before = sorted(p.name for p in model.iterdir())
    for out in (model, model.parent):
        with pytest.raises(EngineError, match="holds the model being converted") as info:
            run(model, out, force=True)
        assert info.value.usage
    assert sorted(p.name for p in model.iterdir()) == before


def test_output_under_a_file_is_refused(model, tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(EngineError, match="cannot create output directory"):
        run(model, tmp_path / "file" / "out")


# ---- flag values --------------------------------------------------------------------------------------------

def test_tp_that_does_not_divide_the_heads_names_valid_sizes(model, tmp_path):
    fails(model, tmp_path / "out", "--tp 3", "num_heads 4", "1, 2, 4", usage=True, tp=3)


@pytest.mark.parametrize("flags, needle", [
    ({"tp": 0}, "--tp 0 must be at least 1"),
    ({"tp": -2}, "--tp -2 must be at least 1"),
    ({"dtype": "int7"}, "'int7' is not supported; use one of: auto, float32, float16, bfloat16"),
    ({"pp": 2}, "--pp 2: pipeline parallelism is not supported"),
])
def test_bad_flag_values_fail_before_reading_anything(tmp_path, flags, needle):
    with pytest.raises(EngineError) as info:
        ConvertConfig(output_dir=tmp_path / "out", **flags)
    assert needle in str(info.value) and info.value.usage and info.value.exit_code == 2


def test_dtype_aliases_are_normalized(model, tmp_path):
    assert ConvertConfig(output_dir=tmp_path, dtype="bf16").dtype == "bfloat16"
    ckpt = run(model, tmp_path / "out", dtype="fp16")
    assert ckpt.dtype == "float16"
    assert all(t.dtype == torch.float16 for t in load_file(tmp_path / "out" / rank_file(0)).values())
