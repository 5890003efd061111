"""Side-by-side benchmark: the engine against transformers, onnxruntime-genai and llama.cpp on SmolLM2-135M-Instruct
(the default) or on a real-size model, Qwen2.5-Coder 0.5B or 1.5B (--model; bench/compare_gguf.py).

    .venv/bin/python -m bench.compare                       # the full run (prompt 512, 128 new tokens, 3 repeats)
    .venv/bin/python -m bench.compare --prompt-len 64 --new-tokens 16 --repeats 1 --only 'engine-int4,ortgenai-*'
    .venv/bin/python -m bench.compare --report-only         # rewrite BENCHMARKS.md from bench/results/compare.json
    .venv/bin/python -m bench.compare --resume              # finish an interrupted run (its JSON is saved per step)
    .venv/bin/python -m bench.compare --resume --only 'bandwidth,engine-fp32'   # measure those steps again
    .venv/bin/python -m bench.compare --model qwen2.5-coder-1.5b   # -> bench/results/compare_qwen2.5-coder-1.5b.json

Run from the repository root. Everything runs in one go on this machine, with `--threads` (2) intra-op threads
everywhere, greedy, on the same token ids: for SmolLM2 bench/prompt_ids.json, the anchors' (the first 512 tokens of
bench/anchors/prompt.txt under SmolLM2's tokenizer), so the figures compare with the anchor table in
bench/anchors/README.md. Prefill = one forward pass over the prompt; decode = --new-tokens single-token
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

With --model qwen2.5-coder-0.5b or -1.5b the steps are those of bench/compare_gguf.py instead: the engine's gguf
(and int4) build, llama.cpp on the same GGUF, onnxruntime-genai int4 and the bandwidth probe, taking turns.

Peers that are not installed become "not installed" rows. Models are made on first use and cached under
--cache-dir (bench/compare_models.py). os.getloadavg() is recorded before and after every step; a step that ran
while the 1-minute load exceeded threads + 0.5 is flagged busy and warned about. Writes --results (JSON) and
--output (SmolLM2: BENCHMARKS.md: machine, versions, every figure, the goal ratios).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

try:
    from engine.plugins import bf16_matmul
except ModuleNotFoundError:   # before anything is measured or written: outside the venv every step would fail
    raise SystemExit("bench.compare needs the engine installed: run .venv/bin/python -m bench.compare") from None
from bench import compare_gguf, compare_gguf_report, compare_report, real_models
from bench import compare_models as models
from bench.compare_machine import installed, machine, versions
from bench.compare_runner import Runner

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
API_VARIANTS = ("fp32", "int8", "int4")
COLDSTART_VARIANTS = ("fp32", "int8", "int4")
SERVE = {"genai_batch": 8, "input_len": 128, "output_len": 128}   # the serving goal's shape (issue #7)
SERVE_STEPS = {"serve-int4": 1, "serve-int4-interval8": 8}        # step -> engine serve's --stream-interval


def settings(args: argparse.Namespace) -> dict:
    """What a resumed run must share with the run it finishes."""
    s = {"threads": args.threads, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
         "repeats": args.repeats, "rounds": args.rounds, "serve_rounds": args.serve_rounds,
         "serve_streams": args.serve_streams, "busy_load": args.threads + 0.5, "prompt_ids": "bench/prompt_ids.json"}
    if args.model != "smollm2":
        s.update(model=args.model, gguf=real_models.DOWNLOAD_NAMES[args.model], prompt_ids=compare_gguf.PROMPT_NOTE)
    return s


def models_root(args: argparse.Namespace) -> Path:
    """Where the run's models and engines are cached: SmolLM2 in --cache-dir (as always), the others below it."""
    cache = Path(args.cache_dir).resolve()
    return cache if args.model == "smollm2" else cache / args.model


def report_of(result: dict):
    """The report module of a result: SmolLM2's goals, or the GGUF models' ratio tables. Each has goals(result),
    goals_table(goals) and markdown(result)."""
    return compare_report if result["settings"].get("model", "smollm2") == "smollm2" else compare_gguf_report


