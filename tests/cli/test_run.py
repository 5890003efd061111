"""`engine run` on a tiny engine, in a subprocess: outputs, streaming, chat, JSON, and clean errors."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.cli.engine_cli import ENGINE, assert_one_line_error, engine_cmd
from tests.runtime.tiny_engine import build_tiny_engine


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    return build_tiny_engine(tmp_path_factory.mktemp("cli_run"))[1]


def run(engine_dir, *args, check_rc=0):
    return engine_cmd("run", engine_dir, *args, check_rc=check_rc)


def test_batch_output_json_matches_the_python_api(engine_dir, tmp_path):
    from engine.runtime import LLM, SamplingParams
    out = tmp_path / "out.json"
    r = run(engine_dir, "--input-text", "The capital of France is", "--input-text", "Hello", "--max-output-len", "8",
            "--output-json", str(out))
    data = json.loads(out.read_text())
    llm = LLM(engine_dir, max_kv_tokens=512)
    want = llm.generate(["The capital of France is", "Hello"], SamplingParams(temperature=0, max_tokens=8))
    assert [d["token_ids"] for d in data] == [w.token_ids for w in want]
    assert [d["text"] for d in data] == [w.text for w in want]
    assert [d["prompt_tokens"] for d in data] == [w.num_prompt_tokens for w in want]
    for i, w in enumerate(want):
        assert f"Output [Text {i}]: {json.dumps(w.text, ensure_ascii=False)}" in r.stdout
    assert "TTFT (ms)" in r.stderr and "decode tok/s" in r.stderr and "time to first token" in r.stderr


def test_streaming_prints_the_same_text(engine_dir, tmp_path):
    out = tmp_path / "out.json"
    r = run(engine_dir, "--input-text", "naïve café", "--max-output-len", "12", "--streaming", "--output-json",
            str(out))
    assert r.stdout == json.loads(out.read_text())[0]["text"] + "\n"
    r = run(engine_dir, "--input-text", "one", "--input-text", "two", "--max-output-len", "6", "--streaming",
            "--output-json", str(out))
    texts = [d["text"] for d in json.loads(out.read_text())]
    lines = {0: [], 1: []}
    for line in r.stdout.splitlines():
        tag, sep, text = line.partition("] ")
        assert sep and tag in ("[0", "[1"), line
        lines[int(tag[1:])].append(text)
    for i, text in enumerate(texts):
        assert "\n".join(lines[i]) == text.removesuffix("\n")


def test_chat_input_file_stop_and_sampling(engine_dir, tmp_path):
    from engine.runtime import Tokenizer
    f = tmp_path / "prompts.txt"
    f.write_text("What is the capital of France?\n\nHello there\n")
    out = tmp_path / "out.json"
    run(engine_dir, "--input-file", str(f), "--chat", "--max-output-len", "5", "--temperature", "0.8",
        "--top-p", "0.9", "--seed", "3", "--output-json", str(out))
    data = json.loads(out.read_text())
    tok = Tokenizer(engine_dir)
    assert [d["prompt_tokens"] for d in data] == [
        len(tok.encode_chat([{"role": "user", "content": p}])) for p in ("What is the capital of France?",
                                                                         "Hello there")]
    out2 = tmp_path / "out2.json"
    run(engine_dir, "--input-file", str(f), "--chat", "--max-output-len", "5", "--temperature", "0.8",
        "--top-p", "0.9", "--seed", "3", "--output-json", str(out2))
    assert json.loads(out2.read_text()) == [{**d, "time_to_first_token_s": d2["time_to_first_token_s"],
                                             "decode_tokens_per_s": d2["decode_tokens_per_s"]}
                                            for d, d2 in zip(data, json.loads(out2.read_text()))]
    # --end-id: stop at the third greedy token
    run(engine_dir, "--input-text", "Hello", "--max-output-len", "8", "--output-json", str(out))
    greedy = json.loads(out.read_text())[0]["token_ids"]
    run(engine_dir, "--input-text", "Hello", "--max-output-len", "8", "--end-id", str(greedy[2]),
        "--output-json", str(out))
    d = json.loads(out.read_text())[0]
    assert d["token_ids"] == greedy[:greedy.index(greedy[2]) + 1] and d["finish_reason"] == "stop"


@pytest.mark.parametrize("args, rc, needles", [
    (["--input-text", "", "--max-output-len", "4"], 2, ["prompt 0 is empty"]),
    (["--input-text", "Paris " * 60, "--max-output-len", "4"], 1, ["max_input_len 48",
                                                                    "maximum context length is 64"]),
    (["--input-text", "hi", "--max-output-len", "4", "--top-p", "1.5"], 2, ["top_p 1.5"]),
    (["--input-text", "hi", "--max-output-len", "4", "--temperature", "-1"], 2, ["temperature -1"]),
    (["--input-text", "hi", "--max-output-len", "0"], 2, ["--max-output-len 0"]),
    (["--max-output-len", "4"], 2, ["--input-text"]),
])
def test_bad_input_is_one_clear_line(engine_dir, args, rc, needles):
    assert_one_line_error(run(engine_dir, *args, check_rc=rc), *needles)


def test_too_small_kv_cache_names_what_fits(engine_dir):
    r = subprocess.run(ENGINE + ["run", "--engine-dir", str(engine_dir), "--max-kv-tokens", "20", "--input-text",
                                 "hi", "--max-output-len", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert_one_line_error(r, "largest max_seq_len that fits is 24")


def test_help_names_defaults_and_units():
    r = subprocess.run(ENGINE + ["run", "--help"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0
    for flag in ("--temperature", "--top-k", "--top-p", "--min-p", "--repetition-penalty", "--presence-penalty",
                 "--frequency-penalty", "--seed", "--stop", "--end-id", "--streaming", "--chat", "--output-json",
                 "--kv-cache-mem-fraction", "--max-kv-tokens", "--threads", "--input-file", "--max-output-len"):
        assert flag in r.stdout


def test_scheduling_flags(engine_dir, tmp_path):
    base = ["--input-text", "The capital of France is", "--input-text", "The capital of France was",
            "--max-output-len", "6"]
    plain = json.loads((run(engine_dir, *base, "--no-prefix-caching", "--output-json", str(tmp_path / "a.json")),
                        (tmp_path / "a.json").read_text())[1])
    r = run(engine_dir, *base, "--scheduling-policy", "priority", "--priority", "1", "--priority", "0",
            "--max-num-tokens", "3", "--max-batch-size", "1", "--output-json", str(tmp_path / "b.json"))
    prio = json.loads((tmp_path / "b.json").read_text())
    assert [o["token_ids"] for o in prio] == [o["token_ids"] for o in plain]
    # one sequence a step, the second prompt first: it has its first token before the first prompt starts
    assert prio[1]["time_to_first_token_s"] < prio[0]["time_to_first_token_s"]
    assert "prefix cache hits 0 of 12 prompt tokens; 0 preemption(s)" in " ".join(r.stderr.split())


@pytest.mark.parametrize("args, needles", [
    (["--priority", "1"], ["--priority 1 needs --scheduling-policy priority"]),
    (["--scheduling-policy", "lifo"], ["'lifo' is unknown", "fcfs, priority"]),
    (["--scheduling-policy", "priority", "--priority", "1", "--priority", "2", "--priority", "3"],
     ["3 --priority values for 1 prompts"]),
    (["--max-num-tokens", "41"], ["--max-num-tokens 41 is outside [1, 40]"]),
    (["--kv-cache-memory-bytes", "lots"], ["--kv-cache-memory-bytes 'lots' is not a size"]),
])
def test_bad_scheduling_flags(engine_dir, args, needles):
    assert_one_line_error(run(engine_dir, "--input-text", "hi", "--max-output-len", "4", *args, check_rc=2),
                          *needles)


def test_speculative_flags_give_the_same_greedy_text(engine_dir, tmp_path):
    base = ["--input-text", "one two three one two three one two", "--max-output-len", "24"]
    run(engine_dir, *base, "--output-json", str(tmp_path / "a.json"))
    r = run(engine_dir, *base, "--speculative", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-min", "1",
            "--prompt-lookup-max", "3", "--output-json", str(tmp_path / "b.json"))
    plain, spec = (json.loads((tmp_path / f).read_text()) for f in ("a.json", "b.json"))
    assert [o["token_ids"] for o in spec] == [o["token_ids"] for o in plain]
    assert "speculation" in r.stderr


@pytest.mark.parametrize("args, needles", [
    (["--num-speculative-tokens", "3"], ["--num-speculative-tokens needs --speculative"]),
    (["--speculative", "eagle"], ["--speculative 'eagle' is not one of ngram, draft"]),
    (["--speculative", "draft"], ["--speculative draft needs --draft-engine-dir"]),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], ["--num-speculative-tokens 0 must be in [1, 16]"]),
])
def test_bad_speculative_flags(engine_dir, args, needles):
    assert_one_line_error(run(engine_dir, "--input-text", "hi", "--max-output-len", "4", *args, check_rc=2),
                          *needles)
