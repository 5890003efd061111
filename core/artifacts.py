"""Artifact directories: the checkpoint and engine manifests, their versions, and atomic writes.

Every artifact is a directory with a `config.json` that carries `format` and `format_version`; loaders refuse
what they do not understand with a message that says how to rebuild. Writers build into a hidden temporary
sibling and rename it into place only when complete, so an interrupted run never leaves something that
looks finished.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, TypeVar

from .errors import EngineError
from .manifest import Manifest, check_contents, digest_file, scan
from .model_config import GenerationDefaults, Mapping, ModelConfig, QuantConfig
from .serde import from_json, read_json, write_json

T = TypeVar("T")

CHECKPOINT_FORMAT = "engine-checkpoint"
CHECKPOINT_FORMAT_VERSION = 2  # 2: manifest (size and sha256 of every file, the source's digest); source has no path

# Files copied verbatim from a model directory into checkpoints and engines.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class CheckpointConfig:
    """config.json of a checkpoint directory."""
    model: ModelConfig
    dtype: str
    mapping: Mapping = field(default_factory=Mapping)
    quantization: QuantConfig = field(default_factory=QuantConfig)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    source: dict = field(default_factory=dict)  # what it came from: kind ("hf" | "gguf"), name (no machine paths)
    format: str = CHECKPOINT_FORMAT
    format_version: int = CHECKPOINT_FORMAT_VERSION
    manifest: Manifest = field(default_factory=Manifest)  # written last, when every other file is complete

    @property
    def architecture(self) -> str:
        return self.model.architecture


def rank_file(rank: int) -> str:
    return f"rank{rank}.safetensors"


def check_format(data: dict, path: Path, expected: str, version: int, rebuild: str) -> None:
    if data.get("format") != expected:
        raise EngineError(f"{path} is not an {expected} (format {data.get('format')!r}); {rebuild}")
    if data.get("format_version") != version:
        raise EngineError(f"{path} has {expected} format_version {data.get('format_version')!r}, this engine "
                          f"reads version {version}; {rebuild}")


def load_checkpoint_config(ckpt_dir: Path) -> CheckpointConfig:
    path = Path(ckpt_dir) / "config.json"
    if not Path(ckpt_dir).is_dir():
        raise EngineError(f"checkpoint directory {ckpt_dir} does not exist; create it with `engine convert`")
    try:
        data = read_json(path)
    except EngineError as e:
        raise EngineError(f"{e} — convert the model again with `engine convert`") from None
    check_format(data, path, CHECKPOINT_FORMAT, CHECKPOINT_FORMAT_VERSION,
                 "convert the model again with `engine convert` from this version")
    config = from_json(CheckpointConfig, data, where=str(path))
    m = config.mapping
    if min(m.world_size, m.tp_size, m.pp_size) < 1 or m.world_size != m.tp_size * m.pp_size:
        raise EngineError(f"{path}: mapping {m} is inconsistent; the file is corrupt — convert the model again "
                          "with `engine convert`")
    missing = [rank_file(r) for r in range(m.world_size) if not (Path(ckpt_dir) / rank_file(r)).is_file()]
    if missing:
        raise EngineError(f"checkpoint {ckpt_dir} lacks {', '.join(missing)} of its {m.world_size} ranks; it is "
                          "incomplete — convert the model again with `engine convert`")
    return config


def save_config(out_dir: Path, config) -> None:
    write_json(Path(out_dir) / "config.json", config)


def save_sealed(out_dir: Path, config: T, **digests: str) -> T:
    """Write config.json of a finished artifact with its manifest: every other file of `out_dir` (size, sha256)
    and `digests` (source_digest, checkpoint_digest). Returns the config as written."""
    config = dataclasses.replace(config, manifest=Manifest(files=scan(out_dir), **digests))
    save_config(out_dir, config)
    return config


def verify_checkpoint(ckpt_dir: Path) -> str:
    """Hash every file of a checkpoint against its manifest (EngineError naming the first mismatch); returns the
    checkpoint's digest, the sha256 of its config.json."""
    ckpt_dir = Path(ckpt_dir)
    check_contents(ckpt_dir, load_checkpoint_config(ckpt_dir).manifest, "checkpoint",
                   "the checkpoint was modified or damaged after `engine convert`: convert the model again")
    return digest_file(ckpt_dir / "config.json")


@contextlib.contextmanager
def atomic_output_dir(out_dir: Path, *, force: bool) -> Iterator[Path]:
    """Yield a temporary sibling of `out_dir`; on success it replaces `out_dir`, on any error it is removed.

    An existing `out_dir` is refused unless `force`; with `force` it is replaced only once the new one is complete.
    """
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and not force:
        raise EngineError(f"output directory {out_dir} already exists; pass --force to replace it or choose "
                          "another --output-dir", usage=True)
    if out_dir.exists() and not out_dir.is_dir():
        raise EngineError(f"output path {out_dir} exists and is not a directory; choose another --output-dir",
                          usage=True)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    except OSError as e:
        raise EngineError(f"cannot create output directory next to {out_dir}: {e.strerror}") from None
    try:
        yield tmp
        _apply_umask(tmp)
        if out_dir.exists():
            # two renames, not one: rename() cannot replace a non-empty directory. Between them out_dir is briefly
            # absent, never half-written; if the second fails the old one is put back.
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.rename(out_dir, old)
            try:
                os.rename(tmp, out_dir)
            except OSError:
                os.rename(old, out_dir)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            limit = " — a file size limit (ulimit -f)" if e.errno == errno.EFBIG else ""
            raise EngineError(f"no space left while writing {out_dir} ({e.strerror}{limit}); free disk space or "
                              "choose another --output-dir; nothing was written") from None
        raise EngineError(f"cannot write {out_dir}: {e.strerror or e}; nothing was written") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _apply_umask(root: Path) -> None:
    """Give a finished directory the permissions a plain mkdir/open would have.

    mkdtemp makes the directory 0700 and the safetensors writer creates files 0600; a checkpoint or engine is
    meant to be read by others (a serving account, a shared cache), as the process umask allows.
    """
    mask = os.umask(0)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o777 & ~mask)
        for f in filenames:
            path = os.path.join(dirpath, f)
            os.chmod(path, (os.stat(path).st_mode & 0o777) | (0o666 & ~mask))  # widen only; keep any x bit


def copy_tokenizer_files(src_dir: Path, dst_dir: Path) -> list[str]:
    """Copy the tokenizer files `src_dir` has. Each must parse first (JSON files as objects, tokenizer.json with
    `tokenizers`), so a truncated tokenizer fails the convert or build that would copy it, not the engine's first
    run."""
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(src_dir) / name
        if src.is_file():
            _check_tokenizer_file(src)
            shutil.copyfile(src, Path(dst_dir) / name)
            copied.append(name)
    return copied


def _check_tokenizer_file(path: Path) -> None:
    again = "download the model again (or convert it again)"
    if path.suffix == ".json":
        try:
            read_json(path)
        except EngineError as e:
            raise EngineError(f"{e} — {again}") from None
    if path.name == "tokenizer.json":
        from tokenizers import Tokenizer
        try:
            Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception
            raise EngineError(f"{path} is not a tokenizer `tokenizers` can load ({' '.join(str(e).split())[:200]}); "
                              f"the file is truncated or corrupt — {again}") from None
