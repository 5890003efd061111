"""`engine build --backend tensorrt` on a machine without TensorRT: a usage error (exit 2) that names the `tensorrt`
extra and the NVIDIA GPU requirement, and no output directory; `--backend auto` builds an onnxruntime engine."""
from __future__ import annotations

import pytest

from engine.builder.tensorrt_backend import tensorrt_unavailable
from engine.cli.app import main
from engine.core.serde import read_json

pytestmark = pytest.mark.skipif(tensorrt_unavailable() is None, reason="TensorRT and a CUDA GPU are available here")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_tensorrt_without_tensorrt(tiny, tmp_path, capsys):
    out_dir = tmp_path / "engine"
    code, _, err = cli(capsys, "build", "--checkpoint-dir", str(tiny.checkpoint("LlamaForCausalLM")),
                       "--output-dir", str(out_dir), "--backend", "tensorrt")
    assert code == 2
    message = " ".join(err.split())
    assert "--backend tensorrt" in message and "engine[tensorrt]" in message and "NVIDIA GPU" in message, err
    assert "Traceback" not in err
    assert not out_dir.exists()
    assert not list(tmp_path.iterdir())


def test_auto_picks_onnxruntime(tiny, tmp_path, capsys):
    out_dir = tmp_path / "engine"
    code, out, err = cli(capsys, "build", "--checkpoint-dir", str(tiny.checkpoint("LlamaForCausalLM")),
                         "--output-dir", str(out_dir), "--backend", "auto", "--max-seq-len", "64",
                         "--max-batch-size", "2", "--max-num-tokens", "64", "--max-input-len", "32")
    assert code in (0, None), err
    assert read_json(out_dir / "config.json")["build"]["backend"] == "onnxruntime"


@pytest.mark.parametrize("flags", [["--workspace-size", "4GiB"], ["--input-timing-cache", "t.cache"],
                                   ["--output-timing-cache", "t.cache"]])
def test_tensorrt_flags_refused_for_onnxruntime(tiny, tmp_path, capsys, flags):
    out_dir = tmp_path / "engine"
    code, _, err = cli(capsys, "build", "--checkpoint-dir", str(tiny.checkpoint("LlamaForCausalLM")),
                       "--output-dir", str(out_dir), "--backend", "onnxruntime", *flags)
    assert code == 2
    assert "apply to TensorRT builds" in " ".join(err.split()), err
    assert not out_dir.exists()


def test_bad_workspace_size(tiny, tmp_path, capsys):
    code, _, err = cli(capsys, "build", "--checkpoint-dir", str(tiny.checkpoint("LlamaForCausalLM")),
                       "--output-dir", str(tmp_path / "engine"), "--workspace-size", "lots")
    assert code == 2
    assert "--workspace-size 'lots'" in " ".join(err.split()), err
