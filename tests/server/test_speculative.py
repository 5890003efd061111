"""`engine serve` with speculative decoding (prompt lookup) on the tiny engine: completions, streamed or not, equal
the plain server's, and /metrics counts drafts under vLLM's spec-decode names."""
import httpx
import pytest

from engine.runtime import LLM
from tests.server.conftest import RunningServer, sse_events
from tests.server.test_endpoints import _samples

PROMPT = "one two three four one two three four one two three"


@pytest.fixture(scope="module")
def spec_server(server_engine):
    s = RunningServer(server_engine, load=lambda: LLM(server_engine, max_kv_tokens=8 * 256, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "max_batch_size": 8,
        "verify_cost": 0}))
    s.wait_ready()
    yield s
    s.stop()


def complete(url: str, stream: bool) -> str:
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=url, timeout=60) as c:
        if not stream:
            return c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        with c.stream("POST", "/v1/completions", json=body) as r:
            events = sse_events(r.iter_lines())
        return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict))


def test_speculative_server_answers_as_the_plain_one_and_counts_drafts(server, spec_server):
    before = _samples(httpx.get(spec_server.url + "/metrics").text)
    for stream in (False, True):
        assert complete(spec_server.url, stream) == complete(server.url, stream)
    after = _samples(httpx.get(spec_server.url + "/metrics").text)
    grew = {k: after[k] - before.get(k, 0) for k in after}
    assert grew["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 < grew["vllm:spec_decode_num_accepted_tokens_total"] <= grew["vllm:spec_decode_num_draft_tokens_total"]
    assert sum(v for k, v in grew.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos")) == \
        grew["vllm:spec_decode_num_accepted_tokens_total"]
    assert "vllm:spec_decode_num_drafts_total" not in _samples(httpx.get(server.url + "/metrics").text)
    spec_server.wait_all_free()


@pytest.mark.parametrize("args, needle", [
    (["--prompt-lookup-max", "3"], "--prompt-lookup-max needs --speculative"),
    (["--speculative", "ngram", "--draft-engine-dir", "x"], "--draft-engine-dir x is for --speculative draft"),
])
def test_cli_refuses_bad_speculative_flags_before_loading(server_engine, args, needle):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--engine-dir", str(server_engine), *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
