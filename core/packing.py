"""One tar file per artifact directory, so an engine moves between machines (CI artifacts, object stores) intact.

    pack:   DIR/config.json + every file of its manifest ──▶ NAME.tar      members "NAME/config.json", "NAME/...",
            each file hashed while it is copied (one read); a file that no longer matches its manifest fails the pack
    unpack: NAME.tar ──▶ OUTPUT (atomically)   members hashed while they are written; the result must match the
            manifest in its config.json exactly (no file missing, none extra, every sha256), or nothing is left.
            config.json comes first, so each later member is checked against the manifest (listed, its size)
            before its data is read, and the whole read is bounded by the manifest's sizes: a forged or
            compressed-bomb archive costs what its manifest promises, not what the archive holds

The archive is reproducible: members in a fixed order (config.json first, then the manifest's sorted paths),
mtime 0, uid/gid 0, no user names, modes 0644 / 0755, PAX format (files over 8 GiB). The same directory gives the
same bytes, so an archive's sha256 identifies the engine as well as its digest does. Unpacking reads any tar
(also gzip/bz2/xz compressed) but only regular files and directories under one top-level directory; links, devices,
absolute paths and `..` are refused. Works for engines and checkpoints alike: it needs only config.json's manifest.
"""
from __future__ import annotations

import bz2
import gzip
import hashlib
import lzma
import os
import shutil
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from .artifacts import atomic_output_dir
from .errors import EngineError
from .manifest import CONFIG, FileDigest, Manifest
from .serde import from_json, read_json

ARTIFACT_FORMATS = ("engine", "engine-checkpoint")
MAX_CONFIG_BYTES = 16 << 20       # a config.json with its manifest; real ones are kilobytes
MEMBER_OVERHEAD = 8 << 10         # per member: its header and PAX header, as `engine pack` writes them


@dataclass(frozen=True)
class Packed:
    files: int      # files of the manifest (config.json not counted, as in its manifest)
    bytes: int      # their total size
    sha256: str     # hex, of the archive


class _HashingWriter:
    """A write-only file object that hashes what is written through it (the archive's sha256, without a re-read)."""

    def __init__(self, f: BinaryIO):
        self._f, self.hash, self._written = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.hash.update(data)
        self._written += len(data)
        return self._f.write(data)

    def tell(self) -> int:
        return self._written


class _HashingReader:
    """A file object that hashes what is read through it (tarfile copies member data with read())."""

    def __init__(self, f: BinaryIO):
        self._f, self.hash, self.size = f, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.hash.update(data)
        self.size += len(data)
        return data


class _BoundedReader:
    """A file object that refuses to read past `budget` bytes (raised as the caller may set it, once known)."""

    def __init__(self, f: BinaryIO, budget: int, archive: Path):
        self._f, self.budget, self.read_bytes, self._archive = f, budget, 0, archive

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n if n >= 0 else self.budget - self.read_bytes + 1)
        self.read_bytes += len(data)
        if self.read_bytes > self.budget:
            raise EngineError(f"{self._archive} holds more than its manifest accounts for ({self.budget} bytes); "
                              "pass a .tar made by `engine pack`")
        return data


def _open_decompressed(archive: Path) -> BinaryIO:
    """The archive's tar bytes: gzip, bzip2 and xz are undone as they are read (never whole into memory)."""
    with open(archive, "rb") as f:
        magic = f.read(6)
    for prefix, opener in ((b"\x1f\x8b", gzip.open), (b"BZh", bz2.open), (b"\xfd7zXZ\x00", lzma.open)):
        if magic.startswith(prefix):
            return opener(archive, "rb")
    return open(archive, "rb")


def read_manifest(artifact_dir: Path) -> Manifest:
    """The manifest of an engine or checkpoint directory's config.json (its format is not otherwise checked)."""
    path = Path(artifact_dir) / CONFIG
    data = read_json(path)
    if data.get("format") not in ARTIFACT_FORMATS or not isinstance(data.get("manifest"), dict):
        raise EngineError(f"{path} is not the config.json of an engine or checkpoint with a manifest; make it with "
                          "`engine build` or `engine convert` of this version")
    manifest = from_json(Manifest, data["manifest"], where=f"{path}: manifest")
    if not manifest.files:
        raise EngineError(f"{path}: the manifest lists no files; make it again with `engine build`")
    return manifest


