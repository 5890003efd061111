"""What the scheduler buys on a real model (SmolLM2-135M engine): priority, prefix caching, the prefill chunk cap.

    .venv/bin/python -m bench.scheduler_policies [--engine-dir .cache/engines/smollm2] [--threads 1] [--quick]

The engine core is driven step by step in this process, and requests arrive at fixed step numbers, so every
configuration sees exactly the same workload. Each step's time is measured twice: wall clock, and the CPU time
of this process (the primary number: on a shared machine it does not count time lost to other processes; with
--threads 1 it is the engine's compute time). A request's time to first token (TTFT) is the sum of the times of
the steps from its arrival to its first token, so queueing behind other requests is included.

  1. interactive TTFT: short interactive requests arriving one every few steps, alone, and beside a batch job
     (long prompts, long outputs, submitted at once) under fcfs and under priority (interactive first);
  2. shared system prompt: requests made of one long system prompt plus a short question, prefix caching on
     and off: total time, mean TTFT, prefix-cache hit rate;
  3. prefill chunk cap: eight decodes while a long prompt arrives, with max_prefill_chunk_with_decodes none and
     several caps: the decodes' worst and median inter-token time during the prefill, and the long prompt's TTFT.

Prints tables and writes bench/results/scheduler.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.runtime import LLM, SamplingParams
from engine.runtime.scheduler import DEFAULT_MAX_PREFILL_CHUNK_WITH_DECODES

ROOT = Path(__file__).resolve().parent


@dataclass
class Arrival:
    step: int                       # engine step before which the request is added
    prompt: list[int]
    params: SamplingParams
    kind: str                       # "interactive" | "batch" | ...
    priority: int = 0


@dataclass
class Trace:
    """Per request: arrival step, first-token step, token times; per step: wall and CPU seconds."""
    step_wall: list[float] = field(default_factory=list)
    step_cpu: list[float] = field(default_factory=list)
    arrived: dict[str, tuple[str, int]] = field(default_factory=dict)     # rid -> (kind, step)
    first: dict[str, int] = field(default_factory=dict)                   # rid -> step of its first token
    tokens: dict[str, list[int]] = field(default_factory=dict)            # rid -> steps that gave it a token
    outputs: dict[str, list[int]] = field(default_factory=dict)

    def ttft(self, rid: str, clock: str) -> float:
        times = self.step_cpu if clock == "cpu" else self.step_wall
        return sum(times[self.arrived[rid][1]:self.first[rid] + 1])


def drive(llm: LLM, arrivals: list[Arrival]) -> Trace:
    trace, pending = Trace(), sorted(arrivals, key=lambda a: a.step)
    core, step = llm.core, 0
    while pending or core.has_unfinished():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            seq, _ = llm.make_sequence(a.prompt, a.params, priority=a.priority)
            core.add_request(seq)
            trace.arrived[seq.request_id] = (a.kind, step)
        w, c = time.perf_counter(), time.process_time()
        outs = core.step()
        trace.step_wall.append(time.perf_counter() - w)
        trace.step_cpu.append(time.process_time() - c)
        for o in outs:
            trace.first.setdefault(o.request_id, step)
            trace.tokens.setdefault(o.request_id, []).append(step)
            if o.finished:
                trace.outputs[o.request_id] = o.token_ids
        step += 1
    llm.check_all_free()
    return trace


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def tokens(rng, n: int) -> list[int]:
    return rng.integers(100, 40000, size=n).tolist()


# ---- 1. interactive TTFT beside a batch job ----------------------------------------------------------------

def interactive_workload(args, with_batch: bool, interactive_priority: int, batch_priority: int) -> list[Arrival]:
    rng = np.random.default_rng(0)
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)   # noqa: E731
    arrivals = []
    if with_batch:
        arrivals += [Arrival(0, tokens(rng, args.batch_prompt), greedy(args.batch_output), "batch", batch_priority)
                     for _ in range(args.batch_requests)]
    rng = np.random.default_rng(1)          # the same interactive requests with or without the batch job
    arrivals += [Arrival(2 + i * args.interactive_every, tokens(rng, args.interactive_prompt),
                         greedy(args.interactive_output), "interactive", interactive_priority)
                 for i in range(args.interactive_requests)]
    return arrivals


def bench_interactive(args) -> list[dict]:
    rows = []
    for name, policy, with_batch, prio in (("interactive alone", "fcfs", False, (0, 0)),
                                           ("+ batch job, fcfs", "fcfs", True, (0, 0)),
                                           ("+ batch job, priority", "priority", True, (0, 1))):
        llm = LLM(args.engine_dir, threads=args.threads, max_kv_tokens=args.kv_tokens, scheduling_policy=policy,
                  max_batch_size=args.max_batch_size)
        tr = drive(llm, interactive_workload(args, with_batch, *prio))
        inter = [r for r, (k, _) in tr.arrived.items() if k == "interactive"]
        batch = [r for r, (k, _) in tr.arrived.items() if k == "batch"]
        row = dict(scenario=name, policy=policy, steps=len(tr.step_cpu),
                   preemptions=llm.stats().preemptions)
        for clock in ("cpu", "wall"):
            t = [tr.ttft(r, clock) for r in inter]
            row[f"interactive_ttft_p50_{clock}_s"] = pct(t, 50)
            row[f"interactive_ttft_p99_{clock}_s"] = pct(t, 99)
        row["interactive_ttft_p50_steps"] = pct([tr.first[r] - tr.arrived[r][1] + 1 for r in inter], 50)
        row["interactive_ttft_p99_steps"] = pct([tr.first[r] - tr.arrived[r][1] + 1 for r in inter], 99)
        if batch:
            row["batch_job_cpu_s"] = sum(tr.step_cpu[:max(max(tr.tokens[r]) for r in batch) + 1])
        rows.append(row)
        llm.close()
    return rows


# ---- 2. shared system prompt ------------------------------------------------------------------------------

def bench_prefix(args) -> list[dict]:
    rng = np.random.default_rng(2)
    system = tokens(rng, args.system_prompt)
    questions = [tokens(rng, args.question) for _ in range(args.prefix_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.prefix_output, ignore_eos=True)
    rows, outputs = [], {}
    for caching in (False, True):
        llm = LLM(args.engine_dir, threads=args.threads, max_kv_tokens=args.kv_tokens,
                  enable_prefix_caching=caching)
        # One request first (the cache is cold), then the rest together, a step later.
        arrivals = [Arrival(0 if i == 0 else 1, system + q, params, "chat") for i, q in enumerate(questions)]
        tr = drive(llm, arrivals)
        st = llm.stats()
        rids = list(tr.arrived)
        outputs[caching] = [tr.outputs[r] for r in rids]
        rows.append(dict(prefix_caching=caching, requests=len(rids), total_cpu_s=sum(tr.step_cpu),
                         total_wall_s=sum(tr.step_wall),
                         mean_ttft_cpu_s=statistics.mean(tr.ttft(r, "cpu") for r in rids),
                         mean_ttft_wall_s=statistics.mean(tr.ttft(r, "wall") for r in rids),
                         prefix_cache_hit_rate=st.prefix_cache_hit_rate, prefix_cache_hits=st.prefix_cache_hits))
        llm.close()
    assert outputs[True] == outputs[False], "prefix caching changed the greedy output"
    off, on = rows
    on["speedup_cpu"] = off["total_cpu_s"] / on["total_cpu_s"]
    on["speedup_wall"] = off["total_wall_s"] / on["total_wall_s"]
    on["ttft_speedup_cpu"] = off["mean_ttft_cpu_s"] / on["mean_ttft_cpu_s"]
    return rows


# ---- 3. the prefill chunk cap while decodes run --------------------------------------------------------------

def bench_chunk_cap(args) -> list[dict]:
    rng = np.random.default_rng(3)
    decode_params = SamplingParams(temperature=0, max_tokens=args.cap_decode_output, ignore_eos=True)
    arrivals = [Arrival(0, tokens(rng, 32), decode_params, "decode") for _ in range(8)]
    arrivals.append(Arrival(3, tokens(rng, args.cap_long_prompt),
                            SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), "long"))
    rows = []
    for cap in args.caps:
        llm = LLM(args.engine_dir, threads=args.threads, max_kv_tokens=args.kv_tokens,
                  max_prefill_chunk_with_decodes=cap or None)
        tr = drive(llm, arrivals)
        long = next(r for r, (k, _) in tr.arrived.items() if k == "long")
        start, end = tr.arrived[long][1], tr.first[long]
        # Inter-token time of each decode over the steps of the long prefill: the steps are shared by all.
        during = list(range(start, end + 1))
        row = dict(cap=cap or "none", prefill_steps=len(during))
        for clock, times in (("cpu", tr.step_cpu), ("wall", tr.step_wall)):
            itl = [times[s] for s in during]
            row[f"decode_itl_max_{clock}_ms"] = 1e3 * max(itl)
            row[f"decode_itl_median_{clock}_ms"] = 1e3 * statistics.median(itl)
            row[f"long_ttft_{clock}_s"] = tr.ttft(long, clock)
        rows.append(row)
        llm.close()
    return rows


def show(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    keys = list(rows[0])
    for r in rows[1:]:
        keys += [k for k in r if k not in keys]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)   # noqa: E731
    width = [max(len(k), *(len(fmt(r.get(k, ""))) for r in rows)) for k in keys]
    print("  ".join(k.rjust(w) for k, w in zip(keys, width)))
    for r in rows:
        print("  ".join(fmt(r.get(k, "")).rjust(w) for k, w in zip(keys, width)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine-dir", type=Path, default=ROOT.parent / ".cache/engines/smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-tokens", type=int, default=16384, help="KV pool size in tokens")
    ap.add_argument("--max-batch-size", type=int, default=8, help="sequences per step in part 1")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    ap.add_argument("--parts", default="interactive,prefix,cap")
    ap.add_argument("--caps", help="part 3's chunk caps, comma-separated, 0 = no cap (default 0,64,128,256)")
    ap.add_argument("--output", type=Path, default=ROOT / "results/scheduler.json")
    args = ap.parse_args()
    q = args.quick
    args.interactive_requests, args.interactive_every = (3, 3) if q else (8, 4)
    args.interactive_prompt, args.interactive_output = 32, 4 if q else 8
    args.batch_requests, args.batch_prompt, args.batch_output = (8, 128, 8) if q else (8, 512, 48)
    args.system_prompt, args.question, args.prefix_requests, args.prefix_output = \
        (256, 16, 4, 2) if q else (768, 24, 8, 4)
    args.cap_long_prompt, args.cap_decode_output, caps = (300, 12, [0, 128]) if q else (1000, 40, [0, 64, 128, 256])
    args.caps = [int(c) for c in args.caps.split(",")] if args.caps else caps

    parts = set(args.parts.split(","))
    report = dict(meta=dict(engine_dir=str(args.engine_dir), threads=args.threads, quick=q,
                            machine=platform.machine(), cpus=os.cpu_count(), max_batch_size=args.max_batch_size,
                            max_prefill_chunk_with_decodes=DEFAULT_MAX_PREFILL_CHUNK_WITH_DECODES,
                            date=time.strftime("%Y-%m-%d %H:%M:%S")))
    if "interactive" in parts:
        report["interactive"] = bench_interactive(args)
        show(f"1. TTFT of {args.interactive_requests} interactive requests ({args.interactive_prompt}-token prompts, "
             f"one every {args.interactive_every} steps), alone and beside a batch job of {args.batch_requests} x "
             f"{args.batch_prompt}-token prompts ({args.batch_output} tokens out); max_batch_size "
             f"{args.max_batch_size}", report["interactive"])
    if "prefix" in parts:
        report["prefix"] = bench_prefix(args)
        show(f"2. {args.prefix_requests} requests sharing a {args.system_prompt}-token system prompt "
             f"(+ {args.question}-token question, {args.prefix_output} tokens out), prefix caching off / on",
             report["prefix"])
    if "cap" in parts:
        report["chunk_cap"] = bench_chunk_cap(args)
        show(f"3. eight decodes while a {args.cap_long_prompt}-token prompt prefills: step time (= each decode's "
             "inter-token time) by prefill chunk cap", report["chunk_cap"])
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
