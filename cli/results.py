"""The fields that `--json` documents share: what identifies a checkpoint or an engine directory.

    digest             "sha256:<hex>" of the artifact's config.json, which lists every other file's sha256
    source_digest      the HF directory or GGUF file it was converted from (core/manifest.py)
    checkpoint_digest  engines: the checkpoint it was built from
    files, bytes       how many files the manifest lists, and their total size
"""
from __future__ import annotations

from pathlib import Path

from engine.core.artifacts import CheckpointConfig
from engine.core.engine_format import EngineConfig
from engine.core.manifest import CONFIG, digest_file


def _manifest_fields(directory: Path, config: CheckpointConfig | EngineConfig) -> dict:
    m = config.manifest
    return {"digest": digest_file(Path(directory) / CONFIG), "source_digest": m.source_digest,
            "files": len(m.files), "bytes": sum(f.size for f in m.files)}


def checkpoint_result(ckpt_dir: Path, config: CheckpointConfig) -> dict:
    return {"checkpoint_dir": str(ckpt_dir), **_manifest_fields(ckpt_dir, config),
            "format_version": config.format_version, "architecture": config.architecture, "dtype": config.dtype,
            "tp": config.mapping.tp_size, "source": config.source}


def engine_result(engine_dir: Path, config: EngineConfig) -> dict:
    return {"engine_dir": str(engine_dir), **_manifest_fields(engine_dir, config),
            "checkpoint_digest": config.manifest.checkpoint_digest, "format_version": config.format_version,
            "toolchain_version": config.toolchain_version, "backend": config.build.backend,
            "backend_version": config.backend_version, "architecture": config.model.architecture,
            "build": config.build, "build_flags": config.build_flags,
            "quantization": {"mode": config.quantization.mode, "accuracy": config.quantization.accuracy}}
