"""Reproducible artifacts: the same source, flags and toolchain give byte-identical checkpoints and engines, each
command in its own process and into other directories (no paths, times or process state inside the files).

ONNX Runtime's optimized-model writer was checked to be byte-stable here (node names, initializer order and the
external-data layout of rank{N}.onnx.data); the quantized build also covers the seeded accuracy report, whose held-out
text the reference engine samples and whose perplexities go into config.json.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ENGINE = str(Path(sys.executable).with_name("engine"))
BUILD_YAML = """\
max_batch_size: 4
max_input_len: 32
max_seq_len: 64
max_num_tokens: 64
tokens_per_block: 4
"""


def engine(*args) -> None:
    r = subprocess.run([ENGINE, *map(str, args)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr


def files_of(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def twice(tiny, tmp_path_factory) -> tuple[Path, Path]:
    """The tiny Llama converted twice, in two processes, into two directories."""
    root = tmp_path_factory.mktemp("reproducible")
    hf = tiny.hf_dir("LlamaForCausalLM")
    for name in ("a", "b"):
        engine("convert", "--model-dir", hf, "--output-dir", root / name / "ckpt", "--tp", 2)
    (root / "build.yaml").write_text(BUILD_YAML)
    return root / "a", root / "b"


def test_convert_twice_gives_identical_checkpoints(twice):
    a, b = twice
    assert files_of(a / "ckpt") == files_of(b / "ckpt")
    assert set(files_of(a / "ckpt")) >= {"config.json", "rank0.safetensors", "rank1.safetensors", "tokenizer.json"}


@pytest.mark.parametrize("flags", [("--tp", "1"), ("--tp", "2"), ("--tp", "1", "--dtype", "int8_wo",
                                                                  "--eval-tokens", "64")],
                         ids=["float32_resharded_to_tp1", "float32_tp2", "int8_wo_with_accuracy_report"])
def test_build_twice_gives_identical_engines(twice, flags):
    a, b = twice
    config = a.parent / "build.yaml"
    tag = "_".join(flags)
    for root in (a, b):  # each from its own checkpoint: equal checkpoints, other paths
        engine("build", "--config", config, "--checkpoint-dir", root / "ckpt", "--output-dir", root / tag, *flags)
    first, second = files_of(a / tag), files_of(b / tag)
    assert first == second, [name for name in first if first[name] != second.get(name)]
    assert {"config.json", "tokenizer.json"} <= set(first) and any(name.endswith(".onnx.data") for name in first)
