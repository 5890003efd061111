"""Each replica's /metrics: every replica's Prometheus text (runtime/server/metrics.py) as one exposition, each
series labelled with the replica that reported it.

    replica a:  vllm:prefix_cache_hits_total{model_name="m"} 96.0
    replica b:  vllm:prefix_cache_hits_total{model_name="m"} 8.0
    merged:     vllm:prefix_cache_hits_total{model_name="m",replica="a"} 96.0
                vllm:prefix_cache_hits_total{model_name="m",replica="b"} 8.0

The texts are parsed and written again by prometheus-client itself, so a family's samples stay together under one
HELP and TYPE as the format requires; Prometheus sums over `replica` when asked.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


def merge_replica_metrics(texts: dict[str, str]) -> bytes:
    """replica id -> its exposition text  ->  one exposition with a `replica` label on every sample."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples.extend(s._replace(labels={**s.labels, "replica": replica}) for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    """A collector of families already made (prometheus-client renders only what a registry collects)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return self.families
