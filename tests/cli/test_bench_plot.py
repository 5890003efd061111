"""`engine bench --plot FILE`: a PNG of the run's latency distributions and throughputs, and, without matplotlib,
a clean usage error before anything runs."""
import os
import struct
from pathlib import Path

import pytest

from tests.cli.engine_cli import assert_one_line_error, engine_cmd
from tests.runtime.tiny_engine import build_tiny_engine

RUN = ["--num-requests", "4", "--input-len", "12", "--output-len", "5", "--warmup", "0", "--threads", "1"]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    return build_tiny_engine(tmp_path_factory.mktemp("cli_bench_plot"))[1]


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk; fails on anything else."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
    return struct.unpack(">II", head[16:24])


@pytest.mark.parametrize("mode", ["throughput", "latency"])
def test_plot_is_a_png(engine_dir, tmp_path, mode):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "bench.png"
    r = engine_cmd("bench", engine_dir, *RUN, "--mode", mode, "--plot", str(plot))
    assert f"plot written to {plot}" in " ".join(r.stderr.split())
    assert png_size(plot) == (1200, 800)   # 12 x 8 inches at 100 dpi


def test_output_len_one_has_no_tpot_and_still_plots(engine_dir, tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "one.png"
    engine_cmd("bench", engine_dir, *RUN[:4], "--output-len", "1", "--warmup", "0", "--plot", str(plot), "--json")
    assert png_size(plot) == (1200, 800)


def test_without_matplotlib_it_fails_before_running(engine_dir, tmp_path, monkeypatch):
    """A matplotlib that cannot be imported (a module on PYTHONPATH that raises ImportError, as a missing one does):
    exit 2 with one line naming the install command, and neither the run's tables nor its report."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "matplotlib.py").write_text('raise ImportError("No module named \'matplotlib\'")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH")])))
    report, plot = tmp_path / "report.json", tmp_path / "bench.png"
    r = engine_cmd("bench", engine_dir, *RUN, "--report-json", str(report), "--plot", str(plot), check_rc=2)
    assert_one_line_error(r, "--plot needs matplotlib", "pip install matplotlib")
    assert r.stdout == "" and not report.exists() and not plot.exists()


def test_plot_into_a_missing_directory_is_refused(engine_dir, tmp_path):
    pytest.importorskip("matplotlib")
    r = engine_cmd("bench", engine_dir, *RUN, "--plot", str(tmp_path / "none" / "bench.png"), check_rc=2)
    assert_one_line_error(r, "--plot", "does not exist")
