"""The report of the side-by-side benchmark on a real-size model (bench/compare_gguf.py's result): each system's
median over the rounds, the engine's builds against llama.cpp and onnxruntime-genai, and the engine's bandwidth
floor. The interface of compare_report: goals(result), goals_table(goals), markdown(result).

A ratio is the median of the per-round ratios, not the ratio of the medians: the two figures of a round were
measured seconds apart, so a round's ratio carries little of the machine's drift (its read bandwidth swings by 2x
within minutes). The floor of a round is the bytes the engine's decode step streams over the bandwidth the probe
read in that round; an engine at 1.0x of it decodes as fast as its weights can be read.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.compare_report import ok

PEER_PREFIXES = ("llamacpp-", "ortgenai-")


def systems(result: dict) -> dict:
    rec = ok(result, "alternating")
    return rec["systems"] if rec else {}


def median_of(turns: list[dict], key: str) -> float:
    return statistics.median(t[key] for t in turns)


def _row(goal: str, ratios: list[float], busy: bool, unit: str = "x") -> dict:
    value = statistics.median(ratios)
    measured = f"{', '.join(f'{x:.2f}' for x in ratios)}; median {value:.2f}{unit}"
    return {"goal": goal, "target": "", "measured": measured, "value": round(value, 3), "result": "", "busy": busy}


def floor_shares(engine: dict, probe: dict) -> list[float]:
    """Per round: the engine's decode tok/s over the round's floor, read_GBps / bytes streamed a step."""
    total = engine["streamed_bytes"]["total"]
    return [e["decode_tok_s"] / (b["read_GBps"] * 1e9 / total) for e, b in zip(engine["turns"], probe["turns"])]


def goals(result: dict) -> list[dict]:
    """Each engine build against each peer (decode, then prefill) and against its bandwidth floor."""
    sys_ = systems(result)
    if not sys_:
        return [{"goal": "every system, alternating", "target": "", "measured": "not measured", "value": None,
                 "result": "not measured", "busy": False}]
    busy = bool(ok(result, "alternating").get("busy"))
    prompt_len = result["settings"]["prompt_len"]
    peers = [n for n in sys_ if n.startswith(PEER_PREFIXES)]
    rows = []
    for e in (n for n in sys_ if n.startswith("engine-")):
        for key, what in (("decode_tok_s", "decode b=1"), ("prefill_tok_s", f"prefill {prompt_len}")):
            for p in peers:
                ratios = [a[key] / b[key] for a, b in zip(sys_[e]["turns"], sys_[p]["turns"])]
                rows.append(_row(f"{what}: {e} / {p}", ratios, busy))
        if "bandwidth" in sys_ and "streamed_bytes" in sys_[e]:
            mb = sys_[e]["streamed_bytes"]["total"] / 1e6
            rows.append(_row(f"decode b=1: {e} / its bandwidth floor ({mb:.0f} MB a step)",
                             floor_shares(sys_[e], sys_["bandwidth"]), busy))
    return rows


def goals_table(gs: list[dict]) -> str:
    lines = ["| comparison | per-round ratios; median |", "|---|---|"]
    lines += [f"| {g['goal']} | {g['measured']}{' (busy machine)' if g['busy'] else ''} |" for g in gs]
    return "\n".join(lines)


def agreement(turns: list[dict], ref: list[dict] | None) -> str:
    """Leading generated tokens equal to the reference's (of the first 16 recorded), in the last round."""
    if not ref or "first_tokens" not in turns[-1]:
        return "–"
    a, b = turns[-1]["first_tokens"], ref[-1]["first_tokens"]
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{n}/{min(len(a), len(b))}"


