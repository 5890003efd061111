"""Cold-start goal: process start to first generated token <= 1 s (SmolLM2-135M-Instruct engines, 2 threads; the
real-size models' with --model).

    .venv/bin/python -m bench.startup [--model qwen2.5-coder-0.5b] [--engine-dir DIR ...] [--repeats 5] [--profile]

Two ways in, each a fresh process per run, the file cache warm (one untimed run first):
    api      `from engine.runtime import LLM`; LLM(dir); stream one token of the prompt. The child stamps the
             wall clock after the import, after LLM(dir) and at the first token, so the table splits the time
             into interpreter + imports / load / first step (the parent stamps the spawn).
    cli      `engine run --streaming --max-output-len 1`: spawn to the first byte of generated text on stdout,
             and to exit.
Best (minimum) of --repeats and the CPU seconds of the child (user + sys), which load inflates less than wall time.
--profile also writes a cProfile of one api run per engine to bench/results/startup_<name>.prof.
Writes bench/results/startup.json (startup_<model>.json with a --model other than smollm2). Default engines, made by
bench/compare.py: SmolLM2's .cache/bench/engines/{fp32,int8,int4}, a GGUF model's .cache/bench/<model>/engines/
{gguf,int4} (`python -m bench.compare --model <model> --only 'make-engine-*'` makes them).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PROMPT = "What is the capital of France?"
# --model -> the engines timed by default (bench/compare_models.py's variants)
ENGINE_VARIANTS = {"smollm2": ("fp32", "int8", "int4"), "qwen2.5-coder-0.5b": ("gguf", "int4"),
                   "qwen2.5-coder-1.5b": ("gguf", "int4")}
GOAL_S = 1.0


def child(engine_dir: str, threads: int, profile: str | None) -> None:
    """The api measurement, run in a fresh interpreter: prints the wall-clock stamps as JSON, then exits at once."""
    stamps = {}
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    from engine.runtime import LLM, SamplingParams
    stamps["imported"] = time.time()
    llm = LLM(engine_dir, threads=threads)
    stamps["loaded"] = time.time()
    for _ in llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=1)):
        stamps["first_token"] = time.time()
        break
    if profile:
        prof.disable()
        prof.dump_stats(profile)
    print(json.dumps(stamps), flush=True)
    os._exit(0)  # the measurement is over; skip interpreter teardown


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# Children run without PYTHONDONTWRITEBYTECODE (this sandbox sets it): the first run writes the bytecode, as on any
# machine that has run the engine before; otherwise every start compiles the sources (~45 ms).
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def run_api(engine_dir: Path, threads: int, profile: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", str(engine_dir), "--threads", str(threads)]
    if profile:
        cmd += ["--profile-to", profile]
    cpu0, start = cpu_of_children(), time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=CHILD_ENV)
    cpu = cpu_of_children() - cpu0
    if out.returncode:
        raise SystemExit(f"the api child failed:\n{out.stderr[-2000:]}")
    s = json.loads(out.stdout.strip().splitlines()[-1])
    return {"first_token_s": round(s["first_token"] - start, 3), "imports_s": round(s["imported"] - start, 3),
            "load_s": round(s["loaded"] - s["imported"], 3), "first_step_s": round(s["first_token"] - s["loaded"], 3),
            "cpu_s": round(cpu, 3)}


def run_cli(engine_dir: Path, threads: int) -> dict:
    cmd = [sys.executable, "-m", "engine.cli", "run", "--engine-dir", str(engine_dir), "--input-text", PROMPT,
           "--max-output-len", "1", "--streaming", "--threads", str(threads)]
    cpu0, start = cpu_of_children(), time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=CHILD_ENV)
    proc.stdout.read(1)                       # the first byte of generated text
    first = time.perf_counter() - start
    _, err = proc.communicate()
    end = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"`{' '.join(cmd)}` failed:\n{err.decode()[-2000:]}")
    return {"first_token_s": round(first, 3), "exit_s": round(end, 3), "cpu_s": round(cpu_of_children() - cpu0, 3)}


def best(runs: list[dict]) -> dict:
    return {**{k: min(r[k] for r in runs) for k in runs[0]}, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=list(ENGINE_VARIANTS),
                    help="whose engines in bench/compare.py's cache to time when no --engine-dir is given")
    ap.add_argument("--engine-dir", type=Path, action="append")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--profile-to", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.threads, a.profile_to)
        return
    models = ROOT / ".cache" / "bench" / ("" if a.model == "smollm2" else a.model)
    engines = a.engine_dir or [d for d in (models / "engines" / n for n in ENGINE_VARIANTS[a.model]) if d.is_dir()]
    if not engines:
        only = "" if a.model == "smollm2" else f" --model {a.model} --only 'make-engine-*'"
        raise SystemExit(f"no engines: pass --engine-dir, or build them with python -m bench.compare{only}")
    load_before = os.getloadavg()[0]
    records = []
    for engine in engines:
        run_api(engine, a.threads)            # untimed: warms the file cache
        api = best([run_api(engine, a.threads) for _ in range(a.repeats)])
        cli = best([run_cli(engine, a.threads) for _ in range(a.repeats)])
        rec = {"engine": engine.name, "api": api, "cli": cli, "pass": api["first_token_s"] <= GOAL_S}
        if a.profile:
            rec["profile"] = str(RESULTS / f"startup_{engine.name}.prof")
            run_api(engine, a.threads, rec["profile"])
        records.append(rec)
        print(f"{engine.name}: api first token {api['first_token_s']} s (imports {api['imports_s']}, load "
              f"{api['load_s']}, first step {api['first_step_s']}; cpu {api['cpu_s']} s); engine run first token "
              f"{cli['first_token_s']} s, exit {cli['exit_s']} s", flush=True)
    result = {"goal": f"process start to first generated token <= {GOAL_S} s", "threads": a.threads,
              "repeats": a.repeats, "statistic": "minimum over repeats (each field on its own)",
              "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)], "engines": records,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("startup.json" if a.model == "smollm2" else f"startup_{a.model}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
