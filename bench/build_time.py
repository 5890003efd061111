"""Build-time goal: `engine convert` of SmolLM2-135M-Instruct + `engine build --dtype int8_wo` <= 60 s.

    .venv/bin/python -m bench.build_time [--repeats 3] [--skip-convert]

Each command runs as a fresh process (`python -m engine.cli ...`), as a user meets it. Per run: wall seconds and
the CPU seconds of the child (user + sys, from getrusage(RUSAGE_CHILDREN)), which a loaded machine inflates far
less than wall time. The build runs twice per repeat: with its defaults (accuracy report on 2048 held-out tokens)
and with --eval-tokens 0, so the report's own cost is the difference. Best (minimum) of --repeats for each.
Writes bench/results/build_time.json; the checkpoint and engines go to .cache/bench_build (reused by --skip-convert).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench import real_models

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "bench_build"
RESULTS = ROOT / "bench" / "results" / "build_time.json"
GOAL_S = 60.0


def timed(cmd: list[str], log: Path) -> dict:
    """Run `cmd` to completion; its wall seconds and CPU seconds (user + sys of the child and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc:
        raise SystemExit(f"`{' '.join(cmd)}` failed with exit status {rc}; see {log}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def engine_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "engine.cli", *args]


def best(runs: list[dict]) -> dict:
    return {"wall_s": min(r["wall_s"] for r in runs), "cpu_s": min(r["cpu_s"] for r in runs), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-convert", action="store_true", help="reuse the checkpoint of an earlier run")
    a = ap.parse_args()
    hf_dir = real_models.hf_dir("smollm2")
    CACHE.mkdir(parents=True, exist_ok=True)
    log, ckpt = CACHE / "build.log", CACHE / "ckpt"
    load_before = os.getloadavg()[0]
    convert, full, no_report = [], [], []
    for i in range(a.repeats):
        if not a.skip_convert or not ckpt.is_dir():
            convert.append(timed(engine_cli("convert", "--model-dir", str(hf_dir), "--output-dir", str(ckpt),
                                            "--force"), log))
        build = ["build", "--checkpoint-dir", str(ckpt), "--dtype", "int8_wo", "--force", "--no-progress"]
        full.append(timed(engine_cli(*build, "--output-dir", str(CACHE / "int8")), log))
        no_report.append(timed(engine_cli(*build, "--output-dir", str(CACHE / "int8-noreport"), "--eval-tokens", "0"),
                               log))
        print(f"run {i + 1}: convert {convert[-1] if convert else '-'} build {full[-1]} "
              f"(--eval-tokens 0: {no_report[-1]})", flush=True)
    report = json.loads((CACHE / "int8" / "config.json").read_text())["quantization"]["accuracy"]
    result = {"goal": f"convert + int8_wo build <= {GOAL_S:.0f} s", "model": hf_dir.name,
              "convert": best(convert) if convert else None, "build": best(full),
              "build_without_report": best(no_report), "accuracy_report": report,
              "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if convert:
        total = result["convert"]["wall_s"] + result["build"]["wall_s"]
        result["total_wall_s"] = round(total, 2)
        result["pass"] = total <= GOAL_S
    result["report_cost_wall_s"] = round(result["build"]["wall_s"] - result["build_without_report"]["wall_s"], 2)
    result["report_cost_cpu_s"] = round(result["build"]["cpu_s"] - result["build_without_report"]["cpu_s"], 2)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("convert", "build", "build_without_report")}))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
