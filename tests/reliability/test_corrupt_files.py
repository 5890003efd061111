"""Truncated and corrupt input files, each through the command that reads it: `convert` (safetensors, GGUF,
tokenizer files), `build` (checkpoint rank files and config.json) and `run` (engine config.json, the ONNX graph and
its external-data file). Every case must end in one line `error: ...` naming the file and saying what to do, exit
status 1, no traceback, and (convert, build) no output directory or temporary sibling left behind.

Damage is cut at several points (inside the length prefix, the header, the data, one byte short), flipped bytes in
headers, headers that parse but lie (offsets past the end, shapes that do not fit, unknown dtypes), and
config.json values of the wrong type or out of range. Bytes flipped inside tensor data cannot be detected by
the formats themselves (no checksums): they are not faults a loader can refuse.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import pytest

from tests.reliability.conftest import (BUILD_FLAGS, assert_clean_failure, copy_artifact, gguf_reader_available,
                                        no_output, run_cli)

Damage = Callable[[bytes], bytes]


def cut(at: float | int) -> Damage:
    """Keep the first `at` bytes (an int), or that fraction of the file (a float); negative ints drop the tail."""
    def damage(data: bytes) -> bytes:
        n = int(len(data) * at) if isinstance(at, float) else (len(data) + at if at < 0 else at)
        return data[:n]
    return damage


def flip(offset: int | float, n: int = 16) -> Damage:
    def damage(data: bytes) -> bytes:
        out = bytearray(data)
        start = int(len(data) * offset) if isinstance(offset, float) else offset
        for i in range(start, min(start + n, len(out))):
            out[i] ^= 0xFF
        return bytes(out)
    return damage


def safetensors_header(edit: Callable[[dict], dict | bytes]) -> Damage:
    """Rewrite the JSON header of a safetensors file (keeping the data as it is)."""
    def damage(data: bytes) -> bytes:
        n = int.from_bytes(data[:8], "little")
        header = edit(json.loads(data[8:8 + n]))
        raw = header if isinstance(header, bytes) else json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        return len(raw).to_bytes(8, "little") + raw + data[8 + n:]
    return damage


def _tensors(h: dict) -> list[str]:
    return [k for k in h if k != "__metadata__"]


def _set(h: dict, field: str, value) -> dict:
    h[_tensors(h)[0]][field] = value
    return h


def _double_rows(h: dict) -> dict:
    t = h[_tensors(h)[0]]
    t["shape"] = [t["shape"][0] * 2, *t["shape"][1:]]
    return h


def _overlap(h: dict) -> dict:
    names = _tensors(h)
    h[names[1]]["data_offsets"] = h[names[0]]["data_offsets"]
    return h


SAFETENSORS = {
    "empty": cut(0), "cut in the length": cut(5), "cut after the length": cut(8), "cut in the header": cut(100),
    "cut in the data": cut(0.5), "one byte short": cut(-1),
    "header bytes flipped": flip(10), "header not json": safetensors_header(lambda h: b'{"a": '),
    "header a list": safetensors_header(lambda h: b"[1, 2, 3]"),
    "unknown dtype": safetensors_header(lambda h: _set(h, "dtype", "F8_E9")),
    "offsets past the end": safetensors_header(lambda h: _set(h, "data_offsets", [0, 10**12])),
    "negative shape": safetensors_header(lambda h: _set(h, "shape", [-1, 4])),
    "shape larger than its bytes": safetensors_header(_double_rows),
    "overlapping tensors": safetensors_header(_overlap),
    "absurd header length": lambda data: (1 << 50).to_bytes(8, "little") + data[8:],
}

GGUF = {
    "empty": cut(0), "cut in the magic": cut(3), "cut after the magic": cut(4), "cut in the counts": cut(16),
    "cut in the metadata": cut(1000), "cut in the tensor data": cut(0.5), "one byte short": cut(-1),
    "wrong magic": lambda d: b"GGML" + d[4:], "version 99": lambda d: d[:4] + struct.pack("<I", 99) + d[8:],
    "version 1": lambda d: d[:4] + struct.pack("<I", 1) + d[8:],
    "huge tensor count": lambda d: d[:8] + struct.pack("<Q", 2**40) + d[16:],
    "huge metadata count": lambda d: d[:16] + struct.pack("<Q", 2**40) + d[24:],
    "metadata count too small": lambda d: d[:16] + struct.pack("<Q", 3) + d[24:],
    "metadata bytes flipped": flip(40, 8),
}

TOKENIZER = {
    "tokenizer.json cut": ("tokenizer.json", cut(0.5)),
    "tokenizer.json not a tokenizer": ("tokenizer.json", lambda d: b'{"model": 5}'),
    "tokenizer_config.json a list": ("tokenizer_config.json", lambda d: b"[1]"),
    "tokenizer_config.json cut": ("tokenizer_config.json", cut(0.5)),
}


def _damage_file(path: Path, damage: Damage) -> None:
    path.write_bytes(damage(path.read_bytes()))


# ---- convert: safetensors, GGUF and tokenizer files of the source ---------------------------------------------

@pytest.mark.parametrize("name", list(SAFETENSORS))
def test_convert_damaged_safetensors(artifacts, tmp_path, name):
    model = copy_artifact(artifacts.hf, tmp_path / "hf")
    _damage_file(model / "model.safetensors", SAFETENSORS[name])
    out = tmp_path / "out"
    code, err = run_cli("convert", "--model-dir", str(model), "--output-dir", str(out))
    assert_clean_failure(code, err, str(model / "model.safetensors"), "truncated or corrupt")
    assert no_output(out)


@pytest.mark.skipif(not gguf_reader_available(), reason="this transformers has no fast GGUF reader "
                    "(transformers.integrations.gguf); --gguf cannot run at all")
@pytest.mark.parametrize("name", list(GGUF))
def test_convert_damaged_gguf(artifacts, tmp_path, name):
    gguf = copy_artifact(artifacts.gguf, tmp_path / "model.gguf")
    _damage_file(gguf, GGUF[name])
    out = tmp_path / "out"
    code, err = run_cli("convert", "--gguf", str(gguf), "--output-dir", str(out))
    assert_clean_failure(code, err, str(gguf))
    assert no_output(out)


@pytest.mark.parametrize("name", list(TOKENIZER))
def test_convert_damaged_tokenizer_files(artifacts, tmp_path, name):
    """A tokenizer that could not be loaded fails the convert, not the engine's first run after a build."""
    file, damage = TOKENIZER[name]
    model = copy_artifact(artifacts.hf, tmp_path / "hf")
    _damage_file(model / file, damage)
    out = tmp_path / "out"
    code, err = run_cli("convert", "--model-dir", str(model), "--output-dir", str(out))
    assert_clean_failure(code, err, str(model / file))
    assert no_output(out)


