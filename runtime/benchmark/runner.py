"""Benchmark an engine through the Python API, as trtllm-bench does for TensorRT-LLM: `run_benchmark` -> BenchReport.

    llm = LLM(engine_dir)
    requests = synthetic_requests(64, 128, 128, vocab_size=..., seed=0)      # or read_jsonl_requests(...)
    report = run_benchmark(llm, requests, BenchConfig(mode="throughput", concurrency=8, warmup=2))

Modes
    throughput  every request is submitted at once; at most `concurrency` are in flight (None: no limit beyond
                the scheduler's max batch size, whose queue holds the rest). Measures what the engine sustains.
    latency     one request at a time (batch 1). Measures what one user sees with the engine to itself.
Both first run `warmup` requests (the first request's lengths, other random ids, so they do not fill the prefix
cache with the measured prompts) the same way, and leave them out of the statistics.

Each request is sampled greedily with ignore_eos, so it produces exactly its output_len tokens. Requests go
through `LLM.generate_async` (the engine runs in its background thread, as under the server); the client side
stamps each output token with time.perf_counter when it arrives, and stats.py turns the stamps into
TTFT / TPOT / ITL / throughputs. Memory: the process's peak resident set (getrusage: loading included), the KV
pool, and, when a CUDA engine is loaded through torch, torch's peak device allocation.
"""
from __future__ import annotations

import asyncio
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from engine.core.errors import EngineError

from ..llm import LLM
from ..sampling_params import SamplingParams
from .dataset import BenchRequest, special_token_ids, synthetic_requests
from ..speculative import SpecDecodeStats
from .stats import BenchSummary, RequestTiming, summarize

MODES = ("throughput", "latency")


@dataclass(frozen=True)
class BenchConfig:
    mode: str = "throughput"
    concurrency: int | None = None       # requests in flight at most; latency mode: 1
    warmup: int = 2                      # requests run before measuring, not counted
    seed: int = 0                        # warm-up prompts: stream (seed, 1), never the dataset's stream `seed`

    def __post_init__(self):
        if self.mode not in MODES:
            raise EngineError(f"--mode {self.mode!r} must be one of {', '.join(MODES)}", usage=True)
        c = self.concurrency
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise EngineError(f"--concurrency {c!r} must be an integer >= 1 (leave it out for no limit)", usage=True)
        if self.mode == "latency":
            if c not in (None, 1):
                raise EngineError(f"--concurrency {c} does not apply to --mode latency, which runs one request at "
                                  "a time; use --mode throughput to run requests concurrently", usage=True)
            object.__setattr__(self, "concurrency", 1)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise EngineError(f"--warmup {self.warmup!r} must be an integer >= 0", usage=True)


@dataclass(frozen=True)
class EngineInfo:
    engine_dir: str
    architecture: str
    dtype: str
    backend: str
    backend_version: str
    toolchain_version: str
    max_seq_len: int
    max_batch_size: int                  # the scheduler's, this run (at most the engine's build limit)
    max_num_tokens: int


@dataclass(frozen=True)
class HostInfo:
    platform: str                        # platform.platform(), e.g. Linux-6.8.0-x86_64-with-glibc2.39
    machine: str
    cpu_count: int                       # CPUs this process may run on
    python: str

    @classmethod
    def current(cls) -> "HostInfo":
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
        return cls(platform=platform.platform(), machine=platform.machine(), cpu_count=cpus,
                   python=platform.python_version())


@dataclass(frozen=True)
class MemoryStats:
    peak_rss_bytes: int | None           # process peak resident set since start (loading included); None: unknown
    kv_cache_bytes: int
    kv_cache_tokens: int
    peak_device_bytes: int | None = None  # torch's peak CUDA allocation (TensorRT engines); None: no CUDA engine


@dataclass(frozen=True)
class EngineCounters:
    """The engine's counters over the measured run (warm-up excluded)."""
    steps: int
    preemptions: int
    prefix_cache_hit_tokens: int
    speculation: SpecDecodeStats | None = None   # drafts proposed and accepted, the proposer's time


@dataclass(frozen=True)
class RequestRecord:
    input_tokens: int
    output_tokens: int
    ttft_ms: float
    tpot_ms: float | None
    e2e_ms: float


@dataclass(frozen=True)
class BenchReport:
    mode: str
    dataset: str                         # "synthetic" or the file
    config: BenchConfig
    engine: EngineInfo
    host: HostInfo
    summary: BenchSummary
    memory: MemoryStats
    counters: EngineCounters
    requests: tuple[RequestRecord, ...]


