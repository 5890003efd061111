"""plugins/native.py: the kernels compile once per source digest into the cache, load into ORT, and a missing or
failing compiler is a one-line EngineError that says how to do without them."""
import onnxruntime as ort
import pytest

from engine.core.errors import EngineError
from engine.plugins import native


def test_compiles_once_into_the_cache_and_registers(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    first = native.library()
    assert first.is_file() and first.is_relative_to(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert native.library() == first and first.stat().st_mtime_ns == mtime   # cached, not compiled again
    # no temporary file left behind: the library and the digest its load checks (native._digest_path)
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name, native._digest_path(first).name]
    native.register(ort.SessionOptions())


def test_a_changed_compiler_is_another_digest(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    assert native._digest("/usr/bin/g++") != native._digest("/usr/bin/clang++")


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(EngineError, match="CXX='no-such-compiler' is not an executable.*--engine-kernels-plugin "
                                          "disable"):
        native.library()


def test_failing_compiler_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(EngineError, match="failed \\(exit 1\\)"):
        native.library()
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
