"""`engine serve --ray`'s flags: refused combinations are one-line usage errors (checked before any engine loads),
and `engine serve` without --ray never imports Ray."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.cli.engine_cli import assert_one_line_error, engine_cmd

HAS_RAY = importlib.util.find_spec("ray") is not None


@pytest.mark.parametrize("args, needle", [
    (["--replicas", "2"], "--replicas is a flag of --ray"),
    (["--ray", "--state-dir", "state"], "--state-dir is not supported with --ray"),
    (["--ray", "--min-replicas", "2"], "give both --min-replicas and --max-replicas"),
    (["--ray", "--routing", "random"], "--routing 'random' is not one of prefix, power-of-two"),
])
def test_refused_combinations_are_usage_errors(tmp_path, args, needle):
    if "--ray" in args and not HAS_RAY:
        needle = "--ray needs Ray Serve: pip install 'engine[ray]'"
    assert_one_line_error(engine_cmd("serve", tmp_path / "engine", *args, check_rc=2), needle)


def test_serving_without_ray_imports_no_ray():
    code = ("import sys, engine.cli.app, engine.cli.serve, engine.runtime.server.app, engine.runtime.replicas.config; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
