"""The server's Prometheus metrics, under vLLM's names so existing dashboards and alerts work unchanged.

    vllm:num_requests_running / vllm:num_requests_waiting       gauges, read from the scheduler at scrape time
    vllm:kv_cache_usage_perc (and its old name gpu_cache_usage_perc)  fraction of KV blocks in use, 0..1
    vllm:num_preemptions_total                                  counter (recompute preemptions since start)
    engine:kv_cache_pool_bytes / engine:kv_cache_touched_bytes  gauges (no vLLM name): the pool allocated, and
                                                                the part of it that has held KV since start (the
                                                                pool's pages are mapped on first write, so this
                                                                is what of it counts in the process's RSS)
    vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total   counters, in tokens
    vllm:spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total,
    _num_accepted_tokens_per_pos_total{position}                 counters, with speculative decoding (their ratio
                                                                is the acceptance rate; 1 + accepted / drafts the
                                                                mean acceptance length)
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds,
    vllm:request_time_per_output_token_seconds                  histograms (vLLM's buckets)
    vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:request_success_total{finished_reason}
    process_resident_memory_bytes, process_virtual_memory_bytes, ...  prometheus-client's process collector
    engine:model_loaded, engine:model_loads_total, engine:model_unloads_total   per served model (no vLLM
                                                                name): which engines are loaded (models.py)
Every series carries model_name; an engine's gauges and counters appear while it is loaded, read from
`LLM.stats()` at scrape time. Each app owns its registry (no global state), so several servers can live in one
process (the tests).
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    """Gauges and counters read from each loaded engine at scrape time (a model that is not loaded has none),
    and whether each model is loaded."""

    def __init__(self, get_models):
        self.get_models = get_models        # () -> [(model name, its LLM or None)]

    def collect(self):
        models = list(self.get_models())
        loaded = GaugeMetricFamily("engine:model_loaded", "1 while the model's engine is loaded, else 0.",
                                   labels=["model_name"])
        for name, llm in models:
            loaded.add_metric([name], 0 if llm is None else 1)
        yield loaded
        families: dict[str, object] = {}

        def add(kind, name, doc, model, value, labels=("model_name",), extra=()):
            if name not in families:
                families[name] = kind(name, doc, labels=list(labels))
            families[name].add_metric([model, *extra], value)

        for model, llm in models:
            if llm is not None:
                self._engine_series(model, llm, add)
        yield from families.values()

    @staticmethod
    def _engine_series(model: str, llm, add) -> None:
        s = llm.stats()

        def gauge(name, doc, value):
            add(GaugeMetricFamily, name, doc, model, value)

        def counter(name, doc, value):
            add(CounterMetricFamily, name, doc, model, value)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage)
        gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (deprecated name of kv_cache_usage_perc).", s.kv_usage)
        block_bytes = llm.kv_plan.bytes_per_block
        gauge("engine:kv_cache_pool_bytes", "Bytes of the KV-cache pool allocated.", s.num_blocks * block_bytes)
        gauge("engine:kv_cache_touched_bytes", "Bytes of the KV-cache pool's blocks that have held KV since "
              "start.", s.num_touched_blocks * block_bytes)
        counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", s.preemptions)
        counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                s.prefix_cache_queries)
        counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                s.prefix_cache_hits)
        if llm.loras is not None and llm.loras.options is not None:   # vLLM's gauge, its labels naming the adapters
            add(GaugeMetricFamily, "vllm:lora_requests_info", "Running stats on LoRA requests.", model, 1,
                ("model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"),
                (str(llm.loras.options.max_loras), ",".join(s.running_loras), ",".join(s.waiting_loras)))
        if (sp := s.speculation) is not None:
            counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", sp.num_drafts)
            counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", sp.num_draft_tokens)
            counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", sp.num_accepted_tokens)
            for pos, n in enumerate(sp.accepted_per_pos):
                add(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens_per_pos",
                    "Accepted tokens per draft position.", model, n, ("model_name", "position"), (str(pos),))


class ServerMetrics:
    """The registry of one app; `model(name)` gives the request metrics of one served model."""

    def __init__(self, get_models):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        r.register(_EngineCollector(get_models))
        lab = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              lab, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             lab, buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", lab, buckets=ITL_BUCKETS,
                              registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             lab, buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", lab,
                                         registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               lab + ["finished_reason"], registry=r)
        self.loads = Counter("engine:model_loads", "Times the model's engine was loaded.", lab, registry=r)
        self.unloads = Counter("engine:model_unloads", "Times the model's engine was unloaded (LRU or idle).", lab,
                               registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def model(self, name: str) -> "ModelMetrics":
        return ModelMetrics(self, name)


class ModelMetrics:
    """The request metrics of one served model: the app's series under its model_name label."""

    def __init__(self, m: ServerMetrics, name: str):
        self.model_name, self._success = name, m.success
        self.ttft, self.itl, self.tpot, self.e2e = (h.labels(name) for h in (m.ttft, m.itl, m.tpot, m.e2e))
        self.prompt_tokens, self.generation_tokens = m.prompt_tokens.labels(name), m.generation_tokens.labels(name)

    def finished(self, reason: str):
        return self._success.labels(self.model_name, reason)

    def recorder(self) -> "RequestRecorder":
        return RequestRecorder(self)


class RequestRecorder:
    """Observes one sequence's outputs as they reach the server: TTFT (engine-side, from arrival, queueing
    included), inter-token gaps as the client sees them, and at the end e2e latency and token counts."""

    def __init__(self, metrics: ModelMetrics):
        self.m = metrics
        self.last: float | None = None

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        k = len(out.delta_token_ids)
        if k:
            if self.last is None:
                ttft = out.metrics.time_to_first_token
                if ttft is not None:
                    self.m.ttft.observe(ttft)
            else:
                for _ in range(k):
                    self.m.itl.observe((now - self.last) / k)
            self.last = now
        if out.finished and out.finish_reason != "abort":
            m = out.metrics
            self.m.prompt_tokens.inc(out.num_prompt_tokens)
            self.m.generation_tokens.inc(out.num_generated_tokens)
            self.m.finished(out.finish_reason).inc()
            if m.e2e_latency is not None:
                self.m.e2e.observe(m.e2e_latency)
            if out.num_generated_tokens > 1 and m.finish_time is not None and m.first_token_time is not None:
                self.m.tpot.observe((m.finish_time - m.first_token_time) / (out.num_generated_tokens - 1))
