"""metrics_merge: every replica's series under one HELP/TYPE each, labelled by replica, parseable again."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.runtime.replicas.metrics_merge import merge_replica_metrics


def replica_text(hits: float) -> str:
    r = CollectorRegistry()
    Counter("vllm:prefix_cache_hits", "Prefix cache hits.", ["model_name"], registry=r).labels("m").inc(hits)
    Histogram("vllm:e2e_request_latency_seconds", "e2e", ["model_name"], buckets=(1.0,),
              registry=r).labels("m").observe(hits)
    return generate_latest(r).decode()


def test_each_series_is_kept_per_replica_under_one_family():
    merged = merge_replica_metrics({"b": replica_text(5), "a": replica_text(3)}).decode()
    assert merged.count("# TYPE vllm:prefix_cache_hits_total counter") == 1
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    hits = {s.labels["replica"]: s.value for s in families["vllm:prefix_cache_hits"].samples}
    assert hits == {"a": 3.0, "b": 5.0}
    counts = {s.labels["replica"]: s.value for s in families["vllm:e2e_request_latency_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"a": 1.0, "b": 1.0}


def test_no_replica_is_an_empty_exposition():
    assert merge_replica_metrics({}) == b""
