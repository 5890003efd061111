"""runtime/benchmark/ (runner.py, dataset.py and stats.py): statistics on known timestamps, datasets and their
errors, and both modes on the tiny engine (counts, batch shapes, the JSON report)."""
import json
import subprocess
import sys

import numpy as np
import pytest

from engine.core.engine_format import BuildConfig
from engine.core.errors import EngineError
from engine.core.serde import to_json
from engine.runtime.benchmark.dataset import (BenchRequest, check_requests_fit, check_synthetic_fits,
                                              read_jsonl_requests, synthetic_requests)
from engine.runtime.benchmark.runner import BenchConfig, run_benchmark
from engine.runtime.benchmark.stats import RequestTiming, distribution_ms, summarize


# ---- statistics on known timestamps ----------------------------------------------------------------------------

def test_summary_on_known_timestamps():
    a = RequestTiming(input_tokens=10, start=0.0, token_times=(0.100, 0.150, 0.250, 0.300))  # gaps 50, 100, 50 ms
    b = RequestTiming(input_tokens=30, start=0.050, token_times=(0.250, 0.260, 0.280))       # gaps 10, 20 ms
    s = summarize([a, b], duration_s=0.5)
    assert (s.num_requests, s.total_input_tokens, s.total_output_tokens) == (2, 40, 7)
    assert s.request_throughput == pytest.approx(4.0)
    assert s.output_tokens_per_s == pytest.approx(14.0)
    assert s.total_tokens_per_s == pytest.approx(94.0)
    assert s.prefill_tokens_per_s == pytest.approx(40 / (0.100 + 0.200))
    assert s.decode_tokens_per_s == pytest.approx((3 + 2) / (0.200 + 0.030))
    # TTFT 100, 200 ms: mean 150, linear-interpolated P50 150, P90 = 100 + 0.9 * 100, P99 = 100 + 0.99 * 100.
    t = s.ttft_ms
    assert (t.mean, t.min, t.p50, t.p90, t.p99, t.max, t.count) == pytest.approx((150, 100, 150, 190, 199, 200, 2))
    # TPOT per request: 200 / 3 and 30 / 2 ms.
    assert (s.tpot_ms.min, s.tpot_ms.max, s.tpot_ms.count) == pytest.approx((15, 200 / 3, 2))
    # ITL pooled: sorted 10 20 50 50 100; P50 is the middle one; P90 at rank 3.6 -> 50 + 0.6 * 50;
    # P99 at rank 3.96 -> 50 + 0.96 * 50.
    i = s.itl_ms
    assert (i.mean, i.min, i.p50, i.p90, i.p99, i.max, i.count) == pytest.approx((46, 10, 50, 80, 98, 100, 5))
    assert (s.e2e_latency_ms.min, s.e2e_latency_ms.max) == pytest.approx((230, 300))


def test_one_token_requests_have_no_tpot_or_itl():
    s = summarize([RequestTiming(4, 0.0, (0.01,)), RequestTiming(4, 0.0, (0.02,))], duration_s=0.02)
    assert s.tpot_ms is None and s.itl_ms is None and s.decode_tokens_per_s is None
    assert s.ttft_ms.p50 == pytest.approx(15.0)
    assert distribution_ms([]) is None


# ---- datasets --------------------------------------------------------------------------------------------------

def test_synthetic_requests_are_seeded_exact_and_avoid_special_ids():
    a = synthetic_requests(5, 12, 7, vocab_size=20, exclude_ids={0, 1, 2}, seed=3)
    assert a == synthetic_requests(5, 12, 7, vocab_size=20, exclude_ids={0, 1, 2}, seed=3)
    assert a != synthetic_requests(5, 12, 7, vocab_size=20, exclude_ids={0, 1, 2}, seed=4)
    assert all(len(r.prompt_token_ids) == 12 and r.output_len == 7 for r in a)
    ids = {t for r in a for t in r.prompt_token_ids}
    assert ids <= set(range(3, 20)) and len(ids) > 5
    with pytest.raises(EngineError, match="--num-requests 0 must be an integer >= 1") as e:
        synthetic_requests(0, 12, 7, vocab_size=20)
    assert e.value.usage


def test_jsonl_dataset(tiny_tok_dir, tmp_path):
    from engine.runtime import Tokenizer
    tok = Tokenizer(tiny_tok_dir)
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "hello world", "output_len": 5}\n\n'
                 '{"input_ids": [4, 5, 6], "output_tokens": 9, "task_id": 1}\n'
                 '{"prompt": "the end"}\n')
    reqs = read_jsonl_requests(f, tok, output_len=11)
    assert [r.prompt_token_ids for r in reqs] == [tuple(tok.encode("hello world")), (4, 5, 6),
                                                  tuple(tok.encode("the end"))]
    assert [r.output_len for r in reqs] == [5, 9, 11]
    assert reqs[1].where == f"line 3 of {f}"
    assert len(read_jsonl_requests(f, tok, output_len=11, num_requests=2)) == 2
    with pytest.raises(EngineError, match="--num-requests 4 is more than the 3 requests"):
        read_jsonl_requests(f, tok, output_len=11, num_requests=4)


