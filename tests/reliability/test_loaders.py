"""The loaders themselves on damaged files, below the manifest check: `engine build` and `engine run` refuse a
checkpoint or engine whose files differ from their manifest before loading anything, so these call the loaders
directly, as a directory without a manifest (or damaged after its check) would reach them. Each must raise an
EngineError naming the file and the fix, never the library's own exception.
"""
from __future__ import annotations

import onnxruntime as ort
import pytest

from engine.core.artifacts import load_checkpoint_config
from engine.core.errors import EngineError
from tests.reliability.conftest import copy_artifact
from tests.reliability.test_corrupt_files import ONNX, SAFETENSORS, _damage_file


@pytest.mark.parametrize("name", list(SAFETENSORS))
def test_checkpoint_rank_reader(artifacts, tmp_path, name):
    from engine.builder.rank_tensors import rank_tensors
    ckpt_dir = copy_artifact(artifacts.checkpoint, tmp_path / "ckpt")
    ckpt = load_checkpoint_config(ckpt_dir)
    path = ckpt_dir / "rank0.safetensors"
    _damage_file(path, SAFETENSORS[name])
    for tp in (1, 2):   # its own tp (read lazily), and resharded (read whole)
        with pytest.raises(EngineError) as info:
            tensors = rank_tensors(ckpt_dir, ckpt, tp, 0)
            for key in list(tensors):
                tensors[key]
        message = str(info.value)
        assert str(path) in message and "convert the model again" in message and "\n" not in message


@pytest.mark.parametrize("name", list(ONNX))
def test_onnx_session_loader(artifacts, tmp_path, name):
    from engine.runtime.session import load_ort_session
    engine = copy_artifact(artifacts.engine, tmp_path / "engine")
    file, damage = ONNX[name]
    _damage_file(engine / file, damage)
    with pytest.raises(EngineError) as info:
        load_ort_session(engine / "rank0.onnx", ort.SessionOptions())
    message = str(info.value)
    assert str(engine / "rank0.onnx") in message and "truncated or corrupt" in message
    assert "engine build" in message and "\n" not in message
