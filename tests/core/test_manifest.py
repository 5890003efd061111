"""Manifests (core/manifest.py): every file but config.json listed with its size and sha256, the first mismatch
found in a fixed order, digests that do not depend on listing order, and a manifest that survives config.json."""
from __future__ import annotations

import hashlib
import json

import pytest

from engine.core.engine_format import BuildConfig, EngineConfig
from engine.core.manifest import (FileDigest, Manifest, digest_entries, digest_file, first_mismatch, scan)
from engine.core.model_config import ModelConfig
from engine.core.serde import from_json, to_json


@pytest.fixture
def artifact(tmp_path):
    d = tmp_path / "a"
    (d / "sub").mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "b.bin").write_bytes(bytes(range(256)) * 10)
    (d / "a.txt").write_text("hello")
    (d / "sub" / "c.json").write_text("[1]")
    return d


def test_scan_lists_every_file_but_config_json_sorted_with_sha256(artifact):
    entries = scan(artifact)
    assert [e.path for e in entries] == ["a.txt", "b.bin", "sub/c.json"]
    for e in entries:
        data = (artifact / e.path).read_bytes()
        assert e.size == len(data) and e.sha256 == hashlib.sha256(data).hexdigest()
    assert digest_file(artifact / "a.txt") == "sha256:" + hashlib.sha256(b"hello").hexdigest()


def test_first_mismatch_names_the_file_and_the_problem(artifact):
    manifest = Manifest(files=scan(artifact))
    assert first_mismatch(artifact, manifest, unlisted=True) is None

    data = bytearray((artifact / "b.bin").read_bytes())
    data[1000] ^= 0xFF  # same size, other bytes: only the hash sees it
    (artifact / "b.bin").write_bytes(bytes(data))
    m = first_mismatch(artifact, manifest)
    assert m.path == "b.bin" and "sha256" in m.problem
    assert first_mismatch(artifact, manifest, contents=False) is None  # sizes alone cannot see it

    (artifact / "sub" / "c.json").write_text("[1, 2]")
    m = first_mismatch(artifact, manifest)  # sizes are checked before any hash
    assert m.path == "sub/c.json" and "size 6 bytes, the manifest says 3" in m.problem

    (artifact / "a.txt").unlink()
    assert first_mismatch(artifact, manifest).path == "a.txt"
    assert first_mismatch(artifact, manifest).problem == "missing"


def test_unlisted_files_are_reported_only_when_asked(artifact):
    manifest = Manifest(files=scan(artifact))
    (artifact / "stray.txt").write_text("x")
    assert first_mismatch(artifact, manifest) is None
    m = first_mismatch(artifact, manifest, unlisted=True)
    assert (m.path, m.problem) == ("stray.txt", "not in the manifest")


def test_an_empty_manifest_never_matches(artifact):
    m = first_mismatch(artifact, Manifest())
    assert m.path == "config.json" and "no manifest" in m.problem


def test_digest_of_a_file_list_is_canonical():
    a, b = FileDigest("x", 1, "00" * 32), FileDigest("y", 2, "11" * 32)
    assert digest_entries((a, b)) == digest_entries((b, a))
    assert digest_entries((a, b)) != digest_entries((a, FileDigest("y", 3, "11" * 32)))
    doc = json.dumps([{"path": "x", "sha256": "00" * 32, "size": 1}, {"path": "y", "sha256": "11" * 32, "size": 2}],
                     separators=(",", ":"))
    assert digest_entries((a, b)) == "sha256:" + hashlib.sha256(doc.encode()).hexdigest()


def test_manifest_round_trips_through_config_json():
    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=8, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=4, intermediate_size=16, norm_eps=1e-5, max_position_embeddings=64)
    manifest = Manifest(files=(FileDigest("rank0.onnx", 10, "ab" * 32),), source_digest="sha256:" + "cd" * 32,
                        checkpoint_digest="sha256:" + "ef" * 32)
    config = EngineConfig(model=model, build=BuildConfig(), build_flags={"max_batch_size": 2}, manifest=manifest)
    data = json.loads(json.dumps(to_json(config)))
    assert from_json(EngineConfig, data, where="config.json") == config
    data["manifest"]["files"][0]["extra"] = 1
    with pytest.raises(Exception, match=r"manifest.files\[0\]: unknown keys \['extra'\]"):
        from_json(EngineConfig, data, where="config.json")
