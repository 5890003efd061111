"""`engine bench`: throughput or latency of an engine on a synthetic or JSON Lines dataset (trtllm-bench's role).

    engine bench --engine-dir ENGINE --mode throughput --num-requests 64 --input-len 128 --output-len 128
    engine bench --engine-dir ENGINE --mode latency --dataset requests.jsonl --report-json report.json

The dataset is made (or read and checked against the engine's limits) before the engine loads, so a bad flag or
line fails fast. The measuring is runtime/benchmark/; this module parses flags, prints the tables (stdout; a
progress bar and warnings on stderr) and writes the report: --report-json FILE atomically, --json to stdout
instead of the tables (cli/json_output.py's document: "command": "bench", "ok", then the report's fields). The
report is BenchReport serialized field by field (core/serde.to_json). --plot FILE draws it (cli/bench_plot.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from engine.core.errors import EngineError

from . import json_output, options
from .bench_plot import check_plot, write_plot
from .progress import progress_bar
from .run import _log_warnings_to

DEFAULT_SYNTHETIC_REQUESTS = 16     # runtime/benchmark/dataset.py's defaults (a test keeps them equal), for the help
DEFAULT_INPUT_LEN = 128


def bench_command(
    engine_dir: Path = typer.Option(..., "--engine-dir", help="Engine directory made by `engine build` (required)."),
    mode: str = typer.Option("throughput", "--mode", help="throughput: submit every request at once, at most "
                             "--concurrency in flight; latency: one request at a time (default: throughput)."),
    dataset: str = typer.Option("synthetic", "--dataset", help="'synthetic' (random token ids of --input-len, "
                                "seeded by --seed) or a JSON Lines file: one {\"prompt\": TEXT | \"input_ids\": "
                                "[IDS], \"output_len\": N} per line (default: synthetic)."),
    num_requests: Optional[int] = typer.Option(None, "--num-requests", help="Requests to measure (default: "
                                               f"{DEFAULT_SYNTHETIC_REQUESTS} synthetic, or every line of the file; "
                                               "with a file, its first N)."),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", help="Requests in flight at most, throughput "
                                              "mode (default: no limit beyond the scheduler's batch size)."),
    input_len: Optional[int] = typer.Option(None, "--input-len", help="Prompt tokens of each synthetic request "
                                            f"(default {DEFAULT_INPUT_LEN}; synthetic dataset only)."),
    output_len: int = typer.Option(128, "--output-len", help="Output tokens of each request; a file's output_len "
                                   "overrides it per line (default 128; generation ignores eos)."),
    warmup: int = typer.Option(2, "--warmup", help="Requests run first and left out of the results (default 2)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic prompts and the warm-up prompts (default 0)."),
    report_json: Optional[Path] = typer.Option(None, "--report-json", help="Write the full report (settings, "
                                               "summary, per-request latencies) to this JSON file (default: none)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Draw the run's latency distributions (TTFT, TPOT and "
                                        "ITL, E2E) and throughputs into this PNG; needs matplotlib (default: none)."),
    as_json: bool = json_output.JSON,
    no_progress: bool = json_output.NO_PROGRESS,
    kv_cache_mem_fraction: float = options.KV_CACHE_MEM_FRACTION,
    max_kv_tokens: Optional[int] = options.MAX_KV_TOKENS,
    threads: Optional[int] = options.THREADS,
    max_num_tokens: Optional[int] = options.MAX_NUM_TOKENS,
    max_batch_size: Optional[int] = options.MAX_BATCH_SIZE,
    prefix_caching: bool = options.PREFIX_CACHING,
    speculative: Optional[str] = options.SPECULATIVE,
    num_speculative_tokens: Optional[int] = options.NUM_SPECULATIVE_TOKENS,
    draft_engine_dir: Optional[Path] = options.DRAFT_ENGINE_DIR,
    prompt_lookup_min: Optional[int] = options.PROMPT_LOOKUP_MIN,
    prompt_lookup_max: Optional[int] = options.PROMPT_LOOKUP_MAX,
):
    """Measure an engine's throughput or latency: tokens/s, TTFT, TPOT, inter-token latency, memory."""
    from engine.runtime import LLM, Tokenizer
    from engine.runtime.benchmark.dataset import check_positive, make_requests
    from engine.runtime.benchmark.runner import BenchConfig, run_benchmark
    from engine.runtime.engine_dir import load_engine_config

    config = BenchConfig(mode=mode, concurrency=concurrency, warmup=warmup, seed=seed)
    speculation = options.speculative_config(speculative, num_speculative_tokens, draft_engine_dir, prompt_lookup_min,
                                             prompt_lookup_max)
    check_positive("--threads", threads)
    if report_json is not None and not report_json.absolute().parent.is_dir():
        raise EngineError(f"--report-json {report_json}: the directory {report_json.absolute().parent} does not "
                          "exist; create it or choose another path", usage=True)
    if plot is not None:
        check_plot(plot)
    requests = make_requests(dataset, load_engine_config(engine_dir), Tokenizer(engine_dir), output_len=output_len,
                             num_requests=num_requests, input_len=input_len, seed=seed)

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    _log_warnings_to(err)
    llm = LLM(engine_dir, kv_cache_mem_fraction=kv_cache_mem_fraction, max_kv_tokens=max_kv_tokens, threads=threads,
              enable_prefix_caching=prefix_caching, max_num_tokens=max_num_tokens, max_batch_size=max_batch_size,
              speculative_config=speculation)
    try:
        with progress_bar(f"{mode} benchmark", len(requests), enabled=not (no_progress or as_json)) as advance:
            report = run_benchmark(llm, requests, config, dataset=dataset, on_request_done=advance)
    finally:
        llm.close()

    _write_report(report, report_json, plot, as_json, err)


