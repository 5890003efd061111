"""Serving-memory goal: the `engine serve` process's RSS <= engine weights + KV pool + 300 MB (bench/serve.py).

    server_memory(pid, engine_dir, kv_tokens) -> {"rss_MB", "peak_rss_MB", "weights_MB", "kv_pool_MB",
                                                  "kv_touched_MB", "overhead_MB", "budget_MB", "pass", "smaps"}

weights: the bytes of the engine's files other than config.json and the tokenizer (the ONNX graph and its
external data). kv_pool: the pool the server allocated for --max-kv-tokens (blocks x the memory plan's bytes per
block). RSS counts only touched pages, and the pool is zeroed lazily by the kernel, so kv_touched (the resident
part of the pool's mappings: the anonymous mappings exactly one layer's K or V array long) is reported too;
overhead = peak RSS - weights - kv_touched is what the server costs beyond its data, which the goal bounds by
300 MB. Linux only (/proc).
"""
from __future__ import annotations

import re
from pathlib import Path

MB = 1 << 20
GOAL_OVERHEAD_MB = 300
NOT_WEIGHTS = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
               "generation_config.json", "special_tokens_map.json")


def _status_kb(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def _mappings(pid: int) -> list[dict]:
    """Each mapping of /proc/PID/smaps: its size, resident bytes and path ("" for anonymous)."""
    maps, cur = [], None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \d+\s*(.*)$", line)
        if head:
            cur = {"size": int(head.group(2), 16) - int(head.group(1), 16), "path": head.group(3), "rss": 0}
            maps.append(cur)
        elif line.startswith("Rss:") and cur is not None:
            cur["rss"] = int(line.split()[1]) * 1024
    return maps


def server_memory(pid: int, engine_dir: Path, kv_tokens: int) -> dict:
    from engine.runtime.engine_dir import load_engine_config
    from engine.runtime.kv_budget import kv_bytes_per_block

    engine_dir = Path(engine_dir)
    config = load_engine_config(engine_dir)
    tpb, m = config.build.tokens_per_block, config.model
    blocks = -(-kv_tokens // tpb)
    pool = blocks * kv_bytes_per_block(config)
    one_array = pool // (2 * m.num_layers)           # one layer's K (or V) pool
    weights = sum(f.stat().st_size for f in engine_dir.iterdir() if f.is_file() and f.name not in NOT_WEIGHTS)
    maps = _mappings(pid)
    page = 4096
    kv_maps = [x for x in maps if not x["path"] and one_array <= x["size"] <= one_array + 2 * page]
    kv_touched = sum(x["rss"] for x in kv_maps)
    file_rss = {}
    for x in maps:
        if x["path"].startswith("/"):
            file_rss[x["path"]] = file_rss.get(x["path"], 0) + x["rss"]
    anon = sum(x["rss"] for x in maps if not x["path"] or x["path"].startswith("["))
    rss, peak = _status_kb(pid, "VmRSS") * 1024, _status_kb(pid, "VmHWM") * 1024
    overhead = peak - weights - kv_touched
    top_files = sorted(file_rss.items(), key=lambda kv: -kv[1])[:5]
    return {"rss_MB": round(rss / MB, 1), "peak_rss_MB": round(peak / MB, 1), "weights_MB": round(weights / MB, 1),
            "kv_pool_MB": round(pool / MB, 1), "kv_pool_arrays_found": len(kv_maps),
            "kv_pool_arrays_expected": 2 * m.num_layers,   # more found: another mapping of the same size counted
            "kv_touched_MB": round(kv_touched / MB, 1), "overhead_MB": round(overhead / MB, 1),
            "budget_MB": round((weights + pool) / MB + GOAL_OVERHEAD_MB, 1),
            "pass": peak <= weights + pool + GOAL_OVERHEAD_MB * MB,
            "smaps": {"anonymous_rss_MB": round(anon / MB, 1),
                      "file_rss_MB": {p: round(b / MB, 1) for p, b in top_files}}}