def systems_table(result: dict) -> str:
    sys_ = systems(result)
    ref = next((s["turns"] for n, s in sys_.items() if n.startswith("llamacpp-")), None)
    lines = ["| system | runs | weights | prefill tok/s | decode tok/s | decode tok/s per round | peak RSS MB | "
             "CPU threads used | first tokens = llama.cpp |", "|---|---|---|---:|---:|---|---:|---:|---:|"]
    for name, s in sys_.items():
        t = s["turns"]
        if name == "bandwidth":
            reads = ", ".join(f"{x['read_GBps']:g}" for x in t)
            lines.append(f"| bandwidth | {s['system']} | {s['variant']} | | | read GB/s: {reads} | | | |")
            continue
        decodes = ", ".join(f"{x['decode_tok_s']:g}" for x in t)
        lines.append(f"| {name} | {s['system']} | {s['variant']} | {median_of(t, 'prefill_tok_s'):.1f} | "
                     f"{median_of(t, 'decode_tok_s'):.2f} | {decodes} | "
                     f"{max(x.get('peak_rss_MB', 0) for x in t)} | {median_of(t, 'cpu_threads_used'):.2f} | "
                     f"{agreement(t, ref)} |")
    return "\n".join(lines)


def missing_rows(result: dict) -> list[str]:
    """The steps that did not run as they should: peers not installed, models not made, failed steps."""
    return [f"- `{r['name']}`: {r['status']} ({r.get('note', '')})" for r in result["records"]
            if r.get("status") != "ok"]


def floor_lines(result: dict) -> list[str]:
    sys_ = systems(result)
    out = []
    for name, s in sys_.items():
        if "streamed_bytes" in s:
            b = s["streamed_bytes"]
            out.append(f"- `{name}`: {b['weights'] / 1e6:.1f} MB of weights (the embedding and rotary tables, "
                       f"{b['gathered_not_streamed'] / 1e6:.1f} MB, are gathered by row, not streamed) + "
                       f"{b['kv'] / 1e6:.1f} MB of KV cache at {b['kv_context']} tokens = "
                       f"**{b['total'] / 1e6:.1f} MB a decode step**.")
    return out


def markdown(result: dict) -> str:
    s, m = result["settings"], result["machine"]
    bw = ok(result, "bandwidth")
    out = [f"# Benchmarks: the engine vs llama.cpp and onnxruntime-genai on {s['model']}", ""]
    if result.get("partial"):
        out += ["> **Partial: the run is still going, or was interrupted; steps not listed did not run.**", ""]
    out += [f"`{s['gguf']}` (`engine download {s['gguf']}`), {s['threads']} threads, batch 1, greedy, prompt "
            f"{s['prompt_len']} tokens ({s['prompt_ids']}), {s['new_tokens']} new tokens; every system a process of "
            f"its own, all taking turns for {s['rounds']} rounds (bench/compare_gguf.py).", "",
            f"Run {result['started']} → {result.get('finished', '?')} ({result.get('wall_s', 0):.0f} s) with "
            f"`{result['command']}`.", "", "## Ratios", "", goals_table(result["goals"]), "",
            "## Systems (medians over the rounds)", "", systems_table(result), ""]
    if bw:
        out += [f"Bandwidth probe alone (2 GiB, {s['threads']} threads, median of 5): read {bw['read_GBps']} GB/s, "
                f"copy {bw['copy_GBps']} GB/s.", ""]
    out += floor_lines(result) + [""]
    missing = missing_rows(result)
    if missing:
        out += ["Not measured:", ""] + missing + [""]
    out += ["## Machine and versions", "",
            f"{m.get('cpu', '?')}, {m.get('logical_cpus')} logical CPUs, {m.get('memory_GiB', '?')} GiB, ISA: "
            f"{m.get('isa', '?')}; Linux {m.get('kernel')}, Python {m.get('python')}.", "",
            "| package | version |", "|---|---|"]
    out += [f"| {k} | {v or 'not installed'} |" for k, v in result["versions"].items()]
    return "\n".join(out) + "\n"


def sections(results_dir: Path) -> str:
    """The reports of every compare_<model>.json in `results_dir`, headings one level down: BENCHMARKS.md's section
    per real-size model, after SmolLM2's report."""
    out = []
    for path in sorted(results_dir.glob("compare_*.json")):
        text = markdown(json.loads(path.read_text()))
        out += [("#" + line if line.startswith("#") else line) for line in text.splitlines()] + [""]
    return "\n".join(out)
