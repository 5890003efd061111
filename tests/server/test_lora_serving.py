"""LoRA adapters through `engine serve`'s API: requests name an adapter by `model` and get that adapter's greedy
text (the engine's own, as LLM.generate gives it), /v1/models lists adapters under their base, and with
--allow-runtime-lora-updating adapters load and unload at run time; bad adapters are 400s that name the problem,
unknown ones 404s."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine.core.errors import EngineError
from engine.runtime import LLM, SamplingParams
from engine.runtime.server.lora_adapters import AdapterTable, LoraModule, LoraServing, parse_lora_module
from tests.lora_models import Models

from .conftest import MODEL, RunningServer

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

KEY = "LlamaForCausalLM"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("lora_serving"))


@pytest.fixture(scope="module")
def lora_server(models):
    engine = models.engine(KEY)
    options = LoraServing(modules=(LoraModule("a1", models.adapter(KEY, seed=1)),), max_loras=2,
                          allow_updates=True)
    table = AdapterTable(options, {MODEL: engine})
    s = RunningServer(engine, adapters=table, load=lambda: LLM(engine, max_kv_tokens=1024,
                                                                lora_config=table.lora_config(MODEL)))
    s.wait_ready()
    yield s
    s.stop()


def complete(server, model: str) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.model == model
    return out.choices[0].text


def engine_text(server, lora: str | None) -> str:
    llm = server.state.registry.models[MODEL].llm
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12), lora=lora)[0].text


def test_requests_run_with_the_adapter_their_model_names(lora_server):
    assert complete(lora_server, "a1") == engine_text(lora_server, "a1")
    assert complete(lora_server, MODEL) == engine_text(lora_server, None)
    assert engine_text(lora_server, "a1") != engine_text(lora_server, None)
    cards = {c["id"]: c for c in httpx.get(lora_server.url + "/v1/models").json()["data"]}
    assert cards["a1"]["parent"] == MODEL and cards[MODEL]["parent"] is None
    metrics = httpx.get(lora_server.url + "/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2",model_name="tiny",running_lora_adapters="",' in metrics


def test_adapters_load_and_unload_at_run_time(lora_server, models):
    url = lora_server.url
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(models.adapter(KEY, 2))})
    assert r.status_code == 200, r.text
    assert complete(lora_server, "a2") == engine_text(lora_server, "a2") != engine_text(lora_server, "a1")
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(models.adapter(KEY, 3))})
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    r = httpx.post(url + "/v1/completions", json={"model": "a2", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and "`a1`" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"


def test_bad_adapters_are_400s_naming_the_problem(lora_server, models, tmp_path):
    url = lora_server.url + "/v1/load_lora_adapter"
    other = models.adapter("Qwen3ForCausalLM", seed=1, targets=["q_proj"])
    r = httpx.post(url, json={"lora_name": "bad", "lora_path": str(other)})
    assert r.status_code == 400 and "the adapter was trained for another base model" in r.json()["error"]["message"]
    r = httpx.post(url, json={"lora_name": "empty", "lora_path": str(tmp_path)})
    assert r.status_code == 400 and "expected a PEFT adapter directory" in r.json()["error"]["message"]
    r = httpx.post(url, json={"lora_name": MODEL, "lora_path": str(models.adapter(KEY, 1))})
    assert r.status_code == 400 and "served model's name" in r.json()["error"]["message"]
    assert [c["id"] for c in httpx.get(lora_server.url + "/v1/models").json()["data"]] == [MODEL, "a1"]


def test_updates_are_off_without_the_flag(server):
    assert httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "y"}).status_code \
        == 404


def test_lora_modules_flag_forms_and_a_base_without_lora(models, server_engine):
    assert parse_lora_module("sql=/a/b") == LoraModule("sql", Path("/a/b"))
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}').base == "m"
    with pytest.raises(EngineError, match="give NAME=PATH"):
        parse_lora_module("sql")
    with pytest.raises(EngineError, match="built without LoRA support"):
        AdapterTable(LoraServing(modules=(LoraModule("a1", models.adapter(KEY, seed=1)),)), {MODEL: server_engine})
