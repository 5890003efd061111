"""Charts of the benchmark results: PNGs beside BENCHMARKS.md, drawn with matplotlib from bench/results/*.json.

    .venv/bin/python -m bench.charts        # from the repository root; matplotlib comes with the bench extra

    benchmarks-compare.png          prefill and decode tok/s of every system, from compare.json (bench/compare.py)
    benchmarks-compare_MODEL.png    the same from each compare_MODEL.json (bench/compare.py --model MODEL), where a
                                    system's figures are its medians over the alternating rounds
    benchmarks-serve.png            output tok/s and TTFT against concurrency, from every serve_NAME.json that
                                    bench/serve_clients.py wrote: one line per engine, prompt and output length

It reads the results files only (no engine, nothing measured), so it redraws in seconds after any benchmark. The
figures are drawn on matplotlib's Agg canvas, without pyplot, and saved without a version stamp, so the same
results give the same files.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def compare_rows(result: dict) -> list[tuple[str, str, float, float]]:
    """(name, system, prefill tok/s, decode tok/s) of every system measured: compare.json's records that carry both
    figures, and compare_MODEL.json's alternating systems (their medians over the rounds)."""
    rows = []
    for rec in result["records"]:
        if rec.get("status") != "ok":
            continue
        if isinstance(rec.get("prefill_tok_s"), (int, float)) and isinstance(rec.get("decode_tok_s"), (int, float)):
            rows.append((rec["name"], rec["system"], rec["prefill_tok_s"], rec["decode_tok_s"]))
        for name, s in rec.get("systems", {}).items():
            turns = [t for t in s.get("turns", []) if "prefill_tok_s" in t and "decode_tok_s" in t]
            if turns:
                rows.append((name, s["system"], statistics.median(t["prefill_tok_s"] for t in turns),
                             statistics.median(t["decode_tok_s"] for t in turns)))
    return rows


