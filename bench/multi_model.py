"""Switching goal (issue #51): a request to a model that is not loaded gets its first token within that engine's
cold start plus 0.5 s.

    .venv/bin/python -m bench.multi_model [--engine NAME=DIR ...] [--repeats 5] [--threads 2]

One `engine serve` holds every engine with --models-max 1, so each request to the other model is a switch: the
loaded one is unloaded (least recently used, idle) and the asked one loaded before its first token. First each
model's first load (which parses its tokenizer; reloads keep it) against its cold start, then the turns.
Each turn, for each model in order: its cold start (bench/startup.py's api run: a fresh process, spawn to the first
token of LLM.stream), then a streamed completion of the same prompt (1 token) to the running server, from the request
to its first content chunk; then a second request to the now loaded model (its warm first token). Turns interleave
the models, so host load falls on both columns alike.
Then the stall: a second server without a cap (--unload-idle-seconds 1) streams from one model while the other
loads; the largest gap between the stream's chunks during that load, against the stream's median gap.
Default engines: SmolLM2's fp32 (.cache/bench/engines/fp32) and Qwen2.5-Coder-0.5B's gguf
(.cache/bench/qwen2.5-coder-0.5b/engines/gguf), made by bench/compare.py.
Writes bench/results/multi_model.json.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from bench.startup import CHILD_ENV, PROMPT, ROOT, run_api

RESULTS = ROOT / "bench" / "results"
DEFAULT_ENGINES = {"smol-fp32": ROOT / ".cache/bench/engines/fp32",
                   "qwen-gguf": ROOT / ".cache/bench/qwen2.5-coder-0.5b/engines/gguf"}
GOAL_S = 0.5


def start_server(engines: dict[str, Path], threads: int, *flags: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--port", str(port), "--threads", str(threads),
           "--log-level", "warning", *flags]
    for name, d in engines.items():
        cmd += ["--engine-dir", f"{name}={d}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=CHILD_ENV, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"`{' '.join(cmd)}` did not become healthy")
        time.sleep(0.1)


def first_token_s(url: str, model: str) -> float:
    """Seconds from sending a streamed 1-token completion to its first content chunk."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                return time.perf_counter() - start
    raise SystemExit(f"no token from {model}")


def statuses(url: str) -> dict[str, str]:
    return {c["id"]: c["status"] for c in httpx.get(url + "/v1/models").json()["data"]}


def summary(runs: list[dict], key: str) -> dict:
    xs = [r[key] for r in runs]
    return {"best": round(min(xs), 3), "median": round(statistics.median(xs), 3)}


def first_loads(engines: dict[str, Path], threads: int, url: str) -> list[dict]:
    """Each model not loaded at start (all but the first): its cold start, then its first switch, which also parses
    its tokenizer (later loads reuse it)."""
    out = []
    for name, d in list(engines.items())[1:]:
        run_api(d, threads)                 # untimed: the engine's files into the file cache
        cold = run_api(d, threads)["first_token_s"]
        out.append({"model": name, "cold_s": cold, "switch_s": round(first_token_s(url, name), 3)})
        print(f"first load: {name}: cold start {cold:.3f} s, switch {out[-1]['switch_s']:.3f} s", flush=True)
    return out


def measure(engines: dict[str, Path], repeats: int, threads: int, url: str) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {n: [] for n in engines}
    for turn in range(repeats):
        for name, d in engines.items():
            api = run_api(d, threads)
            cold = api["first_token_s"]
            assert statuses(url)[name] == "unloaded", statuses(url)
            switch = first_token_s(url, name)
            warm = first_token_s(url, name)
            runs[name].append({"cold_s": cold, "cold_imports_s": api["imports_s"], "switch_s": round(switch, 3),
                               "warm_s": round(warm, 3)})
            print(f"turn {turn}: {name}: cold start {cold:.3f} s, switch {switch:.3f} s, loaded {warm:.3f} s",
                  flush=True)
    return runs