def _info(name: str, size: int = 0, directory: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.mode = 0o755 if directory else 0o644
    info.size, info.mtime, info.uid, info.gid, info.uname, info.gname = size, 0, 0, 0, "", ""
    return info


def pack(artifact_dir: Path, output: Path, *, force: bool = False) -> Packed:
    """Write `artifact_dir` into the tar `output` (atomically: a temporary sibling renamed when complete)."""
    artifact_dir, output = Path(artifact_dir), Path(output)
    if not artifact_dir.is_dir():
        raise EngineError(f"{artifact_dir} is not a directory; pass an engine directory made by `engine build`")
    if output.suffix != ".tar":
        raise EngineError(f"--output {output} must end in .tar (compress it afterwards if you like: `engine unpack` "
                          "reads .tar.gz, .tar.xz, ...)", usage=True)
    if output.exists() and not force:
        raise EngineError(f"{output} already exists; pass --force to replace it or choose another --output", usage=True)
    manifest = read_manifest(artifact_dir)
    root = artifact_dir.absolute().name
    dirs = sorted({str(PurePosixPath(root, e.path).parent) for e in manifest.files} - {root})
    output.absolute().parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{output.name}.tmp-", dir=output.absolute().parent)
    total = 0
    try:
        with os.fdopen(fd, "wb") as raw:
            out = _HashingWriter(raw)
            with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
                tar.addfile(_info(root, directory=True))
                config = artifact_dir / CONFIG
                with open(config, "rb") as f:
                    tar.addfile(_info(f"{root}/{CONFIG}", config.stat().st_size), f)
                total += config.stat().st_size
                for d in dirs:
                    tar.addfile(_info(d, directory=True))
                for entry in manifest.files:
                    total += _add_checked(tar, artifact_dir, root, entry)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, output)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):  # a full disk, a read error: one line, like every other output
            raise EngineError(f"cannot write {output}: {e.strerror or e}; nothing was written") from None
        raise
    return Packed(files=len(manifest.files), bytes=total, sha256=out.hash.hexdigest())


def _add_checked(tar: tarfile.TarFile, artifact_dir: Path, root: str, entry: FileDigest) -> int:
    path = artifact_dir / entry.path
    if not path.is_file() or path.stat().st_size != entry.size:
        got = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
        raise EngineError(f"{artifact_dir} does not match its manifest: {entry.path} is {got}, the manifest says "
                          f"{entry.size} bytes; nothing was packed — rebuild it or copy it again")
    with open(path, "rb") as f:
        reader = _HashingReader(f)
        tar.addfile(_info(f"{root}/{entry.path}", entry.size), reader)
    if reader.hash.hexdigest() != entry.sha256:
        raise EngineError(f"{artifact_dir} does not match its manifest: {entry.path} has another sha256; nothing "
                          "was packed — rebuild it or copy it again")
    return entry.size


def _member_path(member: tarfile.TarInfo, archive: Path) -> PurePosixPath:
    name = PurePosixPath(member.name)
    if name.is_absolute() or ".." in name.parts or not name.parts:
        raise EngineError(f"{archive} has a member {member.name!r} outside its directory; refusing to unpack it")
    if not (member.isfile() or member.isdir()):
        raise EngineError(f"{archive} has {member.name!r}, which is not a regular file or directory (a link or "
                          "device); refusing to unpack it")
    return name