# ---- build: the checkpoint ------------------------------------------------------------------------------------

def _build(ckpt: Path, out: Path) -> tuple[int, str]:
    return run_cli("build", "--checkpoint-dir", str(ckpt), "--output-dir", str(out), *BUILD_FLAGS)


@pytest.mark.parametrize("name", list(SAFETENSORS))
def test_build_damaged_rank_file(artifacts, tmp_path, name):
    ckpt = copy_artifact(artifacts.checkpoint, tmp_path / "ckpt")
    _damage_file(ckpt / "rank0.safetensors", SAFETENSORS[name])
    out = tmp_path / "out"
    code, err = _build(ckpt, out)
    line = assert_clean_failure(code, err, "rank0.safetensors")
    assert str(ckpt) in line
    assert no_output(out)


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _model(key, value):
    return lambda c: c["model"].__setitem__(key, value)


# config.json edits shared by checkpoints and engines, and the words the error must hold
CONFIG_EDITS = {
    "cut": (None, "not valid JSON"),
    "empty object": (lambda c: c.clear(), "format None"),
    "unknown top-level key": (lambda c: c.__setitem__("extra", 1), "unknown keys ['extra']"),
    "unknown model key": (lambda c: c["model"].__setitem__("extra", 1), "unknown keys ['extra']"),
    "num_layers a string": (_model("num_layers", "2"), "num_layers must be an integer"),
    "num_layers a float": (_model("num_layers", 2.5), "num_layers must be an integer"),
    "num_layers negative": (_model("num_layers", -1), "num_layers -1 must be at least 1"),
    "num_heads zero": (_model("num_heads", 0), "num_heads 0 must be at least 1"),
    "hidden_size null": (_model("hidden_size", None), "hidden_size must be an integer"),
    "vocab_size a string": (_model("vocab_size", "x"), "vocab_size must be an integer"),
    "head_dim a list": (_model("head_dim", [1]), "head_dim must be an integer"),
    "norm_eps a string": (_model("norm_eps", "tiny"), "norm_eps must be a number"),
    "architecture a number": (_model("architecture", 5), "architecture must be a string"),
    "layer_types a number": (_model("layer_types", 5), "layer_types must be a list"),
    "sliding_window a string": (_model("sliding_window", "x"), "sliding_window must be an integer or null"),
    "model not an object": (lambda c: c.__setitem__("model", 5), "model must be an object"),
    "mapping of strings": (lambda c: c.__setitem__("mapping", {"world_size": "1", "tp_size": 1, "pp_size": 1}),
                           "world_size must be an integer"),
    "quantization a number": (lambda c: c.__setitem__("quantization", 7), "quantization must be an object"),
}


