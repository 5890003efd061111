"""`engine unpack` reads what the manifest promises and no more: a member it does not list, of another size, twice,
or a config.json that is not first or not small is refused from its tar header, before its data is read; a
decompression bomb costs nothing, and headers beyond the manifest's account are refused as they are read."""
from __future__ import annotations

import gzip
import io
import tarfile
import time

import pytest

from engine.core.errors import EngineError
from engine.core.packing import pack, unpack
from tests.core.test_packing import make_artifact, no_output

GiB = 1 << 30


def members(archive):
    with tarfile.open(archive) as tar:
        return [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]


def write_tar(path, items) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in items:
            tar.addfile(info, None if data is None else io.BytesIO(data))


def member_bytes(info: tarfile.TarInfo, data: bytes | None) -> bytes:
    """One member as a tar stream holds it: header, data, zeros to the next 512-byte block."""
    data = data or b""
    return info.tobuf(tarfile.PAX_FORMAT) + data + b"\0" * (-len(data) % 512)


def gzip_bomb(path, prefix: list, name: str, size: int) -> None:
    """A .tar.gz: `prefix` members, then `name` holding `size` zero bytes, written as repeated gzip members of
    1 MiB of zeros (about 1 KiB each) so that the archive is small and its contents are not."""
    info = tarfile.TarInfo(name)
    info.size = size
    mib = gzip.compress(b"\0" * (1 << 20))
    with open(path, "wb") as f:
        f.write(gzip.compress(b"".join(member_bytes(i, d) for i, d in prefix) + info.tobuf(tarfile.PAX_FORMAT)))
        for _ in range(size >> 20):
            f.write(mib)
        f.write(gzip.compress(b"\0" * 1024))


@pytest.fixture
def packed(tmp_path):
    eng = make_artifact(tmp_path / "eng")
    pack(eng, tmp_path / "e.tar")
    return members(tmp_path / "e.tar")


def refused(tmp_path, archive, needle: str) -> float:
    start = time.monotonic()
    with pytest.raises(EngineError, match=needle):
        unpack(archive, tmp_path / "out")
    assert no_output(tmp_path / "out")
    return time.monotonic() - start


@pytest.mark.parametrize("name, needle", [("eng/bomb.bin", "does not list: bomb.bin"),
                                          ("eng/rank0.onnx.data", f"rank0.onnx.data is {GiB} bytes in the archive")])
def test_a_decompression_bomb_is_refused_from_its_header(tmp_path, packed, name, needle):
    prefix = [(m, d) for m, d in packed if m.name in ("eng", "eng/config.json")]
    gzip_bomb(tmp_path / "bomb.tar.gz", prefix, name, GiB)
    assert (tmp_path / "bomb.tar.gz").stat().st_size < 4 << 20
    took = refused(tmp_path, tmp_path / "bomb.tar.gz", needle)
    assert took < 1.0, f"refusing a 1 GiB member took {took:.2f} s: its data was read"


def test_config_json_comes_first_and_small(tmp_path, packed):
    reordered = [packed[0], *packed[2:], packed[1]]
    write_tar(tmp_path / "late.tar", reordered)
    refused(tmp_path, tmp_path / "late.tar", "its first file is rank0.onnx, not config.json")
    huge = tarfile.TarInfo("eng/config.json")
    huge.size = 64 << 20
    write_tar(tmp_path / "huge.tar", [packed[0], (huge, b"{" + b" " * (huge.size - 2) + b"}")])
    refused(tmp_path, tmp_path / "huge.tar", "its config.json is 67108864 bytes")


def test_a_member_twice_is_refused(tmp_path, packed):
    write_tar(tmp_path / "twice.tar", [*packed, packed[-1]])
    refused(tmp_path, tmp_path / "twice.tar", f"holds {packed[-1][0].name.removeprefix('eng/')} twice")


def test_headers_beyond_the_manifests_account_are_refused(tmp_path, packed):
    """A PAX header of 20 MiB (tarfile reads a PAX header whole into memory) before config.json."""
    fat = tarfile.TarInfo("eng/config.json")
    config = packed[1][1]
    fat.size, fat.pax_headers = len(config), {"comment": "x" * (20 << 20)}
    write_tar(tmp_path / "fat.tar", [packed[0], (fat, config), *packed[2:]])
    refused(tmp_path, tmp_path / "fat.tar", "holds more than its manifest accounts for")
