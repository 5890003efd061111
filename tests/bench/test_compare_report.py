"""bench/compare_report.py: the goal arithmetic and the report of the side-by-side benchmark (no timing here)."""
from __future__ import annotations

from bench import compare_report as report

SMOLLM2 = {"hidden_size": 576, "head_dim": 64, "num_heads": 9, "num_kv_heads": 3, "intermediate_size": 1536,
           "num_layers": 30, "vocab_size": 49152}


def throughput(name, prefill, decode, tokens=(1, 2, 3), busy=False):
    return {"name": name, "system": "s", "variant": "v", "status": "ok", "prefill_tok_s": prefill,
            "decode_tok_s": decode, "prefill_runs": [0.5], "decode_runs": [1.0], "first_tokens": list(tokens),
            "cpu_threads_used": 2.0, "peak_rss_MB": 100.0, "load_before": 0.1, "load_after": 2.0, "busy": busy}


def result(records):
    return {"settings": {"threads": 2, "prompt_len": 512, "new_tokens": 128, "repeats": 3, "busy_load": 2.5},
            "machine": {"cpu": "x"}, "versions": {"engine": "0.1.0", "llama-cpp-python": None},
            "model": SMOLLM2, "records": records, "started": "a", "finished": "b", "wall_s": 1.0,
            "command": "python -m bench.compare"}


def test_weight_bytes_per_token_matches_the_anchor_count():
    # bench/anchors/README.md: 134.48 M parameters streamed per token (30 x 3.54 M + 28.3 M lm_head).
    assert report.weight_bytes_per_token(SMOLLM2) == 134_479_872 * 4


def test_goals_pass_miss_and_not_measured():
    res = result([
        throughput("engine-int4", 600, 170), throughput("ortgenai-int4", 550, 110),      # 1.545x: pass
        throughput("engine-int8", 900, 100), throughput("ortgenai-int8", 680, 80),       # 1.25x: miss
        throughput("engine-fp32", 800, 41, busy=True), throughput("hf-bf16", 700, 20),
        {"name": "bandwidth", "status": "ok", "read_GBps": 24.0, "load_before": 0, "load_after": 0},
        {"name": "coldstart-int8", "status": "ok", "first_token_s": 0.8},
        {"name": "coldstart-fp32", "status": "ok", "first_token_s": 1.2},
        {"name": "build-int8", "status": "failed", "note": "boom"},
    ])
    goals = {g["goal"]: g for g in report.goals(res)}
    int4 = goals["decode b=1: engine int4 (default build: lm_head int8, KV float16) vs onnxruntime-genai int4"]
    assert (int4["result"], int4["value"]) == ("pass", round(170 / 110, 3))
    assert goals["decode b=1: engine int8 (default build: lm_head int8, KV float16) vs onnxruntime-genai int8"][
        "result"] == "miss"
    assert goals["  same, engine int4 with lm_head fp32 and KV float32 (the defaults before)"]["result"] == \
        "not measured"
    assert goals["  same, engine int4 with lm_head int4 too, KV float32 (like-for-like)"]["result"] == "not measured"
    assert goals["  same, engine int4 with lm_head bf16, KV float16"]["result"] == "not measured"
    prefill = goals["prefill 512: best engine (engine-int8) vs transformers bf16"]
    assert prefill["result"] == "pass" and prefill["value"] == round(900 / 700, 3)
    floor = goals["fp32 decode b=1 vs bandwidth floor"]
    floor_tok_s = 24e9 / (134_479_872 * 4)                       # 44.6 tok/s
    assert floor["value"] == round(41 / floor_tok_s, 3) and floor["result"] == "pass" and floor["busy"]
    cold = goals["cold start: process start -> first token (slowest variant)"]
    assert cold["result"] == "miss" and "coldstart-fp32" in cold["measured"]
    assert goals["convert + int8 build of SmolLM2"]["result"] == "not measured"


def test_markdown_names_busy_steps_and_missing_peers():
    res = result([throughput("engine-int4", 600, 170, tokens=(5, 6, 7)), throughput("hf-fp32", 900, 22, tokens=(5, 6, 8)),
                  {"name": "llamacpp-x", "system": "llama.cpp", "variant": "x.gguf", "status": "not installed",
                   "note": "llama-cpp-python is not installed"}])
    res["records"][0]["busy"] = True
    res["goals"] = report.goals(res)
    text = report.markdown(res)
    assert "Warning: the machine was busy" in text and "engine-int4" in text.split("Warning")[1].split("\n")[0]
    assert "| llamacpp-x | llama.cpp | x.gguf | not installed |" in text
    assert "| 2/3 |" in text                 # two leading tokens agree with transformers fp32
    assert "| engine-int4 | 7.73 |" in text and "| engine-int4 | 0.67 |" in text   # decode, prefill vs hf-fp32


