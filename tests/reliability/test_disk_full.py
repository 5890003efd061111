"""A disk that fills up during `convert` and `build`: a clear one-line error, exit status 1, and no output left
behind (neither the output directory nor its temporary sibling); with --force the previous output survives intact.

Two ways to fill a disk: RLIMIT_FSIZE (every write past the limit fails with EFBIG, as a full disk fails with
ENOSPC; SIGXFSZ is ignored so that the write fails instead of killing the process), in a subprocess
(fsize_driver.py runs every case in one, so the imports are paid once); and, where this process may mount (root),
a real size-limited tmpfs that fails writes with ENOSPC.
Limits are placed so the failure lands at each stage: the first file, inside the weights, one byte short of the
last weight byte, and (build) in the optimized graph's external data after the raw graph was written.
"""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.reliability.conftest import BUILD_FLAGS, ENGINE, gguf_reader_available, no_output, run_cli

pytestmark = pytest.mark.slow   # one subprocess that converts and builds eight times


def _engine(*args: str, limit: int | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "400"}
    return subprocess.run([ENGINE, *args], capture_output=True, text=True, env=env, timeout=300,
                          preexec_fn=None if limit is None else _limit_file_size(limit))


def _limit_file_size(limit: int):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def _assert_disk_full_error(code: int, err: str, out: Path) -> None:
    lines = err.strip().splitlines()
    assert code == 1, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: no space left while writing {out}"), lines[0]
    assert "free disk space" in lines[0] and "nothing was written" in lines[0], lines[0]


def _convert_args(artifacts, source: str, out: Path) -> list[str]:
    src = ["--model-dir", str(artifacts.hf)] if source == "hf" else ["--gguf", str(artifacts.gguf)]
    return ["convert", *src, "--output-dir", str(out)]


CONVERT = ["hf: first file", "hf: inside the weights", "hf: one byte short", "gguf: first file",
           "gguf: inside the weights"]
BUILD = ["first file", "inside the raw graph", "one byte short of the weights", "--force over an engine"]


@pytest.fixture(scope="module")
def full_disk(artifacts, tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """Every case of this module run by fsize_driver in one subprocess: name -> (exit status, stderr, output)."""
    import json
    import shutil
    import sys
    root = tmp_path_factory.mktemp("full_disk")
    rank_size = (artifacts.checkpoint / "rank0.safetensors").stat().st_size
    data_size = (artifacts.engine / "rank0.onnx.data").stat().st_size
    limits = {"first file": 1000, "inside the weights": rank_size // 2, "one byte short": rank_size - 1,
              "inside the raw graph": data_size // 2, "one byte short of the weights": data_size - 1,
              "--force over an engine": 100_000}
    cases = []
    for name in CONVERT:
        source, where = name.split(": ")
        if source == "gguf" and not gguf_reader_available():
            continue
        limit = 100_000 if name == "gguf: inside the weights" else limits[where]
        cases.append((name, limit, _convert_args(artifacts, source, root / name.replace(" ", "_"))))
    for name in BUILD:
        out = root / name.replace(" ", "_").replace("-", "")
        force = []
        if name.startswith("--force"):
            shutil.copytree(artifacts.engine, out)
            force = ["--force"]
        cases.append((name, limits[name], ["build", "--checkpoint-dir", str(artifacts.checkpoint), "--output-dir",
                                           str(out), *BUILD_FLAGS, *force]))
    r = subprocess.run([sys.executable, "-m", "tests.reliability.fsize_driver"], input=json.dumps(cases),
                       capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr
    results = json.loads(r.stdout)
    return {name: (*results[name], Path(args[args.index("--output-dir") + 1])) for name, _, args in cases}


@pytest.mark.parametrize("name", CONVERT)
def test_convert_on_a_full_disk(full_disk, name):
    if name not in full_disk:
        pytest.skip("this transformers has no fast GGUF reader (transformers.integrations.gguf)")
    code, err, out = full_disk[name]
    _assert_disk_full_error(code, err, out)
    assert no_output(out)


@pytest.mark.parametrize("name", BUILD[:-1])
def test_build_on_a_full_disk(full_disk, name):
    code, err, out = full_disk[name]
    _assert_disk_full_error(code, err, out)
    assert no_output(out)


def test_force_keeps_the_old_engine_when_the_disk_fills(artifacts, full_disk):
    code, err, out = full_disk["--force over an engine"]
    _assert_disk_full_error(code, err, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {p.name: p.read_bytes()
                                                                for p in artifacts.engine.iterdir()}
    assert not any(p.name.startswith(f".{out.name}.") for p in out.parent.iterdir())


def test_a_full_temporary_directory_is_one_line_too(artifacts, tmp_path):
    """With every write failing (a disk full before the command starts), the command fails at its first write:
    where torch's import finds no usable temporary directory (a message naming TMPDIR) or, where its import writes
    nothing, at the output. Either way one line, exit status 1, through the CLI's error boundary, no output."""
    out = tmp_path / "out"
    r = _engine(*_convert_args(artifacts, "hf", out), limit=0)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "free disk space" in lines[0], lines[0]
    assert no_output(out)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 300 KiB tmpfs (smaller than the tiny model's weights), mounted for the test and unmounted after it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_convert_and_build_on_a_real_full_filesystem(artifacts, small_tmpfs):
    """ENOSPC from a real filesystem, not a limit: the same message, and the filesystem is left empty."""
    for args in (_convert_args(artifacts, "hf", small_tmpfs / "ckpt"),
                 ["build", "--checkpoint-dir", str(artifacts.checkpoint), "--output-dir", str(small_tmpfs / "engine"),
                  *BUILD_FLAGS]):
        code, err = run_cli(*args)
        _assert_disk_full_error(code, err, Path(args[args.index("--output-dir") + 1]))
        assert "No space left on device" in err
        assert list(small_tmpfs.iterdir()) == []
