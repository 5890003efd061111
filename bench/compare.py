"""Side-by-side benchmark: the engine against transformers, onnxruntime-genai and llama.cpp on SmolLM2-135M-Instruct.

    .venv/bin/python bench/compare.py                       # the full run (prompt 512, 128 new tokens, 3 repeats)
    .venv/bin/python bench/compare.py --prompt-len 64 --new-tokens 16 --repeats 1 --only 'engine-int4,ortgenai-*'
    .venv/bin/python bench/compare.py --report-only         # rewrite BENCHMARKS.md from bench/results/compare.json
    .venv/bin/python bench/compare.py --resume              # finish an interrupted run (its JSON is saved per step)
    .venv/bin/python bench/compare.py --resume --only 'bandwidth,engine-fp32'   # measure those steps again

Everything runs in one go on this machine, with `--threads` (2) intra-op threads everywhere, greedy, on the same
token ids: bench/prompt_ids.json, a copy of /work/shared/anchors/prompt_ids.json (the first 512 tokens of
anchors/prompt.txt under SmolLM2's tokenizer), so the figures compare with the anchor table in
/work/shared/anchors/README.md. Prefill = one forward pass over the prompt; decode = --new-tokens single-token
steps after it; median of --repeats runs after a warm-up (see bench/compare_measure.py, which runs each
measurement in a process of its own). Steps, in order (names for --only / --skip, comma-separated globs):

    bandwidth            memory read bandwidth (2 GiB torch sum), for the fp32 decode floor
    build-int8           wall time of `engine convert` (of the HF dir) + `engine build --dtype int8_wo`
    engine-<variant>     the engine session, one run() per step: fp32, int8, int4 (the defaults: lm_head int8,
                         KV float16), -lmbf16 (lm_head bfloat16), -lm32-kv32 (both float32), -lmq (lm_head
                         quantized too, as onnxruntime-genai does, KV float32), -kv16 / -kv8 (KV float16 / int8)
    hf-fp32, hf-bf16     transformers generate (sdpa)
    ortgenai-<p>         onnxruntime-genai 0.18 Generator, int4 / int8 / fp32 from its model builder
    llamacpp-<gguf>      llama-cpp-python when installed (LLAMA_CPP_LIB_PATH is honoured, as in the anchors),
                         the shipped Q4_1 GGUF, a Q8_0 of it made by llama.cpp's quantizer, and any --gguf given
    alternating-<goal>   the decode goals again as --rounds turns of two processes loaded side by side, one run
                         each a turn (engine-int4 / ortgenai-int4, engine-int8 / ortgenai-int8, engine-fp32 /
                         bandwidth): the goals take the median of the per-round ratios, which carries less of the
                         VM's drift than two steps minutes apart
    serve-int4           --serve-streams (32) concurrent streams through `engine serve` (engine-int4) against
                         onnxruntime-genai int4 in batches of 8, 128 tokens in and out, one untimed round each
                         then --serve-rounds (3) rounds, and the server's memory after them
                         (bench/serve_vs_genai.py, bench/serve_memory.py)
    serve-int4-interval8 the same with `engine serve --stream-interval 8` (an SSE chunk every 8 tokens: fewer
                         socket writes and client wake-ups, which share the 2 cores with the engine)
    engine-api-<variant> the Python API (LLM.generate), timed like transformers' generate: fp32, int8, int4
    coldstart-<variant>  process start -> first generated token through LLM.stream, and `engine run` start to exit

Peers that are not installed become "not installed" rows. Models are made on first use and cached under
--cache-dir (bench/compare_models.py). os.getloadavg() is recorded before and after every step; a step that ran
while the 1-minute load exceeded threads + 0.5 is flagged busy and warned about. Writes --results (JSON) and
--output (BENCHMARKS.md: machine, versions, every figure, the goal ratios).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

try:
    from engine.plugins import bf16_matmul
except ModuleNotFoundError:   # before anything is measured or written: outside the venv every step would fail
    raise SystemExit("bench/compare.py needs the engine installed: run .venv/bin/python bench/compare.py") from None
import compare_models as models  # noqa: E402
from compare_machine import installed, machine, versions  # noqa: E402
import compare_report as report  # noqa: E402
from startup import CHILD_ENV  # noqa: E402

ROOT = HERE.parent
PROMPT_IDS = HERE / "prompt_ids.json"
API_VARIANTS = ("fp32", "int8", "int4")
COLDSTART_VARIANTS = ("fp32", "int8", "int4")
COLDSTART_TEXT = "What is the capital of France?"
SERVE = {"genai_batch": 8, "input_len": 128, "output_len": 128}   # the serving goal's shape (issue #7)
SERVE_STEPS = {"serve-int4": 1, "serve-int4-interval8": 8}        # step -> engine serve's --stream-interval
class Runner:
    """Runs the steps, recording the load around each and collecting the records."""

    def __init__(self, args: argparse.Namespace, save=lambda: None):
        self.args = args
        self.records: list[dict] = []
        self.busy_load = args.threads + 0.5
        self.save = save   # called after every step, so an interrupted run still leaves its figures
        self.done: set[str] = set()   # steps a resumed run already has

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
        return not any(fnmatch.fnmatch(name, p) for p in (self.args.skip or "").split(",") if p)

    def spec(self, **kw) -> dict:
        a = self.args
        return {"threads": a.threads, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                "repeats": a.repeats, "prompt_ids": str(PROMPT_IDS), **kw}

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
        rec.update(load_before=round(before, 2), load_after=round(after, 2), elapsed_s=round(time.perf_counter() - t0, 1),
                   busy=max(before, after) > self.busy_load)
        shown = {k: rec[k] for k in ("prefill_tok_s", "decode_tok_s", "total_s", "first_token_s", "read_GBps",
                                     "ratio", "note") if k in rec}
        print(f"   {rec['status']} {json.dumps(shown)} load {before:.2f} -> {after:.2f} ({rec['elapsed_s']} s)",
              flush=True)
        if rec["busy"]:
            print(f"   WARNING: the machine was busy (1-min load {before:.2f} before, {after:.2f} after, over "
                  f"{self.busy_load}): this figure is noisy", flush=True)
        self.records.append(rec)
        self.save()
        return rec

    def worker(self, kind: str, spec: dict, env: dict | None = None) -> dict:
        """One measurement in a fresh process (bench/compare_measure.py); its last stdout line is the record."""
        cmd = [sys.executable, str(HERE / "compare_measure.py"), kind, "--spec", json.dumps(spec)]
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=self.args.step_timeout,
                           env={**os.environ, "OMP_NUM_THREADS": str(self.args.threads), **(env or {})})
        if p.returncode:
            why = f"signal {-p.returncode}" if p.returncode < 0 else f"exit status {p.returncode}"
            raise RuntimeError(f"{kind} worker failed ({why}): {(p.stderr or p.stdout).strip()[-300:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])

    def alternating(self, a: tuple[str, dict, str], b: tuple[str, dict, str]) -> dict:
        """--rounds rounds of worker a then worker b, each (kind, spec, figure): both processes loaded and warm side
        by side, taking turns one run at a time (compare_measure.take_turns), so the two figures of a round are
        seconds apart: a ratio of them carries less of this VM's drift (its read bandwidth flips between ~40 and
        ~75 GB/s within a minute, bench/NOTES.md entry 34) than one of steps minutes apart. The report takes the
        median of the per-round ratios."""
        env = {**os.environ, "OMP_NUM_THREADS": str(self.args.threads)}
        procs: dict[str, subprocess.Popen] = {}
        watchdog = threading.Timer(self.args.step_timeout, lambda: [p.kill() for p in procs.values()])
        watchdog.start()
        try:
            for side, (kind, spec, _) in (("a", a), ("b", b)):
                cmd = [sys.executable, str(HERE / "compare_measure.py"), kind,
                       "--spec", json.dumps({**spec, "turns": 1})]
                procs[side] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
                self._turn_line(procs[side], kind, "READY")
            out = {"a": [], "b": [], "a_key": a[2], "b_key": b[2]}
            for _ in range(self.args.rounds):
                for side, (kind, _, key) in (("a", a), ("b", b)):
                    procs[side].stdin.write("go\n")
                    procs[side].stdin.flush()
                    out[side].append(json.loads(self._turn_line(procs[side], kind, "TURN ")[5:])[key])
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
            p = subprocess.Popen([sys.executable, str(HERE / "compare_measure.py"), "coldstart-child", "--spec", spec],
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
            subprocess.run(models.engine_cli("run", "--engine-dir", str(engine_dir), "--input-text", COLDSTART_TEXT,
                                             "--max-output-len", "1", "--threads", str(self.args.threads)),
                           check=True, capture_output=True, cwd=ROOT, env=env)
            return time.perf_counter() - t0

        first_token(), cli_run()
        firsts = [first_token() for _ in range(self.args.repeats)]
        clis = [cli_run() for _ in range(self.args.repeats)]
        return {"first_token_s": round(statistics.median(firsts), 3), "first_token_runs": [round(x, 3) for x in firsts],
                "cli_run_s": round(statistics.median(clis), 3), "cli_run_runs": [round(x, 3) for x in clis]}


def run_all(args: argparse.Namespace) -> dict:
    cache = Path(args.cache_dir).resolve()
    t0 = time.perf_counter()
    result = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
              "settings": {"threads": args.threads, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                           "repeats": args.repeats, "rounds": args.rounds, "serve_rounds": args.serve_rounds,
                           "serve_streams": args.serve_streams, "busy_load": args.threads + 0.5,
                           "prompt_ids": "bench/prompt_ids.json"},
              "machine": machine(), "versions": versions(), "model": None}
    r = Runner(args, save=lambda: write(args, result, t0, partial=True))
    if args.resume and Path(args.results).is_file():
        previous = json.loads(Path(args.results).read_text())
        if previous["settings"] != result["settings"]:
            raise SystemExit(f"--resume: {args.results} was measured with {previous['settings']}, not "
                             f"{result['settings']}; give the same settings or drop --resume")
        r.keep(previous["records"])
        result.update(started=previous["started"], command=f"{previous['command']}; then {result['command']}")
        t0 -= previous.get("wall_s", 0)
        print(f"resuming {args.results}: {len(r.done)} steps already done", flush=True)
    result["records"] = r.records
    r.step("bandwidth", "memory bandwidth", f"2 GiB torch sum / copy, {args.threads} threads",
           lambda: r.worker("bandwidth", r.spec()))

    gguf, hf_dir, no_hf = models.source_models()
    source = hf_dir or gguf   # the engine's source: a plain HF checkpoint, as most users have
    r.step("build-int8", "engine build", f"convert {'--model-dir' if hf_dir else '--gguf'} {source.name} + "
           "build --dtype int8_wo", lambda: models.timed_convert_build(cache, source))

    build_opts = {"rebuild": args.rebuild, "keep": args.keep_engines}

    def engine(variant: str):
        return lambda: r.worker("engine", r.spec(engine_dir=str(
            models.ensure_engine(cache, source, variant, **build_opts))))

    no_bf16 = "" if bf16_matmul.supported(bf16_matmul.CHUNK) else (
        "this CPU has no AVX-512 BF16 dot products, which the bfloat16 lm_head's kernel is written for")
    for variant, (flags, weights) in models.ENGINE_VARIANTS.items():
        r.step(f"engine-{variant}", "engine (session step)", weights, engine(variant),
               missing=no_bf16 if "bfloat16" in flags else "")

    no_tf = "" if installed("transformers") else "transformers is not installed"
    for dtype in ("fp32", "bf16"):
        r.step(f"hf-{dtype}", "transformers (generate, sdpa)", dtype,
               lambda d=dtype: r.worker("hf", r.spec(hf_dir=str(hf_dir), dtype=d)), missing=no_tf or no_hf)

    og = installed("onnxruntime_genai")
    no_og = "" if og else "onnxruntime-genai is not installed (pip install -e '.[bench]')"
    for p in models.ORTGENAI_PRECISIONS:
        r.step(f"ortgenai-{p}", f"onnxruntime-genai {og}".strip(), p,
               lambda p=p: r.worker("ortgenai", r.spec(model_dir=str(models.ensure_ortgenai(cache, hf_dir, p, og)))),
               missing=no_og or no_hf)

    llama = installed("llama_cpp")
    no_llama = "" if llama else "llama-cpp-python is not installed (see /work/shared/DESIGN.md: build it without AMX)"
    # the shipped Q4_1 (its tied embedding, the lm_head, is Q8_0 in the file) and the same weights in Q8_0
    for g in [gguf, models.llamacpp_q8_0(cache, gguf), *(Path(x) for x in args.gguf)]:
        r.step(f"llamacpp-{g.stem}", f"llama.cpp (llama-cpp-python {llama})".replace(" )", ")"), g.name,
               lambda g=g: r.worker("llamacpp", r.spec(gguf=str(models.ensure_gguf(cache, gguf, g)))),
               missing=no_llama)

    # The decode goals once more as alternating processes, engine then peer (bandwidth for the fp32 floor).
    def engine_side(variant: str) -> tuple[str, dict, str]:
        return "engine", r.spec(engine_dir=str(models.ensure_engine(cache, source, variant, **build_opts))), \
            "decode_tok_s"
    for bits in ("int4", "int8"):
        r.step(f"alternating-{bits}", "engine vs onnxruntime-genai, alternating processes",
               f"engine-{bits} / ortgenai-{bits}, {args.rounds} rounds",
               lambda b=bits: r.alternating(engine_side(b), ("ortgenai", r.spec(model_dir=str(
                   models.ensure_ortgenai(cache, hf_dir, b, og))), "decode_tok_s")), missing=no_og or no_hf)
    r.step("alternating-fp32-floor", "engine vs memory bandwidth, alternating processes",
           f"engine-fp32 / bandwidth, {args.rounds} rounds",
           lambda: r.alternating(engine_side("fp32"), ("bandwidth", r.spec(), "read_GBps")))

    for name, interval in SERVE_STEPS.items():
        r.step(name, "engine serve vs onnxruntime-genai",
               f"engine-int4 (--stream-interval {interval}), {args.serve_streams} streams / ortgenai-int4, batch "
               f"{SERVE['genai_batch']}; {SERVE['input_len']} in, {SERVE['output_len']} out, {args.serve_rounds} rounds",
               lambda i=interval: r.worker("serve", {
                   "threads": args.threads, **SERVE, "streams": args.serve_streams, "rounds": args.serve_rounds,
                   "stream_interval": i, "engine_dir": str(models.ensure_engine(cache, source, "int4", **build_opts)),
                   "model_dir": str(models.ensure_ortgenai(cache, hf_dir, "int4", og))}),
               missing=no_og or no_hf)

    # The engine's secondary measurements come after the peers, so engines and peers run close together in time.
    for variant in API_VARIANTS:
        r.step(f"engine-api-{variant}", "engine (LLM.generate)", models.ENGINE_VARIANTS[variant][1],
               lambda v=variant: r.worker("engine-api", r.spec(engine_dir=str(
                   models.ensure_engine(cache, source, v, **build_opts)))))
    for variant in COLDSTART_VARIANTS:
        r.step(f"coldstart-{variant}", "engine cold start", models.ENGINE_VARIANTS[variant][1],
               lambda v=variant: r.coldstart(models.ensure_engine(cache, source, v, **build_opts)))

    write(args, result, t0, partial=False)
    return result


def write(args: argparse.Namespace, result: dict, t0: float, *, partial: bool, keep_times: bool = False) -> None:
    """The JSON results and the markdown report, each written atomically; `partial` while steps remain."""
    cache = Path(args.cache_dir).resolve()
    for variant in models.ENGINE_VARIANTS:   # the model's shape, for the bandwidth floor
        cfg = cache / "engines" / variant / "config.json"
        if result["model"] is None and cfg.is_file():
            result["model"] = json.loads(cfg.read_text())["model"]
    if not keep_times:
        result.update(finished=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      wall_s=round(time.perf_counter() - t0, 1))
    result["partial"] = partial
    result["goals"] = report.goals(result)
    outputs = [(Path(args.results), json.dumps(result, indent=1) + "\n")]
    if args.output:
        outputs.append((Path(args.output), report.markdown(result)))
    for path, text in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of every system (default 2)")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens, at most 512 (default 512)")
    ap.add_argument("--new-tokens", type=int, default=128, help="decode steps timed (default 128)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up; medians (default 3)")
    ap.add_argument("--rounds", type=int, default=7,
                    help="alternating engine / peer turns of the decode goals (default 7)")
    ap.add_argument("--serve-rounds", type=int, default=3,
                    help="timed rounds of the serving goal after its warm-up round (default 3)")
    ap.add_argument("--serve-streams", type=int, default=32, help="concurrent streams of the serving goal (32)")
    ap.add_argument("--only", help="comma-separated globs of step names to run (default: all)")
    ap.add_argument("--skip", help="comma-separated globs of step names to leave out")
    ap.add_argument("--gguf", action="append", default=[], help="another GGUF for llama.cpp (repeatable)")
    ap.add_argument("--cache-dir", default=str(ROOT / ".cache" / "bench"), help="models and engines (default .cache/bench)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the checkpoint and every engine used")
    ap.add_argument("--keep-engines", action="store_true",
                    help="use cached engines that load even when toolchain sources are newer (default: rebuild them)")
    ap.add_argument("--step-timeout", type=float, default=1800, help="seconds before a measurement is abandoned")
    ap.add_argument("--results", default=str(HERE / "results" / "compare.json"), help="JSON output")
    ap.add_argument("--output", default=str(ROOT / "BENCHMARKS.md"), help="markdown report ('' for none)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the steps --results already has (those that did not fail and --only does not name) "
                         "and run the rest")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: rewrite --output (and the goals in --results) from --results")
    args = ap.parse_args()
    if args.report_only:
        result = json.loads(Path(args.results).read_text())
        write(args, result, time.perf_counter() - result.get("wall_s", 0), partial=result.get("partial", False),
              keep_times=True)
        print(report.goals_table(result["goals"]))
        return
    if not 1 <= args.prompt_len <= 512:
        ap.error(f"--prompt-len {args.prompt_len} must be in [1, 512] (bench/prompt_ids.json holds 512 tokens)")
    if min(args.new_tokens, args.repeats, args.threads, args.rounds, args.serve_rounds, args.serve_streams) < 1:
        ap.error("--new-tokens, --repeats, --threads, --rounds, --serve-rounds and --serve-streams must be at least 1")
    result = run_all(args)
    print(report.goals_table(result["goals"]))
    busy = [rec["name"] for rec in result["records"] if rec.get("busy")]
    if busy:
        print(f"WARNING: {len(busy)} of {len(result['records'])} steps ran on a busy machine: {', '.join(busy)}")
    print(f"wrote {args.results}" + (f" and {args.output}" if args.output else "") + f" in {result['wall_s']} s")


if __name__ == "__main__":
    main()
