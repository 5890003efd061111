"""bench/charts.py: which figures it takes from each kind of results file, and that the charts are drawn."""
from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")
from bench import charts  # noqa: E402

SETTINGS = {"threads": 2, "prompt_len": 512, "new_tokens": 128}


def test_compare_rows_of_both_layouts():
    """compare.json: one record per system with both figures (the others, bandwidth or a failed step, left out);
    compare_MODEL.json: the alternating systems, each the median of its rounds."""
    single = {"records": [
        {"name": "bandwidth", "system": "memory bandwidth", "status": "ok", "read_GBps": 80.0},
        {"name": "engine-int4", "system": "engine", "status": "ok", "prefill_tok_s": 4000.0, "decode_tok_s": 400.0},
        {"name": "hf-fp32", "system": "transformers", "status": "failed"},
    ]}
    assert charts.compare_rows(single) == [("engine-int4", "engine", 4000.0, 400.0)]
    turns = [{"prefill_tok_s": p, "decode_tok_s": d} for p, d in ((100, 10), (300, 30), (200, 50))]
    alternating = {"records": [{"name": "alternating", "status": "ok", "systems": {
        "bandwidth": {"system": "memory bandwidth", "turns": [{"read_GBps": 9.0}]},
        "engine-gguf": {"system": "engine", "turns": turns}}}]}
    assert charts.compare_rows(alternating) == [("engine-gguf", "engine", 200, 30)]


def test_serve_points_of_both_layouts():
    clients = {"config": {"engine_dir": ".cache/e/int4", "concurrency": 8, "input_len": 128, "output_len": 64},
               "server_median": {"output_tok_s": 500.0, "ttft_p50_ms": 90.0, "ttft_p99_ms": 120.0},
               "baseline_median": {"output_tok_s": 550.0, "ttft_p50_ms": 80.0, "ttft_p99_ms": 100.0}}
    server, baseline = charts.serve_points("serve_a.json", clients)
    assert (server["series"], server["concurrency"], server["output_tok_s"]) == \
        ("engine serve int4, 128 in / 64 out", 8, 500.0)
    assert baseline["series"].startswith("LLM API (no HTTP) int4") and baseline["source"] == "serve_a.json"
    vs = {"config": {"streams": 32, "genai_batch": 8, "input_len": 128, "output_len": 128},
          "rows": [{"engine": "e/int4", "genai": "g/int4",
                    "engine_runs": [{"output_tok_s": x, "ttft_p50_ms": 1.0, "note": "n"} for x in (1.0, 3.0, 2.0)],
                    "genai_runs": [{"output_tok_s": 4.0}]}]}
    engine, genai = charts.serve_points("serve_vs_genai.json", vs)
    assert (engine["concurrency"], engine["output_tok_s"], "note" in engine) == (32, 2.0, False)
    assert (genai["concurrency"], genai["output_tok_s"]) == (8, 4.0) and "ttft_p50_ms" not in genai
    assert charts.serve_points("serve_memory.json", {"config": {"streams": 1}}) == []


def test_charts_are_drawn(tmp_path):
    result = {"settings": SETTINGS, "started": "2026-12-05T18:35:02", "records": [
        {"name": f"s{i}", "system": f"system {i % 3}", "status": "ok", "prefill_tok_s": 100.0 * i,
         "decode_tok_s": 10.0 * i} for i in range(1, 6)]}
    charts.compare_chart(result, "smollm2", "compare.json").savefig(tmp_path / "c.png")
    points = [{"series": "a $x$", "concurrency": c, "output_tok_s": 10.0 * c, "ttft_p50_ms": c, "ttft_p99_ms": 2 * c,
               "source": "serve_a.json"} for c in (1, 4, 4, 32)]
    charts.serve_chart(points).savefig(tmp_path / "s.png")
    assert (tmp_path / "c.png").stat().st_size > 10_000 and (tmp_path / "s.png").stat().st_size > 10_000
    assert charts.compare_chart({"settings": SETTINGS, "records": []}, "m", "f") is None
    assert charts.serve_chart([]) is None
