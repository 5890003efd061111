"""The compiled kernel library is loaded only when it matches the sha256 its compile wrote beside it: a damaged,
replaced or digest-less library is compiled again, not run. The compiler is faked (a real compile takes ~30 s)."""
from __future__ import annotations

import pytest

from engine.plugins import native


@pytest.fixture
def fake_compile(tmp_path, monkeypatch):
    """ENGINE_CACHE_DIR in tmp_path and a 'compiler' that writes a numbered library; returns the compile count."""
    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "compiler", lambda: "fake-c++")
    monkeypatch.setattr(native, "_compile_objects", lambda cxx, work: [])
    compiles = []

    def run(cxx, args):
        compiles.append(args)
        out = args[args.index("-o") + 1]
        with open(out, "wb") as f:
            f.write(b"\x7fELF library " + str(len(compiles)).encode())
    monkeypatch.setattr(native, "_run", run)
    return compiles


def test_an_intact_library_is_loaded_as_it_is(fake_compile):
    lib = native.library()
    assert lib.with_name(lib.name + ".sha256").read_text().strip() == native._sha256(lib)
    assert native.library() == lib and len(fake_compile) == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "replace", "no_digest"])
def test_a_library_that_does_not_match_its_digest_is_compiled_again(fake_compile, damage, caplog):
    lib = native.library()
    digest = lib.with_name(lib.name + ".sha256")
    data = bytearray(lib.read_bytes())
    if damage == "flip":
        data[3] ^= 0xFF
        lib.write_bytes(bytes(data))
    elif damage == "truncate":
        lib.write_bytes(bytes(data[:5]))
    elif damage == "replace":
        lib.write_bytes(b"\x7fELF something else entirely")
    else:
        digest.unlink()
    assert native.library() == lib and len(fake_compile) == 2
    assert lib.read_bytes() == b"\x7fELF library 2" and digest.read_text().strip() == native._sha256(lib)
    assert "does not match its digest" in caplog.text
