"""The goals of issue #52 for `engine serve --ray`, each against the plain server on the same machine:

    .venv/bin/python -m bench.ray_replicas --engine-dir ENGINE [--streams 32] [--input-len 128] [--output-len 128]
        [--rounds 3] [--latency-requests 40] [--prefix-requests 96] [--prefix-concurrency 8] [--name NAME]
        [--parts throughput,latency,prefix] [--baseline-tree DIR]

throughput  `--streams` concurrent /v1/completions streams of random token ids (greedy, ignore_eos), total output
            tokens over each round's wall time: 2 replicas of --threads 1 on Ray against one `engine serve
            --threads 2`; goal: ratio >= 0.9 (median of the rounds)
latency     one request at a time, a 1-token completion of a short prompt: the wall time of each through 1 replica
            of --threads 2 on Ray against `engine serve --threads 2`, both running, requests to them in turns;
            goal: the P50 difference <= 5 ms. --baseline-tree DIR (a checkout of another commit, in a folder named
            `engine`, e.g. `git worktree add /tmp/ab/engine e73b5ec`) adds that tree's `engine serve --ray`, on a
            second Ray cluster, to the same turns
prefix      8 system prompts of ~300 tokens, each user turn short and new, chat streams at --prefix-concurrency
            over 2 replicas whose KV pools hold about half of the system prompts each: the prefix-cache hit rate
            (hits / queried tokens, from the replicas' metrics) with --routing prefix against Ray's default
            (power-of-two choices); goal: ratio >= 1.5
Every server is a fresh `engine serve` process (Ray: a Ray cluster of this machine, started and stopped by it), one
at a time, each warmed with an untimed round; the throughput rounds alternate between the two, a fresh server each,
so that the host's other load falls on both alike. The prefix part needs an engine whose max-seq-len fits in
--prefix-kv-tokens (the pool must hold one longest request), e.g. built with --max-seq-len 1024. Writes
bench/results/ray_replicas.json (ray_replicas_<name>.json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from bench.serve_clients import run_clients, start_server

MODEL = "bench"
GOALS = {"throughput_ratio": 0.9, "added_latency_p50_ms": 5.0, "prefix_hit_ratio": 1.5}


def start_ray_server(engine_dir: Path, *, replicas: int, threads: int, max_kv_tokens: int,
                     routing: str = "prefix", tree: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`engine serve --ray` on a free port (of the package at `tree`, else this one); (the process, its URL) once
    every replica answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "engine.cli", "serve", "--engine-dir", str(engine_dir), "--ray", "--port",
           str(port), "--served-model-name", MODEL, "--replicas", str(replicas), "--threads", str(threads),
           "--max-kv-tokens", str(max_kv_tokens), "--routing", routing, "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_API_KEY"}
    if tree is not None:     # ahead of the editable install; Ray's workers inherit it
        env["PYTHONPATH"] = str(tree.resolve().parent)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    try:
        while len(replica_counters(url, "vllm:num_requests_running")) != replicas:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"engine serve --ray did not start {replicas} replicas")
            time.sleep(0.5)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def replica_counters(url: str, name: str) -> dict[str, float]:
    """replica -> the value of sample `name` in the ingress's merged /metrics ({} while it does not answer)."""
    try:
        r = httpx.get(url + "/metrics", timeout=10)
        if r.status_code != 200:      # Ray's proxy answers 404 until the application is deployed
            return {}
        return {s.labels.get("replica", ""): s.value for f in text_string_to_metric_families(r.text)
                for s in f.samples if s.name == name}
    except httpx.HTTPError:
        return {}


# ---- throughput ------------------------------------------------------------------------------------------------

def throughput_round(start, warm: list[list[int]], prompts: list[list[int]], output_len: int) -> float:
    """Output tok/s of one round on a fresh server from `start`, after an untimed round of other prompts."""
    proc, url = start()
    try:
        asyncio.run(run_clients(url, MODEL, warm, output_len, len(warm)))
        return asyncio.run(run_clients(url, MODEL, prompts, output_len, len(prompts)))["output_tok_s"]
    finally:
        stop(proc)


# ---- latency ---------------------------------------------------------------------------------------------------

def latencies(urls: list[str], n: int) -> list[list[float]]:
    """Milliseconds of n one-at-a-time requests for one token to each URL, the URLs in turns (after 5 untimed
    requests to each), so that the host's other load falls on all alike."""
    out = [[] for _ in urls]
    clients = [httpx.Client(base_url=url, timeout=60) for url in urls]
    try:
        for i in range(n + 5):
            for client, times in zip(clients, out):
                start = time.perf_counter()
                r = client.post("/v1/completions", json={"model": MODEL, "prompt": f"Say {i}", "max_tokens": 1,
                                                         "temperature": 0})
                r.raise_for_status()
                if i >= 5:
                    times.append((time.perf_counter() - start) * 1000)
    finally:
        for client in clients:
            client.close()
    return out


