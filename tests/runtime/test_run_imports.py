"""`engine run` starts fast because its process imports only what generation needs: not torch, transformers, the
HTTP server stack (fastapi, uvicorn, asyncio), recipes/ or builder/ (cold start is a goal: bench/startup.py)."""
import subprocess
import sys

FORBIDDEN = ("torch", "transformers", "fastapi", "uvicorn", "asyncio", "engine.recipes", "engine.builder")


def test_engine_run_imports_no_build_or_server_code(tiny_engine):
    code = (
        "import sys\n"
        "from engine.cli.app import main\n"
        f"sys.argv = ['engine', 'run', '--engine-dir', {str(tiny_engine[1])!r}, '--input-text', 'hello',\n"
        "            '--max-output-len', '2', '--max-kv-tokens', '64']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r} or m in {FORBIDDEN!r}\n"
        f"             or any(m.startswith(f + '.') for f in {FORBIDDEN!r}))\n"
        "print('LOADED', bad)\n"
        "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    assert "LOADED []" in r.stdout and "Output [Text 0]" in r.stdout


def test_version_constant_is_the_installed_version():
    """engine.core.VERSION (read at every engine load instead of importlib.metadata) is pyproject's version."""
    from importlib.metadata import version
    from engine.core import VERSION
    assert VERSION == version("engine")