@pytest.mark.parametrize("line, needle", [
    ('{"prompt": "a"', "line 2 of .* is not valid JSON"),
    ('[1, 2]', "line 2 of .* is a JSON list, not an object"),
    ('{"prompt": "a", "input_ids": [1]}', 'line 2 of .* exactly one of "prompt"'),
    ('{"promt": "a"}', r"line 2 of .* unknown key\(s\) \['promt'\]"),
    ('{"prompt": "a", "output_len": 0}', "line 2 of .* output length 0 must be an integer >= 1"),
    ('{"input_ids": [1, -2]}', 'line 2 of .* "input_ids" must be a non-empty list'),
    ('{"prompt": ""}', 'line 2 of .* "prompt" must be a non-empty string'),
])
def test_bad_jsonl_lines_name_the_line(tiny_tok_dir, tmp_path, line, needle):
    from engine.runtime import Tokenizer
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(EngineError, match=needle):
        read_jsonl_requests(f, Tokenizer(tiny_tok_dir), output_len=4)


def test_unreadable_or_empty_dataset(tiny_tok_dir, tmp_path):
    from engine.runtime import Tokenizer
    tok = Tokenizer(tiny_tok_dir)
    with pytest.raises(EngineError, match="cannot read --dataset .*missing.jsonl: No such file"):
        read_jsonl_requests(tmp_path / "missing.jsonl", tok, output_len=4)
    (tmp_path / "bin.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(EngineError, match="cannot read --dataset"):
        read_jsonl_requests(tmp_path / "bin.jsonl", tok, output_len=4)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(EngineError, match="holds no requests"):
        read_jsonl_requests(tmp_path / "empty.jsonl", tok, output_len=4)


def test_limits_name_the_engine_limit():
    build = BuildConfig(max_input_len=48, max_seq_len=64)
    check_synthetic_fits(48, 16, build)
    with pytest.raises(EngineError, match="--input-len 40 \\+ --output-len 30 = 70 exceeds the engine's "
                                          "max_seq_len 64") as e:
        check_synthetic_fits(40, 30, build)
    assert e.value.usage
    with pytest.raises(EngineError, match="--input-len 49 is more than the engine's prompt limit of 48"):
        check_synthetic_fits(49, 1, build)
    with pytest.raises(EngineError, match="line 7: 40 prompt tokens \\+ 30 output tokens = 70 exceeds the engine's "
                                          "max_seq_len 64"):
        check_requests_fit([BenchRequest((1,) * 40, 30, "line 7")], build, vocab_size=100)
    with pytest.raises(EngineError, match="line 8: the prompt has 49 tokens, more than the engine's limit of 48"):
        check_requests_fit([BenchRequest((1,) * 49, 1, "line 8")], build, vocab_size=100)
    with pytest.raises(EngineError, match=r"line 2: token id 100 is outside the vocabulary \[0, 100\)"):
        check_requests_fit([BenchRequest((1, 100), 2, "line 2")], build, vocab_size=100)


def test_config_validation():
    assert BenchConfig(mode="latency").concurrency == 1
    for kwargs, needle in ((dict(mode="speed"), "--mode 'speed' must be one of throughput, latency"),
                           (dict(concurrency=0), "--concurrency 0 must be an integer >= 1"),
                           (dict(mode="latency", concurrency=4), "--concurrency 4 does not apply to --mode latency"),
                           (dict(warmup=-1), "--warmup -1 must be an integer >= 0")):
        with pytest.raises(EngineError, match=needle) as e:
            BenchConfig(**kwargs)
        assert e.value.usage


# ---- both modes on the tiny engine ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_engine):
    from engine.runtime import LLM
    llm = LLM(tiny_engine[1], max_kv_tokens=512)
    yield llm
    llm.close()


def _requests(llm, n, input_len, output_len, seed=0):
    return synthetic_requests(n, input_len, output_len, vocab_size=llm.config.model.vocab_size, seed=seed)


def _check_counts(report, n, input_len, output_len):
    s = report.summary
    assert (s.num_requests, s.total_input_tokens, s.total_output_tokens) == (n, n * input_len, n * output_len)
    assert [(r.input_tokens, r.output_tokens) for r in report.requests] == [(input_len, output_len)] * n
    assert s.ttft_ms.count == s.tpot_ms.count == s.e2e_latency_ms.count == n
    assert s.itl_ms.count == n * (output_len - 1)
    assert 0 < s.ttft_ms.min <= s.ttft_ms.p50 <= s.ttft_ms.p99 <= s.ttft_ms.max
    assert all(r.ttft_ms < r.e2e_ms for r in report.requests)
    assert s.output_tokens_per_s == pytest.approx(n * output_len / s.duration_s)


def test_latency_mode_runs_one_request_at_a_time(llm):
    llm.core.stats.max_seqs_per_step = 0
    report = run_benchmark(llm, _requests(llm, 4, 16, 6), BenchConfig(mode="latency", warmup=1))
    _check_counts(report, 4, 16, 6)
    assert llm.core.stats.max_seqs_per_step == 1
    # 16 prompt tokens fit one step's budget (40): one prefill step, then one step per further token.
    assert report.counters.steps == 4 * 6
    assert report.counters.preemptions == 0 and report.counters.prefix_cache_hit_tokens == 0
    llm.check_all_free()


def test_throughput_mode_batches_and_respects_concurrency(llm):
    reqs = _requests(llm, 8, 16, 8, seed=1)
    report = run_benchmark(llm, reqs, BenchConfig(mode="throughput", warmup=0))
    _check_counts(report, 8, 16, 8)
    assert report.counters.steps < 8 * 8          # requests shared steps
    llm.core.stats.max_seqs_per_step = 0
    report = run_benchmark(llm, _requests(llm, 6, 16, 5, seed=2), BenchConfig(concurrency=2, warmup=2))
    _check_counts(report, 6, 16, 5)
    assert llm.core.stats.max_seqs_per_step == 2
    doc = json.loads(json.dumps(to_json(report)))
    assert doc["mode"] == "throughput" and doc["config"]["concurrency"] == 2
    assert doc["engine"]["max_seq_len"] == 64 and doc["memory"]["peak_rss_bytes"] > 0
    assert doc["memory"]["kv_cache_tokens"] == 512 and doc["host"]["cpu_count"] >= 1
    assert set(doc["summary"]["itl_ms"]) == {"mean", "min", "p50", "p90", "p99", "max", "count"}
    assert len(doc["requests"]) == 6
    llm.check_all_free()


def test_every_request_produces_output_len_tokens_past_eos(llm):
    from engine.runtime import SamplingParams
    saved = llm.core.eos_token_ids
    llm.core.eos_token_ids = frozenset(range(llm.config.model.vocab_size))   # every token is an eos
    try:
        reqs = _requests(llm, 3, 8, 7, seed=5)
        plain = llm.generate([list(r.prompt_token_ids) for r in reqs], SamplingParams(temperature=0, max_tokens=7))
        assert [o.num_generated_tokens for o in plain] == [1, 1, 1]     # without ignore_eos they stop at once
        report = run_benchmark(llm, reqs, BenchConfig(warmup=0))
    finally:
        llm.core.eos_token_ids = saved
    _check_counts(report, 3, 8, 7)
    assert np.all(np.array([r.output_tokens for r in report.requests]) == 7)


def test_benchmark_imports_no_torch(tiny_engine):
    """The benchmark is runtime code: measuring an ONNX Runtime engine must not pull torch in (runtime/ rule)."""
    code = (
        "import sys\n"
        "from engine.runtime import LLM\n"
        "from engine.runtime.benchmark.dataset import synthetic_requests\n"
        "from engine.runtime.benchmark.runner import BenchConfig, run_benchmark\n"
        f"llm = LLM({str(tiny_engine[1])!r}, max_kv_tokens=128)\n"
        "reqs = synthetic_requests(2, 4, 3, vocab_size=llm.config.model.vocab_size)\n"
        "report = run_benchmark(llm, reqs, BenchConfig(warmup=1))\n"
        "assert report.summary.total_output_tokens == 6, report.summary\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork + exec carrying ru_maxrss is Linux's")
def test_peak_rss_is_the_process_own_not_its_parents():
    """A process started by a parent holding 600 MB reports its own peak: Linux carries ru_maxrss across fork and
    exec, which made every child of a large benchmark driver read the driver's RSS."""
    child = "from engine.runtime.benchmark.runner import peak_rss_bytes; print(peak_rss_bytes())"
    parent = ("import subprocess, sys\n"
              "held = bytearray(600 * 2**20)\n"
              "for i in range(0, len(held), 4096): held[i] = 1\n"
              f"print(subprocess.run([sys.executable, '-c', {child!r}], capture_output=True, text=True,"
              " check=True).stdout)\n")
    r = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert 0 < int(r.stdout.split()[-1]) < 400 * 2**20
