"""`engine bench --plot FILE`: the run's latency distributions and throughputs, drawn into one PNG.

    ┌ TTFT per request (CDF) ─────────┬ TPOT per request (CDF), pooled ITL percentiles ┐
    ├ E2E latency per request (CDF) ──┼ throughputs (tok/s)                            ┤

Each CDF is over the measured requests (BenchReport.requests); its dashed lines are the report's P50 and P99, the
figures of the latency table. ITL is only summarized in the report (its gaps are pooled, not kept per request), so
its P50 / P90 / P99 are drawn over the TPOT curve, the per-request mean of those gaps.

matplotlib is optional (the bench and test extras install it): `check_plot` fails before the engine loads when it
cannot be imported. The figure is drawn on matplotlib's Agg canvas, without pyplot, so no display is needed. This
module knows BenchReport's fields (runtime/benchmark/runner.py) and nothing of the engine.
"""
from __future__ import annotations

from pathlib import Path

from engine.core.errors import EngineError

INSTALL = "pip install matplotlib"


def check_plot(path: Path) -> None:
    """Refuse --plot up front: matplotlib missing (or broken), or a directory that does not exist."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise EngineError(f"--plot needs matplotlib, which cannot be imported ({e}); install it with `{INSTALL}` "
                          "or leave --plot out", usage=True) from None
    if not path.absolute().parent.is_dir():
        raise EngineError(f"--plot {path}: the directory {path.absolute().parent} does not exist; create it or "
                          "choose another path", usage=True)


def write_plot(report, path: Path) -> None:
    """The four panels above, as a PNG at `path` (whatever its suffix)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    s, requests = report.summary, report.requests
    fig = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(fig)
    (ttft, tpot), (e2e, rates) = fig.subplots(2, 2)
    _cdf(ttft, [r.ttft_ms for r in requests], s.ttft_ms, "TTFT: submit -> first token")
    _cdf(tpot, [r.tpot_ms for r in requests if r.tpot_ms is not None], s.tpot_ms,
         "TPOT: (last - first token) / (tokens - 1)")
    if s.itl_ms is not None:
        for q, style in (("p50", ":"), ("p90", "-."), ("p99", (0, (1, 3)))):
            value = getattr(s.itl_ms, q)
            tpot.axvline(value, color="tab:red", linestyle=style, label=f"ITL {q.upper()} {value:.2f} ms")
        tpot.legend(loc="lower right", fontsize="small")
    _cdf(e2e, [r.e2e_ms for r in requests], s.e2e_latency_ms, "E2E: submit -> last token")
    _rates(rates, s)
    fig.suptitle(_plain(_title(report)))
    try:
        fig.savefig(path, format="png", dpi=100, metadata={"Software": None})
    except OSError as e:
        raise EngineError(f"cannot write --plot {path}: {e.strerror or e}") from None


def _cdf(ax, values_ms: list[float], dist, what: str) -> None:
    ax.set_title(f"{what} (ms)", fontsize="medium")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    if not values_ms:
        ax.text(0.5, 0.5, "no request has more than one output token", ha="center", transform=ax.transAxes)
        return
    ax.ecdf(values_ms, color="tab:blue", label=f"{len(values_ms)} requests")
    for q, style in (("p50", "--"), ("p99", (0, (5, 5)))):
        value = getattr(dist, q)
        ax.axvline(value, color="black", linestyle=style, linewidth=1, label=f"{q.upper()} {value:.2f} ms")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")


def _rates(ax, s) -> None:
    rows = [("output (all requests)", s.output_tokens_per_s), ("input + output", s.total_tokens_per_s),
            ("prefill per request\n(prompt / TTFT)", s.prefill_tokens_per_s),
            ("decode per request\n(1 / TPOT)", s.decode_tokens_per_s)]
    rows = [(name, value) for name, value in rows if value is not None]
    bars = ax.barh([name for name, _ in rows], [value for _, value in rows], color="tab:green")
    ax.bar_label(bars, labels=[f"{value:.1f}" for _, value in rows], padding=3)
    ax.invert_yaxis()
    ax.margins(x=0.2)
    ax.set_xlabel("tokens / s")
    ax.set_title(f"throughput: {s.request_throughput:.3f} requests/s over {s.duration_s:.2f} s", fontsize="medium")
    ax.grid(axis="x", alpha=0.3)


def _title(report) -> str:
    e, s = report.engine, report.summary
    inflight = report.config.concurrency or f"unlimited (batch <= {e.max_batch_size})"
    return (f"engine bench: {report.mode}, {Path(e.engine_dir).name} ({e.architecture}, {e.dtype}, {e.backend}); "
            f"{s.num_requests} requests, concurrency {inflight}, {s.total_input_tokens} in / "
            f"{s.total_output_tokens} out tokens")


def _plain(text: str) -> str:
    """matplotlib reads text between two $ as math; a path may hold them."""
    return text.replace("$", r"\$")
