"""Running the installed `engine` console script on an engine directory in a subprocess, and checking its errors."""
import os
import subprocess
import sys
from pathlib import Path

ENGINE = [str(Path(sys.executable).parent / "engine")]


def engine_cmd(command: str, engine_dir, *args, check_rc: int = 0) -> subprocess.CompletedProcess:
    """`engine COMMAND --engine-dir DIR --max-kv-tokens 512 ARGS`, asserting its exit status."""
    r = subprocess.run(ENGINE + [command, "--engine-dir", str(engine_dir), "--max-kv-tokens", "512", *args],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "160"})
    assert r.returncode == check_rc, f"rc {r.returncode}\nstdout: {r.stdout}\nstderr: {r.stderr}"
    return r


def assert_one_line_error(r, *needles):
    err = r.stderr.strip()
    assert "Traceback" not in r.stderr and "\n" not in err, r.stderr
    assert err.startswith("error:"), err
    for n in needles:
        assert n in err, err