def test_alternating_rounds_decide_the_decode_goals():
    """Where compare.py ran the alternating rounds, the goal is the median of the per-round ratios (here 1.40x
    although the single steps, minutes apart, read 170 / 110 = 1.55x); the single steps stay as a sub-row."""
    res = result([
        throughput("engine-int4", 600, 170), throughput("ortgenai-int4", 550, 110),
        {"name": "alternating-int4", "status": "ok", "a": [140.0, 150.0, 120.0], "b": [100.0, 100.0, 100.0],
         "a_key": "decode_tok_s", "b_key": "decode_tok_s", "load_before": 0, "load_after": 0},
        throughput("engine-fp32", 800, 40),
        {"name": "bandwidth", "status": "ok", "read_GBps": 24.0, "copy_GBps": 12.0, "load_before": 0, "load_after": 0},
        {"name": "alternating-fp32-floor", "status": "ok", "a": [40.0, 36.0, 44.0], "b": [24.0, 20.0, 30.0],
         "a_key": "decode_tok_s", "b_key": "read_GBps", "load_before": 0, "load_after": 0},
    ])
    goals = {g["goal"]: g for g in report.goals(res)}
    int4 = goals["decode b=1: engine int4 (default build: lm_head int8, KV float16) vs onnxruntime-genai int4"]
    assert (int4["result"], int4["value"]) == ("miss", 1.4) and "median 1.40x" in int4["measured"]
    single = [g for g in report.goals(res) if g["goal"] == "  same, the single steps above"]
    assert single[0]["value"] == round(170 / 110, 3)
    floor = goals["fp32 decode b=1 vs bandwidth floor"]
    per_round = sorted(a / (b * 1e9 / (134_479_872 * 4)) for a, b in ((40, 24), (36, 20), (44, 30)))
    assert floor["value"] == round(per_round[1], 3)
    # no alternating step for int8: its goal is the single steps', under the goal's own name
    assert "decode b=1: engine int8 (default build: lm_head int8, KV float16) vs onnxruntime-genai int8" in goals
    res["goals"] = report.goals(res)
    assert "median 1.40x" in report.markdown(res)   # the rounds are no row of the throughput table


def serve_record(engine_tok_s, genai_tok_s, peak_mb, budget_mb, name="serve-int4", stream_interval=1):
    run = {"ttft_p50_ms": 900.0, "ttft_p99_ms": 1200.0, "tpot_p50_ms": 40.0, "tpot_p99_ms": 45.0,
           "itl_p50_ms": 39.0, "itl_p99_ms": 60.0}
    ratios = [a / b for a, b in zip(engine_tok_s, genai_tok_s)]
    return {"name": name, "system": "engine serve vs onnxruntime-genai", "variant": "engine-int4, 32 streams",
            "status": "ok", "engine_runs": [{"output_tok_s": x, **run} for x in engine_tok_s],
            "genai_runs": [{"output_tok_s": x} for x in genai_tok_s], "ratios": ratios,
            "ratio": sorted(ratios)[len(ratios) // 2], "load_before": 0, "load_after": 0,
            "stream_interval": stream_interval,
            "server_memory": {"rss_MB": peak_mb - 10, "peak_rss_MB": peak_mb, "weights_MB": 100.0, "kv_pool_MB": 120.0,
                              "kv_touched_MB": 80.0, "overhead_MB": peak_mb - 180.0, "budget_MB": budget_mb,
                              "pass": peak_mb <= budget_mb}}


def test_serving_goals_from_the_serve_step():
    """The serving goal is the median per-round ratio of output tokens/s (3.1x here: 620/200, 700/210, 560/190
    sorted 2.95, 3.10, 3.33) and the memory goal the server's peak RSS against its budget; both 'not measured'
    without the step."""
    goals = {g["goal"]: g for g in report.goals(result([]))}
    serve = "32 concurrent streams through engine serve (engine int4) vs onnxruntime-genai int4 at batch 8, output tok/s"
    memory = "serving memory: engine serve's peak RSS after those streams"
    assert goals[serve]["result"] == goals[memory]["result"] == "not measured"
    res = result([serve_record([620.0, 700.0, 560.0], [200.0, 210.0, 190.0], peak_mb=450.0, budget_mb=520.0)])
    goals = {g["goal"]: g for g in report.goals(res)}
    assert (goals[serve]["result"], goals[serve]["value"]) == ("pass", 3.1) and "median 3.10x" in goals[serve]["measured"]
    assert goals[memory]["result"] == "pass" and "KV touched 80.0 (pool 120.0)" in goals[memory]["measured"]
    res = result([serve_record([500.0], [200.0], peak_mb=600.0, budget_mb=520.0)])
    goals = {g["goal"]: g for g in report.goals(res)}
    assert goals[serve]["result"] == goals[memory]["result"] == "miss"
    res["goals"] = report.goals(res)
    text = report.markdown(res)
    assert "## Serving" in text and "| 1 | 500.0 | 900 / 1200 | 40.0 / 45.0 | 39.0 / 60.0 | 200.0 | 2.50 |" in text
    assert "| serve-int4 |" not in text        # no row of the batch-1 throughput table


def test_the_stream_interval_row_is_its_own_and_the_default_stays_the_goal():
    """serve-int4-interval8 (engine serve --stream-interval 8) adds a row of its own: the default server's row
    keeps its figure and result, and each step gets its own table in the Serving section."""
    serve = "32 concurrent streams through engine serve (engine int4) vs onnxruntime-genai int4 at batch 8, output tok/s"
    interval8 = serve + ", engine serve --stream-interval 8 (an SSE chunk every 8 tokens)"
    res = result([serve_record([580.0], [200.0], peak_mb=450.0, budget_mb=520.0),
                  serve_record([640.0], [200.0], peak_mb=455.0, budget_mb=520.0, name="serve-int4-interval8",
                               stream_interval=8)])
    goals = {g["goal"]: g for g in report.goals(res)}
    assert (goals[serve]["result"], goals[serve]["value"]) == ("miss", 2.9)
    assert (goals[interval8]["result"], goals[interval8]["value"]) == ("pass", 3.2)
    assert goals["serving memory: engine serve's peak RSS after those streams"]["measured"].startswith("450.0 MB")
    res["goals"] = report.goals(res)
    text = report.markdown(res)
    assert "### serve-int4\n" in text and "### serve-int4-interval8\n" in text
    assert "| 1 | 640.0 | 900 / 1200 | 40.0 / 45.0 | 39.0 / 60.0 | 200.0 | 3.20 |" in text
    assert "| serve-int4-interval8 |" not in text