def _write_report(report, report_json: Optional[Path], plot: Optional[Path], as_json: bool, err: Console) -> None:
    """The report to the JSON file and the plot where asked, and to stdout as tables, or as JSON with --json."""
    from engine.core.serde import to_json
    document = to_json(report)
    if report_json is not None:
        write_json_atomic(report_json, document)
    if plot is not None:
        write_plot(report, plot)
    if as_json:
        json_output.print_json("bench", document)
    else:
        out = Console(highlight=False)
        out.print(summary_table(report))
        out.print(latency_table(report))
        if report_json is not None:
            err.print(f"report written to {escape(str(report_json))}")
        if plot is not None:
            err.print(f"plot written to {escape(str(plot))}")


def summary_table(report) -> Table:
    s, m, e, c = report.summary, report.memory, report.engine, report.counters
    inflight = report.config.concurrency or f"unlimited (batch <= {e.max_batch_size})"
    table = Table(title=f"engine bench: {report.mode}, {escape(e.engine_dir)} ({e.architecture}, {e.dtype}, "
                        f"{e.backend} {e.backend_version})", title_justify="left", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    rows = [
        ("dataset", escape(report.dataset)),
        ("requests (warm-up)", f"{s.num_requests} ({report.config.warmup})"),
        ("concurrency", str(inflight)),
        ("input / output tokens", f"{s.total_input_tokens} / {s.total_output_tokens}"),
        ("duration", f"{s.duration_s:.2f} s"),
        None,
        ("request throughput", f"{s.request_throughput:.3f} req/s"),
        ("output throughput", f"{s.output_tokens_per_s:.1f} tok/s"),
        ("total throughput (input + output)", f"{s.total_tokens_per_s:.1f} tok/s"),
        ("prefill per request (prompt / TTFT)", _rate(s.prefill_tokens_per_s)),
        ("decode per request (1 / TPOT)", _rate(s.decode_tokens_per_s)),
        None,
        ("peak RSS (process, loading included)", _mib(m.peak_rss_bytes)),
        ("KV cache", f"{_mib(m.kv_cache_bytes)} ({m.kv_cache_tokens} tokens)"),
        *([("peak device memory (torch)", _mib(m.peak_device_bytes))] if m.peak_device_bytes is not None else []),
        ("engine steps / preemptions", f"{c.steps} / {c.preemptions}"),
        ("prefix-cache hit tokens", str(c.prefix_cache_hit_tokens)),
        *([("speculation: drafts / tokens proposed / accepted", f"{sp.num_drafts} / {sp.num_draft_tokens} / "
            f"{sp.num_accepted_tokens}"),
           ("speculation: mean acceptance length, proposer time", f"{sp.mean_acceptance_length:.2f} tokens a step, "
            f"{sp.propose_seconds:.2f} s")] if (sp := c.speculation) is not None else []),
    ]
    for row in rows:
        if row is None:
            table.add_section()
        else:
            table.add_row(*row)
    return table


def latency_table(report) -> Table:
    s = report.summary
    table = Table(title="latency (ms)", title_justify="left", caption="TTFT: submit -> first token (queueing + "
                  "prefill); TPOT: per request, (last - first token) / (tokens - 1); ITL: every gap between "
                  "tokens; E2E: submit -> last token", caption_justify="left")
    table.add_column("", style="bold")
    for col in ("mean", "P50", "P90", "P99", "max"):
        table.add_column(col, justify="right")
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2e_latency_ms)):
        if d is None:
            table.add_row(name, *["-"] * 5)
        else:
            table.add_row(name, *(f"{v:.2f}" for v in (d.mean, d.p50, d.p90, d.p99, d.max)))
    return table


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} tok/s"


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f} MiB"


def write_json_atomic(path: Path, document) -> None:
    """Write `document` to `path` through a temporary sibling and a rename: readers never see half a file."""
    path = Path(path).absolute()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    except OSError as e:
        raise EngineError(f"cannot write --report-json {path}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        mask = os.umask(0)  # mkstemp makes the file 0600; give it what a plain open would
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise EngineError(f"cannot write --report-json {path}: {e.strerror or e}") from None