def unpack(archive: Path, output_dir: Path, *, force: bool = False) -> Manifest:
    """Extract the artifact in `archive` into `output_dir` (atomically) and check it against its manifest."""
    archive = Path(archive)
    if not archive.is_file():
        raise EngineError(f"--input {archive} is not a file; pass a .tar made by `engine pack`", usage=True)
    raw = _open_decompressed(archive)
    bounded = _BoundedReader(raw, MAX_CONFIG_BYTES + 4 * MEMBER_OVERHEAD, archive)    # until the manifest is read
    try:
        tar = tarfile.open(fileobj=bounded, mode="r|")
    except (tarfile.TarError, OSError, EOFError, lzma.LZMAError) as e:
        raw.close()
        raise EngineError(f"{archive} is not a readable tar file ({e}); pass a .tar made by `engine pack`") from None
    with raw, tar, atomic_output_dir(output_dir, force=force) as tmp:
        hashes: dict[str, tuple[int, str]] = {}
        listed: dict[str, FileDigest] | None = None      # the manifest's files, once config.json is read
        root = None
        try:
            for member in tar:
                name = _member_path(member, archive)
                if root is None:
                    root = name.parts[0]
                if name.parts[0] != root:
                    raise EngineError(f"{archive} holds more than one top-level directory ({root}, {name.parts[0]}); "
                                      "pass a .tar made by `engine pack`")
                rel = PurePosixPath(*name.parts[1:])
                if member.isdir() or not rel.parts:
                    continue
                path = rel.as_posix()
                _check_member(archive, member, path, listed, hashes)
                dest = tmp.joinpath(*rel.parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                with open(dest, "wb") as out:
                    reader = _HashingReader(tar.extractfile(member))
                    shutil.copyfileobj(reader, out, 1 << 20)
                hashes[path] = (reader.size, reader.hash.hexdigest())
                if listed is None:                        # config.json: from now on, read what it promises
                    manifest = read_manifest(tmp)
                    listed = {e.path: e for e in manifest.files}
                    bounded.budget = bounded.read_bytes + sum(e.size for e in manifest.files) + \
                        (2 * len(listed) + 4) * MEMBER_OVERHEAD
        except (tarfile.TarError, EOFError, OSError, lzma.LZMAError) as e:
            raise EngineError(f"{archive} is truncated or corrupt ({e}); copy it again") from None
        if listed is None:
            raise EngineError(f"{archive} has no config.json; pass a .tar made by `engine pack`")
        _check_extracted(archive, manifest, hashes)
    return manifest


def _check_member(archive: Path, member: tarfile.TarInfo, path: str, listed: dict[str, FileDigest] | None,
                  hashes: dict) -> None:
    """Refuse a member before its data is read: config.json first and bounded, then only listed files of their
    manifest size, each once."""
    if listed is None:
        if path != CONFIG:
            raise EngineError(f"{archive}: its first file is {path}, not {CONFIG}; pass a .tar made by `engine pack` "
                              "(config.json first)")
        if member.size > MAX_CONFIG_BYTES:
            raise EngineError(f"{archive}: its {CONFIG} is {member.size} bytes, more than any engine's "
                              f"({MAX_CONFIG_BYTES}); pass a .tar made by `engine pack`")
        return
    entry = listed.get(path)
    if entry is None:
        raise EngineError(f"{archive} has files its manifest does not list: {path}; pass a .tar made by `engine pack`")
    if path in hashes:
        raise EngineError(f"{archive} holds {path} twice; pass a .tar made by `engine pack`")
    if member.size != entry.size:
        raise EngineError(f"{archive}: {path} is {member.size} bytes in the archive, its manifest says {entry.size}; "
                          "copy it again")


def _check_extracted(archive: Path, manifest: Manifest, hashes: dict[str, tuple[int, str]]) -> None:
    """Every listed file is there with its size and sha256 (_check_member refused unlisted ones as they came)."""
    for entry in manifest.files:
        if entry.path not in hashes:
            raise EngineError(f"{archive} lacks {entry.path}, which its manifest lists; copy it again")
        size, sha = hashes[entry.path]
        if (size, sha) != (entry.size, entry.sha256):
            raise EngineError(f"{archive}: {entry.path} does not match its manifest (size {size}, sha256 "
                              f"{sha[:16]}...; expected {entry.size}, {entry.sha256[:16]}...); copy it again")
