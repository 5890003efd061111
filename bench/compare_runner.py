"""The steps of the side-by-side benchmark (bench/compare.py): each run, timed and recorded with the load around
it, its measurements in worker processes (bench/compare_measure.py), one at a time or taking turns.

    Runner.step(name, ..., fn)     fn() -> dict is the record; a failure is a row of the report, not the end of the run
    Runner.worker(kind, spec)      one measurement in a fresh process
    Runner.turns(sides)            --rounds rounds in which every side, a process of its own loaded side by side with
                                   the others, measures once in turn
    Runner.coldstart(engine_dir)   process start -> first token, and `engine run` start -> exit

It knows nothing of which models or systems a run compares: compare.py's plans (and compare_gguf.py's) say that.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.compare_models import engine_cli
from bench.startup import CHILD_ENV

ROOT = Path(__file__).resolve().parent.parent
PROMPT_IDS = ROOT / "bench" / "prompt_ids.json"
COLDSTART_TEXT = "What is the capital of France?"
MEASURE = [sys.executable, "-m", "bench.compare_measure"]   # run from the repository root


class Runner:
    """Runs the steps, recording the load around each and collecting the records."""

    def __init__(self, args: argparse.Namespace, save=lambda: None, prompt_ids: Path = PROMPT_IDS):
        self.args = args
        self.records: list[dict] = []
        self.busy_load = args.threads + 0.5
        self.save = save   # called after every step, so an interrupted run still leaves its figures
        self.done: set[str] = set()   # steps a resumed run already has
        self.prompt_ids = prompt_ids

    def keep(self, previous: list[dict]) -> None:
        """A resumed run's records: those that did not fail, less the steps --only names (measured again)."""
        self.records.extend(rec for rec in previous if rec.get("status") in ("ok", "not installed")
                            and not (self.args.only and self.selected(rec["name"])))
        self.done = {rec["name"] for rec in self.records}

    def wanted(self, name: str) -> bool:
        return name not in self.done and self.selected(name)

    def selected(self, name: str) -> bool:
        """Whether --only (when given) names the step and --skip does not."""
        if self.args.only and not any(fnmatch.fnmatch(name, p) for p in self.args.only.split(",") if p):
            return False
        return not self.skipped(name)

    def skipped(self, name: str) -> bool:
        """Whether --skip names the step (or the system)."""
        return any(fnmatch.fnmatch(name, p) for p in (self.args.skip or "").split(",") if p)

    def spec(self, **kw) -> dict:
        a = self.args
        return {"threads": a.threads, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                "repeats": a.repeats, "prompt_ids": str(self.prompt_ids), **kw}

    def step(self, name: str, system: str, variant: str, fn, *, missing: str = "") -> dict | None:
        """Run fn() -> dict as step `name`, or record why it did not run."""
        if not self.wanted(name):
            return None
        rec = {"name": name, "system": system, "variant": variant}
        if missing:
            rec.update(status="not installed", note=missing)
            print(f"-- {name}: not installed ({missing})", flush=True)
            self.records.append(rec)
            self.save()
            return rec
        print(f"-- {name} ...", flush=True)
        before, t0 = os.getloadavg()[0], time.perf_counter()
        try:
            rec.update(fn())
            rec["status"] = "ok"
        except Exception as e:  # one failed measurement is a row of the report, not the end of the run
            rec.update(status="failed", note=str(e)[-400:])
        after = os.getloadavg()[0]
        rec.update(load_before=round(before, 2), load_after=round(after, 2),
                   elapsed_s=round(time.perf_counter() - t0, 1), busy=max(before, after) > self.busy_load)
        self._print(rec)
        self.records.append(rec)
        self.save()
        return rec

    def _print(self, rec: dict) -> None:
        shown = {k: rec[k] for k in ("prefill_tok_s", "decode_tok_s", "total_s", "first_token_s", "read_GBps",
                                     "ratio", "note") if k in rec}
        before, after = rec["load_before"], rec["load_after"]
        print(f"   {rec['status']} {json.dumps(shown)} load {before:.2f} -> {after:.2f} ({rec['elapsed_s']} s)",
              flush=True)
        if rec["busy"]:
            print(f"   WARNING: the machine was busy (1-min load {before:.2f} before, {after:.2f} after, over "
                  f"{self.busy_load}): this figure is noisy", flush=True)

    def _env(self) -> dict:
        return {**os.environ, "OMP_NUM_THREADS": str(self.args.threads)}

    def worker(self, kind: str, spec: dict, env: dict | None = None) -> dict:
        """One measurement in a fresh process (bench/compare_measure.py); its last stdout line is the record."""
        p = subprocess.run([*MEASURE, kind, "--spec", json.dumps(spec)], capture_output=True, text=True, cwd=ROOT,
                           timeout=self.args.step_timeout, env={**self._env(), **(env or {})})
        if p.returncode:
            why = f"signal {-p.returncode}" if p.returncode < 0 else f"exit status {p.returncode}"
            raise RuntimeError(f"{kind} worker failed ({why}): {(p.stderr or p.stdout).strip()[-300:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])

    def alternating(self, a: tuple[str, dict, str], b: tuple[str, dict, str]) -> dict:
        """turns() of two sides, each (kind, spec, figure), keeping only that figure of each turn: the decode goals'
        record. The report takes the median of the per-round ratios."""
        runs = self.turns({"a": a[:2], "b": b[:2]})
        return {"a": [t[a[2]] for t in runs["a"]], "b": [t[b[2]] for t in runs["b"]], "a_key": a[2], "b_key": b[2]}

    def turns(self, sides: dict[str, tuple[str, dict]]) -> dict[str, list[dict]]:
        """--rounds rounds in which each side, (kind, spec), measures once, in order: every side a worker process of
        its own, all loaded and warm side by side and taking turns one run at a time (compare_measure.take_turns),
        so the figures of a round are seconds apart: a ratio of them carries less of this VM's drift (its read
        bandwidth flips between ~40 and ~75 GB/s within a minute, bench/NOTES.md entry 34) than one of steps
        minutes apart. Returns each side's turn records, round by round."""
        procs: dict[str, subprocess.Popen] = {}
        watchdog = threading.Timer(self.args.step_timeout, lambda: [p.kill() for p in procs.values()])
        watchdog.start()
        try:
            for side, (kind, spec) in sides.items():
                procs[side] = subprocess.Popen([*MEASURE, kind, "--spec", json.dumps({**spec, "turns": 1})],
                                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                               text=True, cwd=ROOT, env=self._env())
                self._turn_line(procs[side], kind, "READY")
            out: dict[str, list[dict]] = {side: [] for side in sides}
            for _ in range(self.args.rounds):
                for side, (kind, _) in sides.items():
                    procs[side].stdin.write("go\n")
                    procs[side].stdin.flush()
                    out[side].append(json.loads(self._turn_line(procs[side], kind, "TURN ")[5:]))
            return out
        finally:
            watchdog.cancel()
            for p in procs.values():
                p.kill()
                p.wait()

    def _turn_line(self, p: subprocess.Popen, kind: str, prefix: str) -> str:
        """The worker's next stdout line starting with `prefix` (other output skipped); its stderr if it died."""
        for line in p.stdout:
            if line.startswith(prefix):
                return line.rstrip("\n")
        p.wait()
        raise RuntimeError(f"{kind} worker stopped (exit status {p.returncode}) before its turn: "
                           f"{p.stderr.read().strip()[-300:]}")

    def coldstart(self, engine_dir: Path) -> dict:
        """Spawn -> "FIRST" line of the child (LLM load + first token), and `engine run` start -> exit; one
        warm-up (file cache warm, as on a machine that has run the engine before), then medians."""
        spec = json.dumps(self.spec(engine_dir=str(engine_dir), text=COLDSTART_TEXT))
        env = {**CHILD_ENV, "OMP_NUM_THREADS": str(self.args.threads)}  # startup.py: why no PYTHONDONTWRITEBYTECODE

        def first_token() -> float:
            t0 = time.perf_counter()
            p = subprocess.Popen([*MEASURE, "coldstart-child", "--spec", spec],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
            for line in p.stdout:
                if line.strip() == "FIRST":
                    t = time.perf_counter() - t0
                    p.wait()
                    return t
            p.wait()
            raise RuntimeError(f"cold-start child printed no token: {p.stderr.read().strip()[-300:]}")

        def cli_run() -> float:
            t0 = time.perf_counter()
            subprocess.run(engine_cli("run", "--engine-dir", str(engine_dir), "--input-text", COLDSTART_TEXT,
                                      "--max-output-len", "1", "--threads", str(self.args.threads)),
                           check=True, capture_output=True, cwd=ROOT, env=env)
            return time.perf_counter() - t0

        first_token(), cli_run()
        firsts = [first_token() for _ in range(self.args.repeats)]
        clis = [cli_run() for _ in range(self.args.repeats)]
        return {"first_token_s": round(statistics.median(firsts), 3), "first_token_runs": [round(x, 3) for x in firsts],
                "cli_run_s": round(statistics.median(clis), 3), "cli_run_runs": [round(x, 3) for x in clis]}