def latency_against_plain(args, max_kv: int) -> dict:
    """A plain server and 1 replica on Ray (and one of --baseline-tree's package, on a second Ray cluster), all up,
    requests to them in turns."""
    trees = [None] + ([args.baseline_tree] if args.baseline_tree is not None else [])
    procs = []
    try:
        plain, plain_url = start_server(args.engine_dir, max_kv, 2)
        procs.append(plain)
        urls = []
        for tree in trees:
            proc, url = start_ray_server(args.engine_dir, replicas=1, threads=2, max_kv_tokens=max_kv, tree=tree)
            procs.append(proc)
            urls.append(url)
        load = os.getloadavg()[0]
        direct_ms, *ray_ms = latencies([plain_url, *urls], args.latency_requests)
        load = (load + os.getloadavg()[0]) / 2
    finally:
        for proc in reversed(procs):
            stop(proc)
    d = statistics.median(direct_ms)
    out = {}
    for key, tree, ms in zip(("latency", "latency_baseline"), trees, ray_ms):
        r = statistics.median(ms)
        print(f"1-token latency P50 ({tree or 'this tree'}, load {load:.1f}): plain {d:.1f}, 1 replica x 2 threads "
              f"{r:.1f} ms", file=sys.stderr)
        out[key] = {"direct_ms": direct_ms, "ray_ms": ms, "direct_p50_ms": d, "ray_p50_ms": r, "added_p50_ms": r - d,
                    "load_avg_1min": load, "tree": str(tree or "this tree")}
    return out


# ---- prefix-cache hit rate -------------------------------------------------------------------------------------

TOPICS = ("plumbing", "garden tools", "paint", "lumber", "electrical", "fasteners", "flooring", "lighting")


def system_prompts() -> list[str]:
    """8 system prompts that differ from their first characters (so their first chunks differ) and run ~300
    tokens each."""
    rules = " ".join(f"Rule {j}: when asked about item {j}, name its aisle, its price band and one alternative."
                     for j in range(12))
    return [f"{topic.title()} desk of the Oak Street hardware store. You answer questions about {topic} only. "
            f"{rules}" for topic in TOPICS]


