"""A calibration kept between builds (`engine build --calib-cache DIR`), as TensorRT keeps an INT8 calibration cache.

    DIR/<key>/tensors.safetensors   calibrate()'s tensors by canonical name (tp 1: each build shards them)
    DIR/<key>/record.json           its record for config.json
    DIR/<key>/dtypes.json           tensors of ml_dtypes (fp8's e4m3), stored as their bytes: name -> dtype

The key covers everything calibration reads: the checkpoint's digest (manifest.verify_checkpoint hashes every
file), the mode and its group size and lm_head choice, the calibration options (the data file's bytes, not its
path), the sequence length the text is sampled at, the settings of the float reference engine that samples it, and
the versions of the engine, ModelOpt and torch. So the tp 1, 2 and 4 builds of one checkpoint and mode calibrate
once: a 1.5B model's fp8 calibration is most of a 10-minute build and of its 20 GB peak (bench/NOTES.md 55).
Opt-in, because a change to the calibration code itself does not change the key: delete DIR to calibrate afresh.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np

from engine.core.errors import EngineError
from engine.core.model_config import QuantConfig

TENSORS, RECORD, DTYPES = "tensors.safetensors", "record.json", "dtypes.json"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def key(checkpoint_digest: str, quant: QuantConfig, opts, sample_len: int, build: dict) -> str:
    """The cache key of one calibration (`opts`: CalibrationOptions; `build`: the engine's version and the settings
    of the reference engine that samples the text)."""
    data = None if opts.data is None else hashlib.sha256(Path(opts.data).read_bytes()).hexdigest()
    fields = {"checkpoint": checkpoint_digest, "mode": quant.mode, "group_size": quant.group_size,
              "quantize_lm_head": quant.quantize_lm_head, "source_grid": quant.source_grid,
              "data": data, "size": opts.size, "max_seq_len": opts.max_seq_len, "seed": opts.seed,
              "batch_size": opts.batch_size, "sample_len": sample_len, "build": build,
              "modelopt": _version("nvidia-modelopt"), "torch": _version("torch")}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _save(tensors: dict, path: Path) -> None:
    from safetensors.numpy import save_file
    plain, dtypes = {}, {}
    for name, value in tensors.items():
        value = np.require(value, requirements="C")  # ascontiguousarray would make a scalar 1-d
        if value.dtype.type.__module__ == "ml_dtypes":
            dtypes[name], value = value.dtype.name, value.view(np.uint8)
        plain[name] = value
    save_file(plain, str(path / TENSORS))
    (path / DTYPES).write_text(json.dumps(dtypes) + "\n")


def _load(path: Path) -> dict:
    import ml_dtypes
    from safetensors.numpy import load_file
    tensors = load_file(str(path / TENSORS))
    for name, dtype in json.loads((path / DTYPES).read_text()).items():
        tensors[name] = tensors[name].view(getattr(ml_dtypes, dtype))
    return tensors


def cached(cache_dir: Path, entry: str, calibrate: Callable[[], tuple[dict, dict]]) -> tuple[dict, dict]:
    """(tensors, record) stored under cache_dir/entry, else calibrate() and store them there (atomically: an
    interrupted build leaves no half entry). A reused record says where it came from."""
    path = Path(cache_dir) / entry
    if (path / RECORD).is_file():
        record = json.loads((path / RECORD).read_text())
        return _load(path), {**record, "reused_from": str(path)}
    try:  # before calibrating: a folder that cannot hold the result should not cost a calibration
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise EngineError(f"--calib-cache {cache_dir}: cannot store a calibration there ({e.strerror}); pass a "
                          "writable folder, or leave the flag out", usage=True) from None
    tensors, record = calibrate()
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry}.", dir=path.parent))
    try:
        _save(tensors, tmp)
        (tmp / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        if not (path / RECORD).is_file():  # another build stored the same entry first: theirs stands
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tensors, record
