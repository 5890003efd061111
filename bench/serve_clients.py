"""Serving benchmark: N concurrent streaming clients against `engine serve` (vLLM's `bench serve`, random dataset).

    .venv/bin/python -m bench.serve_clients --engine-dir .cache/engines/smollm2 [--concurrency 8] [--num-prompts 32]
        [--input-len 128] [--output-len 64] [--repeats 3] [--stream-interval 1]
    .venv/bin/python -m bench.serve_clients --url http://127.0.0.1:8000 --model NAME ...   (a server already running)

Each request is a /v1/completions stream of `input-len` random token ids with ignore_eos and max_tokens
`output-len`, so every run does the same work. Per request: TTFT (send -> first token), TPOT ((e2e - TTFT) /
(output tokens - 1)), and the inter-token latencies (gaps between token chunks); per run: output tokens per
second over the wall time. With --engine-dir the script starts `engine serve` itself (127.0.0.1, a free port)
and, as a baseline in the same script, runs the same prompts through the in-process async LLM API at the same
concurrency (no HTTP), so the table shows what the server costs. Each repeat uses fresh random prompts (the server's
prefix cache persists across repeats) and runs server then baseline (--no-baseline: server only). Medians over
--repeats runs. With --engine-dir, the server's memory after the runs is checked against the serving-memory goal
(RSS <= weights + KV pool + 300 MB; bench/serve_memory.py). --stream-interval N is passed to `engine serve` (and
the baseline's LLM): a chunk every N tokens, so ITL is then the gap between chunks of N tokens. Writes
bench/results/serve_<name>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np


async def one_request(session: aiohttp.ClientSession, model: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, usage = [], None
    async with session.post("/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:    # one SSE line at a time
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    n_out = usage["completion_tokens"]
    ttft = stamps[0] - start
    return {"ttft": ttft, "e2e": end - start, "output_tokens": n_out,
            "tpot": (end - start - ttft) / (n_out - 1) if n_out > 1 else None,
            "itl": list(np.diff(stamps))}


async def run_clients(url: str, model: str, prompts: list[list[int]], output_len: int, concurrency: int) -> dict:
    """The clients are aiohttp's, as in vLLM's serving benchmark: on a 2-core machine the client shares the CPUs
    with the server, and httpx's streaming took 0.37-0.41 CPU s of a 32 x 128 round against aiohttp's 0.14-0.16
    (bench/NOTES.md entry 44)."""
    sem = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    async with aiohttp.ClientSession(base_url=url, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def bounded(p):
            async with sem:
                return await one_request(session, model, p, output_len)
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - start
    return summarize(results, wall)


def summarize(results: list[dict], wall: float) -> dict:
    def pct(xs, q):
        return float(np.percentile(xs, q)) * 1000 if xs else None
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    itl = [g for r in results for g in r["itl"]]
    out = sum(r["output_tokens"] for r in results)
    return {"wall_s": wall, "output_tokens": out, "output_tok_s": out / wall, "requests_s": len(results) / wall,
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "tpot_p50_ms": pct(tpot, 50),
            "tpot_p99_ms": pct(tpot, 99), "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99)}


def baseline(engine_dir: Path, prompts, output_len: int, concurrency: int, max_kv_tokens: int,
             threads: int | None, stream_interval: int = 1) -> dict:
    """The same prompts at the same concurrency through the in-process async LLM API: the server minus HTTP."""
    from engine.runtime import LLM, SamplingParams
    llm = LLM(engine_dir, max_kv_tokens=max_kv_tokens, threads=threads, stream_interval=stream_interval)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([[100] * 8], SamplingParams(temperature=0, max_tokens=2))      # warm-up, cache-neutral

    async def run():
        sem = asyncio.Semaphore(concurrency)

        async def one(p):
            async with sem:
                start, stamps = time.perf_counter(), []
                async for out in llm.generate_async(p, params):
                    if out.delta_text:
                        stamps.append(time.perf_counter())
                end = time.perf_counter()
                n = out.num_generated_tokens
                return {"ttft": stamps[0] - start, "e2e": end - start, "output_tokens": n,
                        "tpot": (end - stamps[0]) / (n - 1) if n > 1 else None, "itl": list(np.diff(stamps))}
        start = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return summarize(results, time.perf_counter() - start)
    try:
        return asyncio.run(run())
    finally:
        llm.close()


def start_server(engine_dir: Path, max_kv_tokens: int, threads: int | None,
                 stream_interval: int = 1, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`engine serve` on a free port, with `extra` flags; (the process, its URL) once /health answers 200."""
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--engine-dir", str(engine_dir), "--port", "0",
           "--served-model-name", "bench", "--max-kv-tokens", str(max_kv_tokens),
           "--stream-interval", str(stream_interval), *extra]
    if threads:
        cmd += ["--threads", str(threads)]
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_API_KEY"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 300
    url = None
    while url is None:
        line = proc.stderr.readline()
        if not line or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"engine serve did not start: {line}")
        m = re.search(r"running on (http://[\d.]+:\d+)", line)
        url = m.group(1) if m else None
    while httpx.get(url + "/health").status_code != 200:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("engine serve did not become healthy")
        time.sleep(0.2)
    return proc, url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine-dir", type=Path)
    ap.add_argument("--url")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--stream-interval", type=int, default=1, help="engine serve's --stream-interval (default 1)")
    ap.add_argument("--name", default="smollm2")
    ap.add_argument("--no-baseline", action="store_true", help="skip the in-process API baseline")
    args = ap.parse_args()
    if (args.engine_dir is None) == (args.url is None):
        ap.error("give exactly one of --engine-dir (start a server) and --url (use a running one)")
    rng = np.random.default_rng(0)
    vocab, max_kv = 32000, args.concurrency * (args.input_len + args.output_len + 64)
    if args.engine_dir is not None:
        from engine.runtime.engine_dir import load_engine_config
        cfg = load_engine_config(args.engine_dir)
        vocab, max_kv = cfg.model.vocab_size, max(max_kv, cfg.build.max_seq_len)   # one longest request fits
    # Fresh random prompts each repeat: the server keeps its prefix cache between runs, a new LLM would not.
    rounds = [[rng.integers(100, min(vocab, 30000), args.input_len).tolist() for _ in range(args.num_prompts)]
              for _ in range(args.repeats)]
    runs, base = [], []
    proc, memory = None, None
    url = args.url
    try:
        if args.engine_dir is not None:
            proc, url = start_server(args.engine_dir, max_kv, args.threads, args.stream_interval)
        for i, prompts in enumerate(rounds):   # server and baseline interleaved, so drifting load hits both
            runs.append(asyncio.run(run_clients(url, args.model, prompts, args.output_len, args.concurrency)))
            print(f"server run {i}: {runs[-1]['output_tok_s']:.1f} output tok/s", file=sys.stderr)
            if args.engine_dir is not None and not args.no_baseline:
                base.append(baseline(args.engine_dir, prompts, args.output_len, args.concurrency, max_kv,
                                     args.threads, args.stream_interval))
                print(f"baseline run {i}: {base[-1]['output_tok_s']:.1f} output tok/s", file=sys.stderr)
        if proc is not None:
            from serve_memory import server_memory
            memory = server_memory(proc.pid, url, args.engine_dir)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if runs[0][k] is not None}
    result = {"config": vars(args) | {"engine_dir": str(args.engine_dir)}, "machine": platform.processor(),
              "server_runs": runs, "server_median": med, "baseline_runs": base, "server_memory": memory,
              "baseline_median": {k: statistics.median(b[k] for b in base) for k in base[0]} if base else None}
    print(f"\n{args.num_prompts} prompts x ({args.input_len} in, {args.output_len} out), concurrency "
          f"{args.concurrency}, median of {args.repeats}:")
    bm = result["baseline_median"]
    print("| metric | server P50 | server P99 | in-process P50 | in-process P99 |\n|---|---|---|---|---|")
    for m in ("ttft", "tpot", "itl"):
        b = f"{bm[m + '_p50_ms']:.1f} | {bm[m + '_p99_ms']:.1f}" if bm else "- | -"
        print(f"| {m.upper()} (ms) | {med[m + '_p50_ms']:.1f} | {med[m + '_p99_ms']:.1f} | {b} |")
    b = f"{bm['output_tok_s']:.1f}" if bm else "-"
    print(f"| output tok/s | {med['output_tok_s']:.1f} | | {b} | |")
    print(f"| requests/s | {med['requests_s']:.2f} | | {bm['requests_s']:.2f} | |" if bm else "")
    if memory is not None:
        print(f"server memory: peak RSS {memory['peak_rss_MB']} MB = weights {memory['weights_MB']} + KV touched "
              f"{memory['kv_touched_MB']} (pool {memory['kv_pool_MB']}) + overhead {memory['overhead_MB']} MB; goal "
              f"<= {memory['budget_MB']} MB: {'pass' if memory['pass'] else 'miss'}")
    out = Path(__file__).parent / "results" / f"serve_{args.name}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