@pytest.mark.parametrize("name", list(CONFIG_EDITS) + ["tp 2 without rank1", "format_version -1"])
def test_build_damaged_checkpoint_config(artifacts, tmp_path, name):
    ckpt = copy_artifact(artifacts.checkpoint, tmp_path / "ckpt")
    path = ckpt / "config.json"
    if name == "tp 2 without rank1":
        _edit_json(path, lambda c: c.__setitem__("mapping", {"world_size": 2, "tp_size": 2, "pp_size": 1}))
        needle = "lacks rank1.safetensors"
    elif name == "format_version -1":
        _edit_json(path, lambda c: c.__setitem__("format_version", -1))
        needle = "format_version -1"
    else:
        edit, needle = CONFIG_EDITS[name]
        if edit is None:
            _damage_file(path, cut(0.5))
        else:
            _edit_json(path, edit)
    out = tmp_path / "out"
    code, err = _build(ckpt, out)
    line = assert_clean_failure(code, err, needle)
    assert str(ckpt) in line
    assert no_output(out)


def test_build_checkpoint_whose_config_is_another_models(artifacts, tmp_path):
    """A config.json that parses and checks out but describes other weights (wider MLP): refused before ONNX
    Runtime meets the mismatched shapes."""
    ckpt = copy_artifact(artifacts.checkpoint, tmp_path / "ckpt")
    _edit_json(ckpt / "config.json", _model("intermediate_size", 256))
    out = tmp_path / "out"
    code, err = _build(ckpt, out)
    line = assert_clean_failure(code, err, "rank0.safetensors", "do not belong together")
    assert str(ckpt) in line
    assert no_output(out)


@pytest.mark.parametrize("name", list(TOKENIZER))
def test_build_damaged_checkpoint_tokenizer(artifacts, tmp_path, name):
    file, damage = TOKENIZER[name]
    ckpt = copy_artifact(artifacts.checkpoint, tmp_path / "ckpt")
    _damage_file(ckpt / file, damage)
    out = tmp_path / "out"
    code, err = _build(ckpt, out)
    line = assert_clean_failure(code, err, file)
    assert str(ckpt) in line
    assert no_output(out)


