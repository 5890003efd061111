"""Artifacts of another version: an engine of another format version, built with another ONNX Runtime or by
another engine toolchain, or of an unknown backend, is refused by every command that loads it (run, serve, eval,
inspect stays readable) with the command that rebuilds it; a checkpoint of another format version is refused by
build with the command that converts it again. Nothing is half-loaded."""
from __future__ import annotations

import json

import pytest

from tests.reliability.conftest import BUILD_FLAGS, assert_clean_failure, copy_artifact, no_output, run_cli

ENGINE_MISMATCHES = {
    "format_version": (99, "format_version 99"),
    "backend_version": ("1.0.0", "built with onnxruntime 1.0.0"),
    "toolchain_version": ("0.0.1", "built by engine 0.0.1"),
    "format": ("tensorrt-llm-engine", "is not an engine"),
}


def _set(path, key, value):
    data = json.loads(path.read_text())
    if "." in key:
        outer, inner = key.split(".")
        data[outer][inner] = value
    else:
        data[key] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("command", ["run", "serve", "eval"])
@pytest.mark.parametrize("field", list(ENGINE_MISMATCHES))
def test_engine_of_another_version_is_refused_with_a_rebuild_message(artifacts, tmp_path, command, field):
    engine = copy_artifact(artifacts.engine, tmp_path / "engine")
    value, needle = ENGINE_MISMATCHES[field]
    _set(engine / "config.json", field, value)
    args = {"run": ["--input-text", "hi", "--max-output-len", "2"], "serve": ["--port", "0"],
            "eval": ["--data", str(tmp_path / "text.txt")]}[command]
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    code, err = run_cli(command, "--engine-dir", str(engine), *args)
    line = assert_clean_failure(code, err, needle)
    assert "engine build" in line and "--force" in line and str(engine) in line


def test_engine_of_an_unknown_backend_is_refused(artifacts, tmp_path):
    engine = copy_artifact(artifacts.engine, tmp_path / "engine")
    _set(engine / "config.json", "build.backend", "tvm")
    code, err = run_cli("run", "--engine-dir", str(engine), "--input-text", "hi", "--max-output-len", "2")
    line = assert_clean_failure(code, err, "unknown backend 'tvm'")
    assert "engine build" in line


@pytest.mark.parametrize("value", [1, 99, None])
def test_checkpoint_of_another_format_version_is_refused(artifacts, tmp_path, value):
    ckpt = copy_artifact(artifacts.checkpoint, tmp_path / "ckpt")
    _set(ckpt / "config.json", "format_version", value)
    out = tmp_path / "out"
    code, err = run_cli("build", "--checkpoint-dir", str(ckpt), "--output-dir", str(out), *BUILD_FLAGS)
    assert_clean_failure(code, err, f"format_version {value!r}", "engine convert")
    assert no_output(out)
