"""Manifests: the size and sha256 of every file of an artifact directory, and the digests that chain artifacts.

    source (HF dir | GGUF file)  ──source_digest──▶  checkpoint config.json  manifest {files, source_digest}
    checkpoint config.json       ──sha256─────────▶  engine config.json      manifest {files, source_digest,
                                                                                        checkpoint_digest}
    the engine's digest = sha256 of its config.json

config.json cannot list its own hash, so it lists every *other* file; the sha256 of config.json then covers the
whole directory, and that is an artifact's digest (`sha256sum ENGINE/config.json` gives it too). A GGUF source's
digest is the sha256 of the file itself (comparable with the one a model hub publishes); an HF directory's is the
sha256 of the canonical JSON list of the files conversion read, each with its size and sha256. Digests are
written "sha256:<hex>", the form OCI registries use.

Reading is strict and cheap first: presence and size of every file, then the hashes (sha256 through OpenSSL, which
releases the GIL, so a caller can hash in a thread while it does other work). This module knows nothing of
checkpoints or engines beyond "a directory with config.json".
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import EngineError

CONFIG = "config.json"
PREFIX = "sha256:"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class FileDigest:
    path: str       # relative to the artifact directory, '/'-separated
    size: int       # bytes
    sha256: str     # hex


@dataclass(frozen=True)
class Manifest:
    """Every file of the directory but config.json, sorted by path, and the digests of what it was made from."""
    files: tuple[FileDigest, ...] = ()
    source_digest: str = ""      # the HF directory or GGUF file converted
    checkpoint_digest: str = ""  # engines: the checkpoint built from ("" in a checkpoint)


@dataclass(frozen=True)
class Mismatch:
    """The first way a directory differs from its manifest: `path` and what is wrong with it."""
    path: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest() if hasattr(hashlib, "file_digest") else _chunked(f)


def _chunked(f) -> str:  # Python 3.10 has no hashlib.file_digest
    h = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def digest_file(path: Path) -> str:
    """"sha256:<hex>" of one file (a GGUF source, an artifact's config.json)."""
    return PREFIX + sha256_file(path)


def digest_entries(entries: tuple[FileDigest, ...]) -> str:
    """"sha256:<hex>" of a list of files: the sha256 of its canonical JSON (sorted keys, no spaces)."""
    doc = [{"path": e.path, "size": e.size, "sha256": e.sha256} for e in sorted(entries, key=lambda e: e.path)]
    return PREFIX + hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def describe(root: Path, paths: list[Path]) -> tuple[FileDigest, ...]:
    """Size and sha256 of each of `paths` (files under `root`), sorted by their path relative to `root`."""
    root = Path(root)
    entries = [FileDigest(path=p.relative_to(root).as_posix(), size=p.stat().st_size, sha256=sha256_file(p))
               for p in paths]
    return tuple(sorted(entries, key=lambda e: e.path))


def listed_files(root: Path) -> list[Path]:
    """Every regular file under `root` but its config.json, in a fixed order (sorted, so manifests are stable)."""
    root = Path(root)
    return sorted(p for p in root.rglob("*") if p.is_file() and p != root / CONFIG)


def scan(root: Path) -> tuple[FileDigest, ...]:
    """The manifest entries of a finished artifact directory: every file but config.json."""
    return describe(root, listed_files(root))


def first_mismatch(root: Path, manifest: Manifest, *, contents: bool = True, unlisted: bool = False
                   ) -> Mismatch | None:
    """The first file of `root` that disagrees with `manifest`, or None.

    Order: an empty manifest; then, in manifest order, a missing file or a wrong size (cheap); then `unlisted`
    files present but not in the manifest (when asked); then, with `contents`, a wrong sha256.
    """
    root = Path(root)
    if not manifest.files:
        return Mismatch(CONFIG, "lists no files (no manifest)")
    for entry in manifest.files:
        path = root / entry.path
        if not path.is_file():
            return Mismatch(entry.path, "missing")
        size = path.stat().st_size
        if size != entry.size:
            return Mismatch(entry.path, f"size {size} bytes, the manifest says {entry.size}")
    if unlisted:
        known = {e.path for e in manifest.files}
        for path in listed_files(root):
            rel = path.relative_to(root).as_posix()
            if rel not in known:
                return Mismatch(rel, "not in the manifest")
    if contents:
        for entry in manifest.files:
            got = sha256_file(root / entry.path)
            if got != entry.sha256:
                return Mismatch(entry.path, f"sha256 {got[:16]}..., the manifest says {entry.sha256[:16]}...")
    return None


def check_sizes(root: Path, manifest: Manifest, what: str, fix: str) -> None:
    """Refuse a directory whose files are missing or of the wrong size (no hashing: cheap enough for every load)."""
    mismatch = first_mismatch(root, manifest, contents=False)
    if mismatch is not None:
        raise EngineError(f"{what} {root} does not match its manifest: {mismatch}; {fix}")


def check_contents(root: Path, manifest: Manifest, what: str, fix: str) -> None:
    """Refuse a directory any of whose listed files differ from the manifest (hashes every file)."""
    mismatch = first_mismatch(root, manifest)
    if mismatch is not None:
        raise EngineError(f"{what} {root} does not match its manifest: {mismatch}; {fix}")