# ---- run: the engine directory --------------------------------------------------------------------------------

def _run(engine: Path) -> tuple[int, str]:
    return run_cli("run", "--engine-dir", str(engine), "--input-text", "hello", "--max-output-len", "4")


def _build_field(key, value):
    return lambda c: c["build"].__setitem__(key, value)


ENGINE_CONFIG_EDITS = {
    **CONFIG_EDITS,
    "max_seq_len a string": (_build_field("max_seq_len", "64"), "max_seq_len must be an integer"),
    "tokens_per_block zero": (_build_field("tokens_per_block", 0), "tokens_per_block 0 must be at least 1"),
    "tokens_per_block not a power of two": (_build_field("tokens_per_block", 6), "a power of two"),
    "max_batch_size negative": (_build_field("max_batch_size", -3), "max_batch_size -3 must be at least 1"),
    "max_input_len over max_seq_len": (_build_field("max_input_len", 10**6), "max_input_len 1000000"),
    "memory a string": (lambda c: c.__setitem__("memory", "x"), "memory must be an object"),
    "plugins unknown": (lambda c: c.__setitem__("plugins", {"x": 1}), "unknown keys ['x']"),
    "mapping tp 2 of a tp 1 build": (lambda c: c.__setitem__("mapping", {"world_size": 2, "tp_size": 2,
                                                                           "pp_size": 1}), "does not match"),
}


@pytest.mark.parametrize("name", list(ENGINE_CONFIG_EDITS))
def test_run_damaged_engine_config(artifacts, tmp_path, name):
    engine = copy_artifact(artifacts.engine, tmp_path / "engine")
    edit, needle = ENGINE_CONFIG_EDITS[name]
    path = engine / "config.json"
    if edit is None:
        _damage_file(path, cut(0.5))
    else:
        _edit_json(path, edit)
    code, err = _run(engine)
    line = assert_clean_failure(code, err, needle)
    assert str(engine) in line


ONNX = {
    "rank0.onnx empty": ("rank0.onnx", cut(0)), "rank0.onnx cut at 16 bytes": ("rank0.onnx", cut(16)),
    "rank0.onnx cut in half": ("rank0.onnx", cut(0.5)), "rank0.onnx one byte short": ("rank0.onnx", cut(-1)),
    "rank0.onnx bytes flipped at the start": ("rank0.onnx", flip(0, 64)),
    "rank0.onnx bytes flipped inside": ("rank0.onnx", flip(0.3, 64)),
    "rank0.onnx.data empty": ("rank0.onnx.data", cut(0)),
    "rank0.onnx.data cut in half": ("rank0.onnx.data", cut(0.5)),
    "rank0.onnx.data one byte short": ("rank0.onnx.data", cut(-1)),
}


@pytest.mark.parametrize("name", list(ONNX) + ["rank0.onnx.data missing"])
def test_run_damaged_onnx(artifacts, tmp_path, name):
    engine = copy_artifact(artifacts.engine, tmp_path / "engine")
    if name == "rank0.onnx.data missing":
        (engine / "rank0.onnx.data").unlink()
    else:
        file, damage = ONNX[name]
        _damage_file(engine / file, damage)
    code, err = _run(engine)
    line = assert_clean_failure(code, err, "rank0.onnx", "engine build")
    assert str(engine) in line


@pytest.mark.parametrize("name", list(TOKENIZER) + ["tokenizer.json missing"])
def test_run_damaged_engine_tokenizer(artifacts, tmp_path, name):
    engine = copy_artifact(artifacts.engine, tmp_path / "engine")
    if name == "tokenizer.json missing":
        file = "tokenizer.json"
        (engine / file).unlink()
    else:
        file, damage = TOKENIZER[name]
        _damage_file(engine / file, damage)
    code, err = _run(engine)
    line = assert_clean_failure(code, err, file)
    assert str(engine) in line
