"""Running the installed `engine` console script in a subprocess: on an engine directory, with stderr on a
pseudo-terminal, and checking its errors."""
import os
import pty
import subprocess
import sys
import threading
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


def run_with_terminal_stderr(cmd: list[str], env: dict, timeout: float) -> tuple[subprocess.CompletedProcess, bytes]:
    """Run `cmd` with stdout piped and stderr on a pseudo-terminal (where progress bars show); returns the process
    and everything written to the terminal."""
    master, slave = pty.openpty()
    received = bytearray()

    def drain():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO once the child closed its end
                return
            if not chunk:
                return
            received.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=slave, text=True, env=env, timeout=timeout)
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    return r, bytes(received)
