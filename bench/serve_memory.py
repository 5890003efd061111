"""Serving-memory goal: the `engine serve` process's RSS <= engine weights + KV pool + 300 MB (bench/serve_clients.py).

    server_memory(pid, url, engine_dir) -> {"rss_MB", "peak_rss_MB", "weights_MB", "kv_pool_MB",
                                            "kv_touched_MB", "overhead_MB", "budget_MB", "pass", "smaps"}

weights: the bytes of the engine's files other than config.json and the tokenizer (the ONNX graph and its
external data). kv_pool and kv_touched come from the server's /metrics: the pool it allocated
(engine:kv_cache_pool_bytes) and the part of it whose blocks have held KV since start
(engine:kv_cache_touched_bytes). RSS counts only touched pages and the pool's pages are mapped on first write, so
overhead = peak RSS - weights - kv_touched is what the server costs beyond its data, which the goal bounds by
300 MB. Linux only (/proc).
"""
from __future__ import annotations

import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MB = 1 << 20
GOAL_OVERHEAD_MB = 300
NOT_WEIGHTS = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "generation_config.json", "special_tokens_map.json")


def _status_kb(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def _file_rss(pid: int) -> dict[str, int]:
    """Resident bytes of each file mapped into the process (/proc/PID/smaps), largest first."""
    out, path = {}, None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = re.match(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \d+\s*(.*)$", line)
        if head:
            path = head.group(1) if head.group(1).startswith("/") else None
        elif line.startswith("Rss:") and path:
            out[path] = out.get(path, 0) + int(line.split()[1]) * 1024
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _kv_gauges(url: str) -> tuple[float, float]:
    """(pool bytes, touched bytes) from the server's /metrics."""
    values = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
              for s in fam.samples}
    return values["engine:kv_cache_pool_bytes"], values["engine:kv_cache_touched_bytes"]


def server_memory(pid: int, url: str, engine_dir: Path) -> dict:
    weights = sum(f.stat().st_size for f in Path(engine_dir).iterdir() if f.is_file() and f.name not in NOT_WEIGHTS)
    pool, touched = _kv_gauges(url)
    rss, peak = _status_kb(pid, "VmRSS") * 1024, _status_kb(pid, "VmHWM") * 1024
    top_files = list(_file_rss(pid).items())[:5]
    return {"rss_MB": round(rss / MB, 1), "peak_rss_MB": round(peak / MB, 1), "weights_MB": round(weights / MB, 1),
            "kv_pool_MB": round(pool / MB, 1), "kv_touched_MB": round(touched / MB, 1),
            "overhead_MB": round((peak - weights - touched) / MB, 1),
            "budget_MB": round((weights + pool) / MB + GOAL_OVERHEAD_MB, 1),
            "pass": peak <= weights + pool + GOAL_OVERHEAD_MB * MB,
            "smaps": {"file_rss_MB": {p: round(b / MB, 1) for p, b in top_files}}}