async def chat_round(url: str, requests: list[tuple[str, str]], concurrency: int) -> None:
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(base_url=url, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(system: str, user: str):
            body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "stream": True,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
            async with sem, session.post("/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                async for _ in r.content:
                    pass
        await asyncio.gather(*(one(s, u) for s, u in requests))


def hit_rate(url: str, requests: list[tuple[str, str]], concurrency: int) -> dict:
    before = [sum(replica_counters(url, f"vllm:prefix_cache_{k}_total").values()) for k in ("hits", "queries")]
    asyncio.run(chat_round(url, requests, concurrency))
    after = [sum(replica_counters(url, f"vllm:prefix_cache_{k}_total").values()) for k in ("hits", "queries")]
    hits, queries = after[0] - before[0], after[1] - before[1]
    return {"hit_tokens": hits, "queried_tokens": queries, "hit_rate": hits / queries if queries else 0.0}


def prefix_requests(n: int, seed: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    prompts = system_prompts()
    return [(prompts[int(rng.integers(len(prompts)))], f"Question {seed}-{i}: where do I find item "
             f"{int(rng.integers(100))}?") for i in range(n)]


# ---- the run ---------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine-dir", type=Path, required=True)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency-requests", type=int, default=40)
    ap.add_argument("--prefix-requests", type=int, default=96)
    ap.add_argument("--prefix-concurrency", type=int, default=8)
    ap.add_argument("--prefix-kv-tokens", type=int, default=1536,
                    help="each replica's KV pool in the prefix part: about half of the 8 system prompts")
    ap.add_argument("--name")
    ap.add_argument("--parts", default="throughput,latency,prefix")
    ap.add_argument("--baseline-tree", type=Path)
    args = ap.parse_args()
    from engine.runtime.engine_dir import load_engine_config
    build = load_engine_config(args.engine_dir).build
    vocab = load_engine_config(args.engine_dir).model.vocab_size
    rng = np.random.default_rng(0)
    rounds = [[rng.integers(100, min(vocab, 30000), args.input_len).tolist() for _ in range(args.streams)]
              for _ in range(args.rounds + 1)]
    warm, rounds = rounds[0], rounds[1:]
    max_kv = max(args.streams * (args.input_len + args.output_len + 64), build.max_seq_len)
    result = {"config": vars(args) | {"engine_dir": str(args.engine_dir)}, "machine": platform.processor(),
              "cpus": os.cpu_count(), "goals": GOALS}

    parts = set(args.parts.split(","))
    if "throughput" in parts:
        result["throughput"] = throughput_part(args, rounds, warm, max_kv)
    if "latency" in parts:
        result |= latency_against_plain(args, max_kv)
    if "prefix" in parts:
        result["prefix"] = prefix_part(args)
    report(result)
    out = Path(__file__).parent / "results" / (f"ray_replicas_{args.name}.json" if args.name else "ray_replicas.json")
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def throughput_part(args, rounds, warm, max_kv: int) -> dict:
    direct_tok_s, ray_tok_s = [], []
    for prompts in rounds:     # alternating, each on a fresh server: the host's other load hits both alike
        direct_tok_s.append(throughput_round(lambda: start_server(args.engine_dir, max_kv, 2), warm, prompts,
                                             args.output_len))
        ray_tok_s.append(throughput_round(lambda: start_ray_server(args.engine_dir, replicas=2, threads=1,
                                                                   max_kv_tokens=max_kv), warm, prompts,
                                          args.output_len))
        print(f"round: plain {direct_tok_s[-1]:.1f}, 2 replicas x 1 thread {ray_tok_s[-1]:.1f} tok/s", file=sys.stderr)
    ratios = [r / d for r, d in zip(ray_tok_s, direct_tok_s)]
    return {"direct_tok_s": direct_tok_s, "ray_tok_s": ray_tok_s, "ratios": ratios,
            "ratio": statistics.median(ratios)}


def prefix_part(args) -> dict:
    """The hit rate of each routing over the same requests, each on fresh replicas warmed by one untimed round."""
    out = {}
    for routing in ("prefix", "power-of-two"):
        proc, url = start_ray_server(args.engine_dir, replicas=2, threads=1, max_kv_tokens=args.prefix_kv_tokens,
                                     routing=routing)
        try:
            hit_rate(url, prefix_requests(args.prefix_requests // 2, seed=1), args.prefix_concurrency)
            out[routing] = hit_rate(url, prefix_requests(args.prefix_requests, seed=2), args.prefix_concurrency)
        finally:
            stop(proc)
        print(f"{routing}: hit rate {out[routing]['hit_rate']:.3f}", file=sys.stderr)
    prefix, pow2 = out["prefix"]["hit_rate"], out["power-of-two"]["hit_rate"]
    return out | {"ratio": prefix / pow2 if pow2 else float("inf")}


def report(r: dict) -> None:
    c = r["config"]

    def verdict(ok: bool) -> str:
        return "pass" if ok else "miss"
    print(f"\n{c['streams']} streams x ({c['input_len']} in, {c['output_len']} out), {c['rounds']} rounds; "
          f"{r['cpus']} CPUs")
    print("| goal | baseline | --ray | measured | goal | |\n|---|---:|---:|---:|---:|---|")
    if "throughput" in r:
        t = r["throughput"]
        print(f"| throughput, 2 replicas x 1 thread vs 1 server x 2 threads (tok/s, median) | "
              f"{statistics.median(t['direct_tok_s']):.1f} | {statistics.median(t['ray_tok_s']):.1f} | "
              f"{t['ratio']:.2f}x | >= {GOALS['throughput_ratio']}x | "
              f"{verdict(t['ratio'] >= GOALS['throughput_ratio'])} |")
    for key, what in (("latency", "this tree"), ("latency_baseline", "--baseline-tree")):
        if key in r:
            lat = r[key]
            print(f"| latency of a 1-token request, P50 (ms), {what}, load {lat['load_avg_1min']:.1f} | "
                  f"{lat['direct_p50_ms']:.1f} | {lat['ray_p50_ms']:.1f} | +{lat['added_p50_ms']:.1f} ms | "
                  f"<= {GOALS['added_latency_p50_ms']} ms | {verdict(lat['added_p50_ms'] <= GOALS['added_latency_p50_ms'])} |")
    if "prefix" in r:
        p = r["prefix"]
        print(f"| prefix-cache hit rate, prefix routing vs power-of-two | {p['power-of-two']['hit_rate']:.3f} | "
              f"{p['prefix']['hit_rate']:.3f} | {p['ratio']:.2f}x | >= {GOALS['prefix_hit_ratio']}x | "
              f"{verdict(p['ratio'] >= GOALS['prefix_hit_ratio'])} |")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
