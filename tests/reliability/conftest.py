"""Shared ground of the fault suite: one tiny model as every artifact (HF dir, GGUF, checkpoint, engine), the CLI
run in-process or in a subprocess, and the checks every fault shares (one-line error, exit status, no output).

docs/reliability.md lists each fault, the test that injects it and what it counted.
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.cli.app import main

ENGINE = str(Path(sys.executable).with_name("engine"))
# The tiny engine's limits: small enough that a burst of requests runs out of KV blocks.
BUILD_FLAGS = ["--max-seq-len", "256", "--max-input-len", "64", "--max-batch-size", "8", "--max-num-tokens", "64",
               "--tokens-per-block", "8"]


@dataclass(frozen=True)
class Artifacts:
    hf: Path          # Hugging Face model directory (safetensors)
    gguf: Path        # the same family written by llama.cpp's rules (Q8_0)
    checkpoint: Path  # `engine convert` of hf
    engine: Path      # `engine build` of checkpoint with BUILD_FLAGS


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Artifacts:
    from tests.tiny_gguf import write_tiny_gguf
    from tests.tiny_models import make_tiny_model
    root = tmp_path_factory.mktemp("reliability")
    hf = make_tiny_model("LlamaForCausalLM", root / "hf")
    gguf = root / "tiny.gguf"
    write_tiny_gguf(gguf, "llama", "Q8_0")
    assert run_cli("convert", "--model-dir", str(hf), "--output-dir", str(root / "ckpt"))[0] == 0
    assert run_cli("build", "--checkpoint-dir", str(root / "ckpt"), "--output-dir", str(root / "engine"),
                   *BUILD_FLAGS)[0] == 0
    return Artifacts(hf, gguf, root / "ckpt", root / "engine")


def run_cli(*args: str) -> tuple[int, str]:
    """`engine ARGS` in this process through the CLI's error boundary: (exit status, stderr). Anything but a
    SystemExit (a raw exception) propagates and fails the test."""
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as e:
        old = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "400"   # one line stays one line
        try:
            main(list(args))
        finally:
            os.environ.pop("COLUMNS") if old is None else os.environ.__setitem__("COLUMNS", old)
    return e.value.code or 0, err.getvalue()


def assert_clean_failure(code: int, err: str, *needles: str, status: int = 1) -> str:
    """The CLI failed the way users are promised: the exit status, one line `error: ...` holding every needle
    and saying what to do, no traceback."""
    lines = err.strip().splitlines()
    assert code == status, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert any(w in lines[0] for w in ("again", "rebuild", "download", "free disk space", "pass ", "install")), \
        f"the message does not say what to do: {lines[0]}"
    return lines[0]


def no_output(out: Path) -> bool:
    """Neither the output directory nor a hidden temporary sibling of it (core/artifacts.atomic_output_dir)."""
    return not out.exists() and not any(p.name.startswith(f".{out.name}.") for p in out.parent.iterdir())


def copy_artifact(src: Path, dst: Path) -> Path:
    if src.is_dir():
        return Path(shutil.copytree(src, dst))
    dst.parent.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(src, dst))


def rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def gguf_reader_available() -> bool:
    try:
        import transformers.integrations.gguf  # noqa: F401
        return True
    except ImportError:
        return False
