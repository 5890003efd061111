"""engine pack / unpack (core/packing.py): the same directory gives the same tar bytes; unpacking checks every file
against the manifest and leaves nothing behind when one differs; links, `..` and foreign files are refused."""
from __future__ import annotations

import gzip
import io
import json
import os
import tarfile

import pytest

from engine.core.errors import EngineError
from engine.core.manifest import Manifest, scan
from engine.core.packing import pack, unpack
from engine.core.serde import to_json


def make_artifact(d):
    d.mkdir(parents=True)
    (d / "rank0.onnx").write_bytes(b"graph" * 100)
    (d / "rank0.onnx.data").write_bytes(os.urandom(5000))
    (d / "tokenizer.json").write_text('{"model": {}}')
    config = {"format": "engine", "format_version": 2, "manifest": to_json(Manifest(files=scan(d)))}
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return d


def files_of(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def no_output(path) -> bool:
    return not path.exists() and not any(p.name.startswith(f".{path.name}.") for p in path.parent.iterdir())


def test_pack_is_reproducible_and_unpack_restores_every_byte(tmp_path):
    eng = make_artifact(tmp_path / "eng")
    first = pack(eng, tmp_path / "a.tar")
    os.utime(eng / "rank0.onnx.data", (1, 1))  # times and modes of the files are not part of the archive
    os.chmod(eng / "tokenizer.json", 0o600)
    second = pack(eng, tmp_path / "b.tar")
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    assert first == second and first.files == 3
    with tarfile.open(tmp_path / "a.tar") as tar:
        names = tar.getnames()
        assert names == ["eng", "eng/config.json", "eng/rank0.onnx", "eng/rank0.onnx.data", "eng/tokenizer.json"]
        assert {(m.mtime, m.uid, m.gid, m.uname) for m in tar.getmembers()} == {(0, 0, 0, "")}
    unpack(tmp_path / "a.tar", tmp_path / "out")
    assert files_of(tmp_path / "out") == files_of(eng)


def test_pack_refuses_a_directory_that_differs_from_its_manifest(tmp_path):
    eng = make_artifact(tmp_path / "eng")
    data = bytearray((eng / "rank0.onnx.data").read_bytes())
    data[10] ^= 1
    (eng / "rank0.onnx.data").write_bytes(bytes(data))
    with pytest.raises(EngineError, match="rank0.onnx.data has another sha256; nothing was packed"):
        pack(eng, tmp_path / "e.tar")
    assert no_output(tmp_path / "e.tar")


def test_unpack_refuses_a_damaged_member_and_leaves_nothing(tmp_path):
    eng = make_artifact(tmp_path / "eng")
    pack(eng, tmp_path / "e.tar")
    raw = bytearray((tmp_path / "e.tar").read_bytes())
    at = raw.index(b"graph" * 10)  # inside rank0.onnx's data
    raw[at] ^= 0xFF
    (tmp_path / "bad.tar").write_bytes(bytes(raw))
    with pytest.raises(EngineError, match="rank0.onnx does not match its manifest"):
        unpack(tmp_path / "bad.tar", tmp_path / "out")
    assert no_output(tmp_path / "out")


def test_unpack_reads_compressed_archives(tmp_path):
    eng = make_artifact(tmp_path / "eng")
    pack(eng, tmp_path / "e.tar")
    (tmp_path / "e.tar.gz").write_bytes(gzip.compress((tmp_path / "e.tar").read_bytes()))
    unpack(tmp_path / "e.tar.gz", tmp_path / "out")
    assert files_of(tmp_path / "out") == files_of(eng)


def _tar_with(tmp_path, eng, extra: tarfile.TarInfo, data: bytes = b""):
    """A copy of `engine pack`'s archive of `eng` with one more member."""
    pack(eng, tmp_path / "e.tar")
    out = tmp_path / "x.tar"
    with tarfile.open(tmp_path / "e.tar") as src, tarfile.open(out, "w") as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m) if m.isfile() else None)
        extra.size = len(data)
        dst.addfile(extra, io.BytesIO(data))
    return out


@pytest.mark.parametrize("kind", ["symlink", "dotdot", "absolute", "unlisted", "second_root"])
def test_unpack_refuses_what_pack_never_writes(tmp_path, kind):
    eng = make_artifact(tmp_path / "eng")
    info = tarfile.TarInfo({"symlink": "eng/link", "dotdot": "eng/../evil", "absolute": "/tmp/evil",
                            "unlisted": "eng/extra.bin", "second_root": "other/x"}[kind])
    if kind == "symlink":
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    archive = _tar_with(tmp_path, eng, info, b"" if kind == "symlink" else b"x")
    needle = {"symlink": "not a regular file", "dotdot": "outside its directory", "absolute": "outside its directory",
              "unlisted": "does not list: extra.bin", "second_root": "more than one top-level directory"}[kind]
    with pytest.raises(EngineError, match=needle):
        unpack(archive, tmp_path / "out")
    assert no_output(tmp_path / "out")
    assert not (tmp_path / "evil").exists()
