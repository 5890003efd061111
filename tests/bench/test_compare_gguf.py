"""bench/compare_gguf.py and its report: the ratios are medians of per-round ratios, the floor is the round's
bandwidth over the bytes a decode step streams, and those bytes leave out the tables a step only gathers rows of."""
from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench import compare_gguf_report as report
from bench.compare_gguf import engine_streamed_bytes


def turn(prefill, decode, tokens=(1, 2, 3)):
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "cpu_threads_used": 2.0, "peak_rss_MB": 900.0,
            "first_tokens": list(tokens)}


def result(systems, records=()):
    alternating = {"name": "alternating", "status": "ok", "busy": False, "systems": systems}
    return {"settings": {"model": "qwen2.5-coder-0.5b", "gguf": "qwen.gguf", "threads": 2, "prompt_len": 512,
                         "new_tokens": 128, "rounds": 3, "prompt_ids": "ids"},
            "machine": {"cpu": "x"}, "versions": {"engine": "0.1.0"}, "records": [*records, alternating],
            "started": "a", "finished": "b", "wall_s": 1.0, "command": "python -m bench.compare"}


SYSTEMS = {
    "engine-gguf": {"system": "engine", "variant": "gguf", "streamed_bytes": {
        "weights": 990_000_000, "kv": 10_000_000, "total": 1_000_000_000, "gathered_not_streamed": 5,
        "kv_context": 576},
        "turns": [turn(300, 40), turn(330, 30), turn(270, 50, tokens=(1, 2, 4))]},
    "llamacpp-qwen": {"system": "llama.cpp", "variant": "qwen.gguf",
                      "turns": [turn(150, 20), turn(150, 20), turn(150, 25)]},
    "ortgenai-int4": {"system": "onnxruntime-genai", "variant": "int4",
                      "turns": [turn(200, 40), turn(200, 40), turn(200, 40)]},
    "bandwidth": {"system": "memory bandwidth", "variant": "2 GiB",
                  "turns": [{"read_GBps": 40.0}, {"read_GBps": 60.0}, {"read_GBps": 50.0}]},
}


def test_ratios_are_medians_of_the_rounds_and_the_floor_is_each_rounds_bandwidth():
    rows = {g["goal"]: g for g in report.goals(result(SYSTEMS))}
    assert rows["decode b=1: engine-gguf / llamacpp-qwen"]["value"] == 2.0            # 2.0, 1.5, 2.0
    assert rows["decode b=1: engine-gguf / ortgenai-int4"]["value"] == 1.0            # 1.0, 0.75, 1.25
    assert rows["prefill 512: engine-gguf / llamacpp-qwen"]["value"] == 2.0           # 2.0, 2.2, 1.8
    floor = rows["decode b=1: engine-gguf / its bandwidth floor (1000 MB a step)"]
    assert floor["value"] == 1.0 and "1.00, 0.50, 1.00" in floor["measured"]         # 40/40, 30/60, 50/50


def test_markdown_lists_systems_and_what_did_not_run():
    res = result(SYSTEMS, [{"name": "llamacpp-x", "status": "not installed", "note": "llama-cpp-python is not "
                            "installed"}])
    res["goals"] = report.goals(res)
    text = report.markdown(res)
    assert "| engine-gguf | engine | gguf | 300.0 | 40.00 | 40, 30, 50 | 900.0 | 2.00 | 2/3 |" in text
    assert "read GB/s: 40, 60, 50" in text and "**1000.0 MB a decode step**" in text
    assert "- `llamacpp-x`: not installed (llama-cpp-python is not installed)" in text
    assert report.goals(result({}))[0]["result"] == "not measured"


def test_streamed_bytes_leave_out_the_gathered_tables(tmp_path):
    """The embedding table only a Gather reads and the rotary tables are read a row at a time; lm_head streams."""
    tables = {"vocab_embedding.weight": np.ones((64, 8), np.float32), "lm_head.weight": np.ones((8, 64), np.float32),
              "rotary.cos_cache": np.ones((32, 4), np.float32)}
    nodes = [helper.make_node("Gather", ["vocab_embedding.weight", "ids"], ["h"]),
             helper.make_node("MatMul", ["h", "lm_head.weight"], ["logits"]),
             helper.make_node("Identity", ["rotary.cos_cache"], ["cos"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 64]),
                               helper.make_tensor_value_info("cos", TensorProto.FLOAT, [32, 4])],
                              [numpy_helper.from_array(a, n) for n, a in tables.items()])
    onnx.save(helper.make_model(graph), str(tmp_path / "rank0.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="rank0.onnx.data", size_threshold=0)
    (tmp_path / "config.json").write_text(json.dumps({"memory": {"kv_bytes_per_token": 100}}))
    got = engine_streamed_bytes(tmp_path, context=10)
    assert got == {"weights": 8 * 64 * 4, "kv": 1000, "total": 8 * 64 * 4 + 1000,
                   "gathered_not_streamed": (64 * 8 + 32 * 4) * 4, "kv_context": 10}
