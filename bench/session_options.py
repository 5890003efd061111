"""ONNX Runtime session options at load: what each costs at load, in memory and per step (cold start and RSS goals).

    .venv/bin/python -m bench.session_options [--engine-dir DIR ...] [--rounds 3] [--variant NAME ...]

Each (engine, variant) runs in a fresh process: EngineSession with the variant's session config entries (added to
the options EngineSession builds, through its load_ort_session), then one 128-token prefill and 32 decode steps
of one sequence (and a batch of 8 x 128 prompt tokens: the arena keeps a step's activations). Per run: session load wall and CPU seconds, RSS after load and after the steps (the weights are
paged in by the first step when ORT maps rather than copies them), prefill and decode wall and CPU seconds. Variants
alternate within each round so a changing load biases none; the table keeps each field's best (minimum) over
rounds. Writes bench/results/session_options.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "session_options.json"
VARIANTS = {
    "default": {},
    "no_prepack": {"session.disable_prepacking": "1"},
    "no_arena": {"enable_cpu_mem_arena": False},       # a SessionOptions attribute, not a config entry
}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(engine_dir: str, variant: str, threads: int) -> dict:
    import numpy as np

    import engine.runtime.session as session_mod
    from engine.runtime.step_inputs import SeqChunk

    entries = VARIANTS[variant]
    load = session_mod.load_ort_session

    def load_with_entries(path, options):
        for key, value in entries.items():
            if key.startswith("session."):
                options.add_session_config_entry(key, value)
            else:
                setattr(options, key, value)
        return load(path, options)

    session_mod.load_ort_session = load_with_entries
    rss0 = rss_mb()
    c0, t0 = time.process_time(), time.perf_counter()
    session = session_mod.EngineSession(engine_dir, num_blocks=64, threads=threads)
    rec = {"load_s": time.perf_counter() - t0, "load_cpu_s": time.process_time() - c0,
           "rss_after_load_MB": rss_mb() - rss0}
    ids = list(range(1000, 1128))
    blocks = list(range(8))
    for rnd in range(2):   # round 0 pages the weights in; round 1 is timed
        c0, t0 = time.process_time(), time.perf_counter()
        tok = int(np.argmax(session.run([SeqChunk(ids, 0, blocks, True)])[0]))
        prefill = (time.perf_counter() - t0, time.process_time() - c0)
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(32):
            tok = int(np.argmax(session.run([SeqChunk([tok], len(ids) + i, blocks, True)])[0]))
        decode = (time.perf_counter() - t0, time.process_time() - c0)
        if rnd == 0:
            rec["first_prefill_s"] = prefill[0]
    rec.update({"prefill128_s": prefill[0], "prefill128_cpu_s": prefill[1], "decode32_s": decode[0],
                "decode32_cpu_s": decode[1], "rss_after_steps_MB": rss_mb() - rss0})
    batch = [SeqChunk(list(range(2000 + 128 * i, 2128 + 128 * i)), 0, list(range(8 + 7 * i, 15 + 7 * i)), True)
             for i in range(8)]
    c0, t0 = time.process_time(), time.perf_counter()
    session.run(batch)
    rec.update({"prefill8x128_s": time.perf_counter() - t0, "prefill8x128_cpu_s": time.process_time() - c0,
                "rss_after_batch_MB": rss_mb() - rss0})
    return {k: round(v, 3) for k, v in rec.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine-dir", type=Path, action="append")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", action="append", choices=list(VARIANTS))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.threads)))
        return
    engines = a.engine_dir or [d for d in (ROOT / ".cache" / "bench" / "engines" / n for n in ("fp32", "int8", "int4"))
                               if d.is_dir()]
    variants = a.variant or list(VARIANTS)
    runs: dict[tuple[str, str], list[dict]] = {}
    load_before = os.getloadavg()[0]
    for _ in range(a.rounds):
        for engine in engines:
            for variant in variants:
                out = subprocess.run([sys.executable, __file__, "--child", str(engine), variant, "--threads",
                                      str(a.threads)], capture_output=True, text=True, cwd=ROOT)
                if out.returncode:
                    raise SystemExit(out.stderr[-2000:])
                runs.setdefault((engine.name, variant), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    records = []
    for (engine, variant), rs in runs.items():
        best = {k: min(r[k] for r in rs) for k in rs[0]}
        records.append({"engine": engine, "variant": variant, "entries": VARIANTS[variant], "best": best, "runs": rs})
        print(engine, variant, best, flush=True)
    RESULTS.write_text(json.dumps({"threads": a.threads, "rounds": a.rounds, "statistic": "minimum over rounds",
                                   "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                                   "records": records, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                                  indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