def run_all(args: argparse.Namespace) -> dict:
    t0 = time.perf_counter()
    result = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(shlex.quote(a) for a in ["python", "-m", "bench.compare", *sys.argv[1:]]),
              "settings": settings(args), "machine": machine(), "versions": versions(), "model": None}
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
    if args.model == "smollm2":
        smollm2_steps(r, args, models_root(args))
    else:
        compare_gguf.steps(r, args, models_root(args))
    write(args, result, t0, partial=False)
    return result


def smollm2_steps(r: Runner, args: argparse.Namespace, cache: Path) -> None:
    """SmolLM2's steps, in the order of the module docstring."""
    r.step("bandwidth", "memory bandwidth", f"2 GiB torch sum / copy, {args.threads} threads",
           lambda: r.worker("bandwidth", r.spec()))

    gguf, hf_dir, no_hf = models.source_models(cache)
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
    no_llama = "" if llama else models.NO_LLAMA
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


def write(args: argparse.Namespace, result: dict, t0: float, *, partial: bool, keep_times: bool = False) -> None:
    """The JSON results and the markdown report, each written atomically; `partial` while steps remain."""
    for variant in models.BUILD_FLAGS:   # the model's shape, for the bandwidth floor
        cfg = models_root(args) / "engines" / variant / "config.json"
        if result["model"] is None and cfg.is_file():
            result["model"] = json.loads(cfg.read_text())["model"]
    if not keep_times:
        result.update(finished=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      wall_s=round(time.perf_counter() - t0, 1))
    result["partial"] = partial
    report = report_of(result)
    result["goals"] = report.goals(result)
    outputs = [(Path(args.results), json.dumps(result, indent=1) + "\n")]
    if args.output:
        text = report.markdown(result)
        if report is compare_report:   # BENCHMARKS.md: SmolLM2's report, then a section per real-size model
            text += "\n" + compare_gguf_report.sections(Path(args.results).parent)
        outputs.append((Path(args.output), text))
    for path, text in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="smollm2", choices=list(real_models.DOWNLOAD_NAMES),
                    help="the model (default smollm2; the others as `engine download` names them: "
                         f"{', '.join(f'{k} = {v}' for k, v in real_models.DOWNLOAD_NAMES.items() if k != 'smollm2')})")
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
    ap.add_argument("--results", help="JSON output (default bench/results/compare.json, for a --model other than "
                                      "smollm2 bench/results/compare_<model>.json)")
    ap.add_argument("--output", help="markdown report ('' for none; default BENCHMARKS.md for smollm2, none for the "
                                     "others, whose tables are printed)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the steps --results already has (those that did not fail and --only does not name) "
                         "and run the rest")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: rewrite --output (and the goals in --results) from --results")
    args = ap.parse_args()
    smollm2 = args.model == "smollm2"
    if args.results is None:
        args.results = str(HERE / "results" / ("compare.json" if smollm2 else f"compare_{args.model}.json"))
    if args.output is None:
        args.output = str(ROOT / "BENCHMARKS.md") if smollm2 else ""
    if args.report_only:
        result = json.loads(Path(args.results).read_text())
        write(args, result, time.perf_counter() - result.get("wall_s", 0), partial=result.get("partial", False),
              keep_times=True)
        print(report_of(result).goals_table(result["goals"]))
        return
    if not 1 <= args.prompt_len <= 512:
        ap.error(f"--prompt-len {args.prompt_len} must be in [1, 512] (the prompts hold 512 tokens)")
    if min(args.new_tokens, args.repeats, args.threads, args.rounds, args.serve_rounds, args.serve_streams) < 1:
        ap.error("--new-tokens, --repeats, --threads, --rounds, --serve-rounds and --serve-streams must be at least 1")
    result = run_all(args)
    print(report_of(result).goals_table(result["goals"]))
    busy = [rec["name"] for rec in result["records"] if rec.get("busy")]
    if busy:
        print(f"WARNING: {len(busy)} of {len(result['records'])} steps ran on a busy machine: {', '.join(busy)}")
    print(f"wrote {args.results}" + (f" and {args.output}" if args.output else "") + f" in {result['wall_s']} s")


if __name__ == "__main__":
    main()