def compare_chart(result: dict, model: str, source: str) -> Figure | None:
    """Two panels of horizontal bars, prefill and decode, one bar per system, coloured by what runs it."""
    rows = compare_rows(result)
    if not rows:
        return None
    colours = {}
    for _, system, _, _ in rows:
        colours.setdefault(system, f"C{len(colours) % 10}")
    fig = Figure(figsize=(13, 1.6 + 0.3 * len(rows)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2, sharey=True)
    names = [name for name, _, _, _ in rows]
    for ax, column, what in ((axes[0], 2, "prefill"), (axes[1], 3, "decode")):
        values = [row[column] for row in rows]
        bars = ax.barh(names, values, color=[colours[system] for _, system, _, _ in rows])
        ax.bar_label(bars, labels=[f"{v:.0f}" for v in values], padding=3, fontsize="small")
        ax.set_xlabel(f"{what} tokens / s")
        ax.margins(x=0.15)
        ax.grid(axis="x", alpha=0.3)
    axes[0].invert_yaxis()
    fig.legend(handles=[Patch(color=c, label=_plain(system)) for system, c in colours.items()],
               loc="outside lower center", ncols=min(len(colours), 4), fontsize="small")
    s = result["settings"]
    fig.suptitle(_plain(f"{model}: prefill of {s['prompt_len']} tokens and decode of {s['new_tokens']}, batch 1, "
                        f"{s['threads']} threads ({result.get('started', '')[:10]}, {source}"
                        f"{'; a partial run' if result.get('partial') else ''})"))
    return fig


def serve_points(source: str, result: dict) -> list[dict]:
    """The measured points of one serving result, each {series, concurrency, output_tok_s, [ttft_p50_ms,
    ttft_p99_ms], source}: bench/serve_clients.py's median server run (and its in-process baseline when it ran one),
    and each pair of bench/serve_vs_genai.py, the engine's streams and onnxruntime-genai's batches (medians of the
    rounds). Anything else yields none."""
    c = result.get("config", {})
    lengths = f"{c.get('input_len')} in / {c.get('output_len')} out"
    points = []
    if result.get("server_median") and "concurrency" in c:
        engine = Path(c["engine_dir"]).name if c.get("engine_dir") else c.get("url", "?")
        interval = f", --stream-interval {c['stream_interval']}" if c.get("stream_interval", 1) != 1 else ""
        points.append({**result["server_median"], "series": f"engine serve {engine}{interval}, {lengths}",
                       "concurrency": c["concurrency"]})
        if result.get("baseline_median"):
            points.append({**result["baseline_median"], "series": f"LLM API (no HTTP) {engine}, {lengths}",
                           "concurrency": c["concurrency"]})
    for row in result.get("rows", []) if "streams" in c else []:
        points.append({**_medians(row["engine_runs"]), "series": f"engine serve {Path(row['engine']).name}, {lengths}",
                       "concurrency": c["streams"]})
        points.append({**_medians(row["genai_runs"]), "concurrency": c["genai_batch"],
                       "series": f"onnxruntime-genai {Path(row['genai']).name} (batches), {lengths}"})
    return [{**p, "source": source} for p in points]


def _medians(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}


def serve_chart(points: list[dict]) -> Figure | None:
    """Output tok/s and TTFT P50 (P99 dashed) against the number of requests in flight, a log2 axis: every point
    measured (labelled with its file), a line through each series' median at each concurrency."""
    if not points:
        return None
    fig = Figure(figsize=(13, 5.5), layout="constrained")
    FigureCanvasAgg(fig)
    tput, ttft = fig.subplots(1, 2)
    for i, series in enumerate(sorted({p["series"] for p in points})):
        mine = sorted((p for p in points if p["series"] == series), key=lambda p: p["concurrency"])
        colour = f"C{i % 10}"
        for ax, key, marker, style, suffix in ((tput, "output_tok_s", "o", "-", ""),
                                               (ttft, "ttft_p50_ms", "o", "-", ", P50"),
                                               (ttft, "ttft_p99_ms", "x", "--", ", P99")):
            have = [p for p in mine if key in p]
            if not have:
                continue
            xs = sorted({p["concurrency"] for p in have})
            ax.plot(xs, [statistics.median(p[key] for p in have if p["concurrency"] == x) for x in xs],
                    linestyle=style, color=colour, label=_plain(series + suffix))
            ax.scatter([p["concurrency"] for p in have], [p[key] for p in have], marker=marker, color=colour)
        for p in mine:
            tput.annotate(_plain(p["source"]), (p["concurrency"], p["output_tok_s"]), textcoords="offset points",
                          xytext=(5, -3), fontsize="x-small", color=colour)
    tput.set_ylim(bottom=0)
    ttft.set_yscale("log")   # a loaded machine's TTFT is seconds, a quiet one's tens of ms
    for ax, what in ((tput, "output tokens / s (all requests)"), (ttft, "TTFT ms (the engine's streams)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter("{x:g}")
        ax.margins(x=0.25)
        ax.set_xlabel("requests in flight (concurrent streams, or onnxruntime-genai's batch)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="x-small")
    fig.suptitle("Serving throughput and TTFT against concurrency: /v1/completions streams of random token ids, "
                 "greedy, eos ignored")
    return fig


def _plain(text: str) -> str:
    """matplotlib reads text between two $ as math; a name may hold them."""
    return text.replace("$", r"\$")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=HERE / "results", help="the results folder (bench/results)")
    ap.add_argument("--out-dir", type=Path, default=ROOT, help="where the PNGs go (the repository root, beside "
                                                               "BENCHMARKS.md)")
    args = ap.parse_args()
    charts = {}
    for path in sorted(args.results.glob("compare*.json")):
        model = path.stem.removeprefix("compare").removeprefix("_") or "smollm2"
        charts[f"benchmarks-{path.stem}.png"] = compare_chart(json.loads(path.read_text()), model, path.name)
    serve = [point for p in sorted(args.results.glob("serve_*.json"))
             for point in serve_points(p.name, json.loads(p.read_text()))]
    charts["benchmarks-serve.png"] = serve_chart(serve)
    for name, fig in charts.items():
        if fig is None:
            print(f"{name}: no results to draw")
            continue
        fig.savefig(args.out_dir / name, dpi=100, metadata={"Software": None})
        print(f"wrote {args.out_dir / name}")


if __name__ == "__main__":
    main()
