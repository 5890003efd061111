"""`engine build --calib-cache`: a calibration stored once is what a later build of the same checkpoint, mode and
options uses at any tp, without calibrating; anything that changes calibration misses it."""
from __future__ import annotations

import dataclasses
import json

import pytest

from engine.builder import build as build_module
from engine.builder.build import build_engine
from engine.core.model_config import QuantConfig
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.session import EngineSession
from engine.runtime.tp.session import TPSession
from tests.builder.engines import ALL_PLUGINS, TEST_BUILD, prompts
from tests.builder.test_engine_dir import cli
from tests.tp.parity import check_same_as_tp1

from .calibrated_engines import TINY_CALIBRATION
from .engines import NO_REPORT

LLAMA = "LlamaForCausalLM"


def _build(tiny, out, cache, *, tp=1, calibration=TINY_CALIBRATION, mode="fp8"):
    build_engine(tiny.checkpoint(LLAMA), out, dataclasses.replace(TEST_BUILD, tp_size=tp), ALL_PLUGINS,
                 accuracy=NO_REPORT, quant=QuantConfig(mode=mode),
                 calibration=dataclasses.replace(calibration, cache=cache))
    return load_engine_config(out).quantization.calibration


def test_a_stored_calibration_builds_every_tp_without_calibrating(tiny, tmp_path, monkeypatch):
    cache = tmp_path / "calib"
    first = _build(tiny, tmp_path / "tp1", cache)
    assert "reused_from" not in first and len(list(cache.iterdir())) == 1
    monkeypatch.setattr(build_module, "calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    again = _build(tiny, tmp_path / "tp1_again", cache)
    assert again.pop("reused_from") == str(next(cache.iterdir())) and again == first
    for name in ("rank0.onnx", "rank0.onnx.data"):
        assert (tmp_path / "tp1" / name).read_bytes() == (tmp_path / "tp1_again" / name).read_bytes(), name
    _build(tiny, tmp_path / "tp2", cache, tp=2)
    session = TPSession(tmp_path / "tp2", num_blocks=64)
    try:
        check_same_as_tp1(EngineSession(tmp_path / "tp1", num_blocks=64), session, prompts(2, (5, 13), seed=5),
                          steps=4, what="fp8 tp2 from the stored calibration")
    finally:
        session.close()
    monkeypatch.undo()
    # another calibration set, or another mode, is another entry
    _build(tiny, tmp_path / "other", cache, calibration=dataclasses.replace(TINY_CALIBRATION, seed=1))
    _build(tiny, tmp_path / "int8_sq", cache, mode="int8_sq")
    entries = list(cache.iterdir())
    assert len(entries) == 3 and not [p for p in entries if p.name.startswith(".")]
    assert json.loads((entries[0] / "record.json").read_text())["sequences"] == TINY_CALIBRATION.size


def test_calib_cache_flag_errors(tiny, tmp_path, monkeypatch, capsys):
    base = ["build", "--checkpoint-dir", str(tiny.checkpoint(LLAMA)), "--output-dir", str(tmp_path / "e")]
    code, _, err = cli(monkeypatch, capsys, *base, "--dtype", "int8_wo", "--calib-cache", str(tmp_path / "c"))
    assert code == 2 and "--calib-cache applies to --dtype" in err
    (tmp_path / "file").write_text("x")
    code, _, err = cli(monkeypatch, capsys, *base, "--dtype", "fp8", "--calib-cache", str(tmp_path / "file"))
    assert code == 2 and "is a file" in err and not (tmp_path / "e").exists()
    code, _, err = cli(monkeypatch, capsys, *base, "--dtype", "fp8", "--calib-cache", str(tmp_path / "file" / "sub"))
    assert code == 2 and "cannot store a calibration there" in err and not (tmp_path / "e").exists()