def stall(url: str, streamed: str, loading: str) -> dict:
    """Chunk gaps of a stream from `streamed` while `loading` loads (asked for after the stream's 8th chunk)."""
    deadline = time.monotonic() + 60
    while statuses(url)[loading] != "unloaded":
        assert time.monotonic() < deadline, f"{loading} was never unloaded"
        time.sleep(0.2)
    times, window = [], {}

    def load_other():
        window["start"] = time.perf_counter()
        first_token_s(url, loading)
        window["end"] = time.perf_counter()
    body = {"model": streamed, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    other = threading.Thread(target=load_other)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if len(times) == 8:
                    other.start()
                if "end" in window and times[-1] > window["end"] + 0.5:
                    break
    other.join()
    gaps = [(b - a, a) for a, b in zip(times, times[1:])]
    during = [g for g, at in gaps if window["start"] - 0.5 <= at <= window["end"]]
    return {"streamed": streamed, "loading": loading, "load_s": round(window["end"] - window["start"], 3),
            "max_gap_during_load_s": round(max(during, default=0.0), 3),
            "median_gap_s": round(statistics.median(g for g, _ in gaps), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", action="append", help="NAME=DIR (repeat; default: SmolLM2 fp32 and Qwen gguf)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    engines = dict((n, Path(d)) for n, _, d in (e.partition("=") for e in a.engine)) if a.engine else DEFAULT_ENGINES
    missing = [str(d) for d in engines.values() if not (d / "config.json").is_file()]
    if len(engines) < 2 or missing:
        raise SystemExit(f"need two engines or more; missing {missing}: build them with python -m bench.compare")
    load_before = os.getloadavg()[0]
    proc, url = start_server(engines, a.threads, "--models-max", "1")
    try:
        firsts = first_loads(engines, a.threads, url)
        runs = measure(engines, a.repeats, a.threads, url)
    finally:
        proc.terminate()
        proc.wait(60)
    names = list(engines)
    proc, url = start_server(engines, a.threads, "--unload-idle-seconds", "1", "--pin", names[0])
    try:
        stalls = [dict(stall(url, names[0], other), first_load=i == 0) for i in range(a.repeats) for other in names[1:]]
    finally:
        proc.terminate()
        proc.wait(60)
    result = {"goal": f"first token of a request to an unloaded model <= its cold start + {GOAL_S} s",
              "threads": a.threads, "repeats": a.repeats, "server": "engine serve --models-max 1",
              "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], "models": report(engines, runs),
              "first_loads": firsts, "stall": stalls, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for st in stalls:
        print(f"stream from {st['streamed']} while {st['loading']} {'first ' if st['first_load'] else 're'}loads "
              f"({st['load_s']} s): largest chunk gap "
              f"{st['max_gap_during_load_s']} s, median {st['median_gap_s']} s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "multi_model.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


def report(engines: dict[str, Path], runs: dict[str, list[dict]]) -> list[dict]:
    """Per model: the cold start, switch and loaded first tokens (best, median) and the goal's verdict; a table."""
    records = []
    print(f"\n{'model':<12} {'cold start':>11} {'its imports':>12} {'switch':>8} {'switch-cold':>12} {'loaded':>8}"
          "  (medians, s)")
    for name, rs in runs.items():
        delta = statistics.median(r["switch_s"] - r["cold_s"] for r in rs)
        d = engines[name]
        rec = {"model": name, "engine": str(d.relative_to(ROOT)) if d.is_relative_to(ROOT) else d.name,
               "cold": summary(rs, "cold_s"), "cold_imports": summary(rs, "cold_imports_s"),
               "switch": summary(rs, "switch_s"), "loaded": summary(rs, "warm_s"),
               "switch_minus_cold_median_s": round(delta, 3), "pass": delta <= GOAL_S, "runs": rs}
        records.append(rec)
        print(f"{name:<12} {rec['cold']['median']:>11.3f} {rec['cold_imports']['median']:>12.3f} "
              f"{rec['switch']['median']:>8.3f} {delta:>12.3f} "
              f"{rec['loaded']['median']:>8.3f}")
    return records


if __name__ == "__main__":
    main()