def run_benchmark(llm: LLM, requests: list[BenchRequest], config: BenchConfig, *, dataset: str = "synthetic",
                  on_request_done: Callable[[str], None] | None = None) -> BenchReport:
    """Warm up, run `requests` under `config`, and measure (see the module docstring). `on_request_done` is
    called with a request's description as each measured request finishes (a progress bar)."""
    if not requests:
        raise EngineError("the benchmark has no requests; give --num-requests >= 1", usage=True)
    first = requests[0]
    special = special_token_ids(llm.tokenizer, llm.eos_token_ids)
    warm = synthetic_requests(config.warmup, len(first.prompt_token_ids), first.output_len,
                              vocab_size=llm.config.model.vocab_size, exclude_ids=special,
                              seed=(config.seed, 1)) if config.warmup else []
    if warm:
        asyncio.run(_run_requests(llm, warm, config.concurrency, None))
    before = llm.stats()
    start = time.perf_counter()
    timings = asyncio.run(_run_requests(llm, requests, config.concurrency, on_request_done))
    duration = time.perf_counter() - start
    after = llm.stats()
    for r, t in zip(requests, timings):
        if t.output_tokens != r.output_len:  # ignore_eos and no stop strings: only an abort ends a request early
            raise EngineError(f"{r.where}: the engine produced {t.output_tokens} of {r.output_len} tokens; the "
                              "request was aborted")
    b, sched = llm.config.build, llm.core.scheduler.config
    engine = EngineInfo(engine_dir=str(llm.engine_dir), architecture=llm.config.model.architecture,
                        dtype=b.dtype, backend=b.backend, backend_version=llm.config.backend_version,
                        toolchain_version=llm.config.toolchain_version, max_seq_len=b.max_seq_len,
                        max_batch_size=sched.max_batch_size, max_num_tokens=sched.max_num_tokens)
    counters = EngineCounters(steps=after.num_steps - before.num_steps,
                              preemptions=after.preemptions - before.preemptions,
                              prefix_cache_hit_tokens=after.prefix_cache_hits - before.prefix_cache_hits,
                              speculation=after.speculation.since(before.speculation) if after.speculation else None)
    records = tuple(RequestRecord(input_tokens=t.input_tokens, output_tokens=t.output_tokens, ttft_ms=t.ttft * 1e3,
                                  tpot_ms=None if t.tpot is None else t.tpot * 1e3, e2e_ms=t.e2e * 1e3)
                    for t in timings)
    return BenchReport(mode=config.mode, dataset=dataset, config=config, engine=engine, host=HostInfo.current(),
                       summary=summarize(timings, duration), memory=memory_stats(llm), counters=counters,
                       requests=records)


async def _run_requests(llm: LLM, requests: list[BenchRequest], concurrency: int | None,
                        on_done: Callable[[str], None] | None) -> list[RequestTiming]:
    """All requests submitted at once, at most `concurrency` in flight; timings in request order."""
    slots = asyncio.Semaphore(concurrency or len(requests))

    async def one(req: BenchRequest) -> RequestTiming:
        params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
        async with slots:
            start = time.perf_counter()
            stamps: list[float] = []
            async for out in llm.generate_async(list(req.prompt_token_ids), params):
                now = time.perf_counter()
                stamps.extend([now] * len(out.delta_token_ids))
        if not stamps:
            raise EngineError(f"{req.where}: the engine produced no tokens; the request was aborted")
        if on_done is not None:
            on_done(req.where)
        return RequestTiming(input_tokens=len(req.prompt_token_ids), start=start, token_times=tuple(stamps))

    return list(await asyncio.gather(*(one(r) for r in requests)))


def memory_stats(llm: LLM) -> MemoryStats:
    return MemoryStats(peak_rss_bytes=peak_rss_bytes(), kv_cache_bytes=llm.kv_plan.num_bytes,
                       kv_cache_tokens=llm.kv_plan.num_tokens, peak_device_bytes=_peak_cuda_bytes())


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process; None where unknown. Linux: VmHWM of /proc/self/status, the high
    water mark of this process image's own memory. Not ru_maxrss there: Linux carries it across fork and exec, so a
    process started by a large parent reports at least the parent's RSS at the fork (a 1.2 GB benchmark driver made
    every measured child read 1.2 GB). Elsewhere ru_maxrss (KiB; bytes on macOS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _peak_cuda_bytes() -> int | None:
    # Only when a CUDA engine already brought torch in: the ONNX Runtime path must not import torch.
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())
