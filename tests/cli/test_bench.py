"""`engine bench` on a tiny engine, in a subprocess: tables, the JSON report, --json, and clean errors."""
import json
from pathlib import Path

import pytest

from tests.cli.engine_cli import assert_one_line_error, engine_cmd
from tests.runtime.tiny_engine import build_tiny_engine


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    return build_tiny_engine(tmp_path_factory.mktemp("cli_bench"))[1]


def bench(engine_dir, *args, check_rc=0):
    return engine_cmd("bench", engine_dir, *args, check_rc=check_rc)


def test_throughput_table_and_report(engine_dir, tmp_path):
    report = tmp_path / "report.json"
    r = bench(engine_dir, "--num-requests", "6", "--input-len", "12", "--output-len", "5", "--concurrency", "3",
              "--warmup", "1", "--threads", "1", "--report-json", str(report))
    for needle in ("engine bench: throughput", "request throughput", "output throughput", "prefill per request",
                   "decode per request", "peak RSS", "TTFT", "TPOT", "ITL", "P50", "P99", "72 / 30"):
        assert needle in r.stdout, (needle, r.stdout)
    doc = json.loads(report.read_text())
    assert doc["mode"] == "throughput" and doc["dataset"] == "synthetic"
    assert doc["config"] == {"mode": "throughput", "concurrency": 3, "warmup": 1, "seed": 0}
    s = doc["summary"]
    assert (s["num_requests"], s["total_input_tokens"], s["total_output_tokens"]) == (6, 72, 30)
    assert s["itl_ms"]["count"] == 6 * 4 and s["tpot_ms"]["count"] == 6
    assert [q["output_tokens"] for q in doc["requests"]] == [5] * 6
    assert not [p for p in tmp_path.iterdir() if p.name != "report.json"]   # no temporary file left behind


def test_speculation_counts_in_the_report(engine_dir, tmp_path):
    data = tmp_path / "requests.jsonl"   # prompts that repeat themselves, so prompt lookup finds matches
    data.write_text("".join(json.dumps({"input_ids": [5, 6, 7, 8] * 4 + [i + 9], "output_len": 20}) + "\n"
                            for i in range(3)))
    report = tmp_path / "report.json"
    r = bench(engine_dir, "--dataset", str(data), "--mode", "latency", "--warmup", "0", "--speculative", "ngram",
              "--prompt-lookup-min", "1", "--report-json", str(report))
    sp = json.loads(report.read_text())["counters"]["speculation"]
    assert sp["num_drafts"] > 0 and sp["num_draft_tokens"] >= sp["num_accepted_tokens"] > 0
    assert sum(sp["accepted_per_pos"]) == sp["num_accepted_tokens"]
    assert "mean acceptance length" in r.stdout


def test_latency_json_on_stdout_with_a_jsonl_dataset(engine_dir, tmp_path):
    data = tmp_path / "requests.jsonl"
    data.write_text('{"prompt": "The capital of France is", "output_len": 4}\n'
                    '{"input_ids": [5, 6, 7, 8, 9], "output_tokens": 6}\n'
                    '{"prompt": "Hello"}\n')
    r = bench(engine_dir, "--mode", "latency", "--dataset", str(data), "--output-len", "3", "--json",
              "--warmup", "0")
    doc = json.loads(r.stdout)       # one JSON document, nothing else on stdout
    assert doc["command"] == "bench" and doc["ok"] is True
    assert doc["mode"] == "latency" and doc["config"]["concurrency"] == 1 and doc["dataset"] == str(data)
    assert [q["output_tokens"] for q in doc["requests"]] == [4, 6, 3]
    assert doc["requests"][1]["input_tokens"] == 5
    assert doc["summary"]["total_output_tokens"] == 13
    assert doc["counters"]["steps"] == 13       # batch 1, short prompts: one step per output token


@pytest.mark.parametrize("args, rc, needles", [
    (["--num-requests", "0"], 2, ["--num-requests 0 must be an integer >= 1"]),
    (["--output-len", "-3"], 2, ["--output-len -3 must be an integer >= 1"]),
    (["--input-len", "40", "--output-len", "30"], 2, ["--input-len 40 + --output-len 30 = 70", "max_seq_len 64"]),
    (["--mode", "fast"], 2, ["--mode 'fast' must be one of throughput, latency"]),
    (["--mode", "latency", "--concurrency", "4"], 2, ["--concurrency 4 does not apply to --mode latency"]),
    (["--concurrency", "0"], 2, ["--concurrency 0 must be an integer >= 1"]),
    (["--warmup", "-1"], 2, ["--warmup -1 must be an integer >= 0"]),
    (["--dataset", "/nonexistent/requests.jsonl"], 1, ["cannot read --dataset /nonexistent/requests.jsonl"]),
    (["--report-json", "/nonexistent/dir/r.json"], 2, ["--report-json", "does not exist"]),
    (["--max-batch-size", "9", "--input-len", "8", "--output-len", "4"], 2, ["--max-batch-size 9 is outside [1, 8]"]),
])
def test_bad_flags_give_one_clean_line(engine_dir, args, rc, needles):
    assert_one_line_error(bench(engine_dir, *args, check_rc=rc), *needles)


def test_bad_dataset_lines(engine_dir, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "ok"}\n{"prompt": "ok", "output_len": 100}\n')
    assert_one_line_error(bench(engine_dir, "--dataset", str(data), "--output-len", "4", check_rc=1),
                          "line 2 of", "exceeds the engine's max_seq_len 64")
    data.write_text('{"prompt": "ok"}\n\n{"prompt": \n')
    assert_one_line_error(bench(engine_dir, "--dataset", str(data), check_rc=1), "line 3 of", "is not valid JSON")
    assert_one_line_error(bench(engine_dir, "--dataset", str(data), "--input-len", "8", check_rc=2),
                          "--input-len applies to --dataset synthetic only")


def test_help_defaults_are_the_runtime_defaults():
    from engine.cli import bench as cli_bench
    from engine.runtime.benchmark import dataset as bench_dataset
    assert cli_bench.DEFAULT_SYNTHETIC_REQUESTS == bench_dataset.DEFAULT_SYNTHETIC_REQUESTS
    assert cli_bench.DEFAULT_INPUT_LEN == bench_dataset.DEFAULT_INPUT_LEN


def test_report_write_is_atomic(tmp_path):
    from engine.cli.bench import write_json_atomic
    from engine.core.errors import EngineError
    target = tmp_path / "r.json"
    target.write_text("old")
    write_json_atomic(target, {"a": [1, 2]})
    assert json.loads(target.read_text()) == {"a": [1, 2]}
    (tmp_path / "adir").mkdir()
    with pytest.raises(EngineError, match="cannot write --report-json .*adir: Is a directory"):
        write_json_atomic(tmp_path / "adir", {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "r.json"]   # no temporary file left
