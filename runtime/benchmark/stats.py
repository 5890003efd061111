"""Benchmark statistics: per-request token timestamps -> latency distributions and throughputs.

Pure functions over `RequestTiming`s (no engine, no clock), so the math is tested on known timestamps. The
definitions follow vLLM's `benchmark_serving` and trtllm-bench:

    start ─────────── t[0] ── t[1] ── ... ── t[n-1]        (t[i]: when output token i reached the client)
    TTFT  = t[0] - start                   queueing + prefill (which samples the first token)
    TPOT  = (t[n-1] - t[0]) / (n - 1)      per request (requests with one output token have none)
    ITL   = t[i] - t[i-1]                  every gap of every request, pooled
    E2E   = t[n-1] - start

Throughputs over the wall time of the measured run (first submission -> last token): requests/s, output
tokens/s, (input + output) tokens/s. Per-request speeds, weighted by tokens: prefill tokens/s = sum of prompt
tokens / sum of TTFT (in latency mode, batch 1, this is the engine's prefill speed; under load TTFT also holds
the wait for a batch slot), decode tokens/s = sum of (n - 1) / sum of (t[n-1] - t[0]) (what one user sees).
Percentiles are numpy's linear interpolation, as vLLM's. Latencies are reported in milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class RequestTiming:
    """One measured request: when it was submitted and when each output token arrived (seconds, one clock)."""
    input_tokens: int
    start: float
    token_times: tuple[float, ...]

    @property
    def output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def decode_time(self) -> float:
        return self.token_times[-1] - self.token_times[0]

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return self.decode_time / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return np.diff(self.token_times).tolist()

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.start


@dataclass(frozen=True)
class Distribution:
    """Milliseconds over a set of samples."""
    mean: float
    min: float
    p50: float
    p90: float
    p99: float
    max: float
    count: int


@dataclass(frozen=True)
class BenchSummary:
    num_requests: int
    total_input_tokens: int
    total_output_tokens: int
    duration_s: float
    request_throughput: float            # requests / s
    output_tokens_per_s: float           # all output tokens / duration
    total_tokens_per_s: float            # (input + output tokens) / duration
    prefill_tokens_per_s: float | None   # sum of prompt tokens / sum of TTFT (None if that sum is 0)
    decode_tokens_per_s: float | None    # per request: sum of (n - 1) / sum of decode time; None if no n > 1
    ttft_ms: Distribution
    tpot_ms: Distribution | None         # None when every request has one output token
    itl_ms: Distribution | None
    e2e_latency_ms: Distribution


def distribution_ms(seconds: Sequence[float]) -> Distribution | None:
    """mean / min / P50 / P90 / P99 / max in milliseconds; None for no samples."""
    if len(seconds) == 0:
        return None
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return Distribution(mean=float(ms.mean()), min=float(ms.min()), p50=float(p50), p90=float(p90), p99=float(p99),
                        max=float(ms.max()), count=int(ms.size))


def summarize(timings: Sequence[RequestTiming], duration_s: float) -> BenchSummary:
    """Aggregate the measured requests of one run that took `duration_s` of wall time."""
    assert timings and all(t.output_tokens for t in timings), "every measured request has at least one token"
    assert duration_s > 0, duration_s
    total_in = sum(t.input_tokens for t in timings)
    total_out = sum(t.output_tokens for t in timings)
    decode_tokens = sum(t.output_tokens - 1 for t in timings)
    decode_time = sum(t.decode_time for t in timings)
    ttft_sum = sum(t.ttft for t in timings)
    return BenchSummary(
        num_requests=len(timings), total_input_tokens=total_in, total_output_tokens=total_out,
        duration_s=duration_s, request_throughput=len(timings) / duration_s,
        output_tokens_per_s=total_out / duration_s, total_tokens_per_s=(total_in + total_out) / duration_s,
        prefill_tokens_per_s=total_in / ttft_sum if ttft_sum > 0 else None,
        decode_tokens_per_s=decode_tokens / decode_time if decode_tokens and decode_time > 0 else None,
        ttft_ms=distribution_ms([t.ttft for t in timings]),
        tpot_ms=distribution_ms([t.tpot for t in timings if t.tpot is not None]),
        itl_ms=distribution_ms([gap for t in timings for gap in t.itls]),
        e2e_latency_ms=distribution_ms([t.e2e for t in timings]))
