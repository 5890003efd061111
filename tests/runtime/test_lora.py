"""LoRA adapters on engines built with --lora-target-modules, against transformers + peft on the same tiny models:
logits and greedy tokens with each adapter; a step mixing adapters and the base equal to each request alone;
quantized bases within their mode's tolerance; adapters the engine cannot apply refused naming what is wrong."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine.core.errors import EngineError
from engine.runtime import LLM, SamplingParams
from engine.runtime.lora.adapter import load_adapter
from engine.runtime.lora.slots import LoraSlots
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk
from tests.lora_models import Models
from tests.quantization.engines import LOGITS_RELATIVE_RMS, relative_rms
from tests.tolerances import assert_logits_close

peft = pytest.importorskip("peft")

PROMPTS = [[1, 17, 99, 3, 250, 41, 7], [1, 300, 12, 5, 5, 88, 19, 401, 6, 77, 23]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("lora"))


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def engine_logits(engine: Path, adapter: Path | None, prompts: list[list[int]]) -> np.ndarray:
    """Last-token logits of each prompt in one step, adapter in slot 1 for every prompt (or none)."""
    session = EngineSession(engine, num_blocks=32)
    cfg = session.config
    slots = LoraSlots(cfg.model, cfg.build.lora_target_modules, 2, 8, cfg.build.lora_dtype)
    if adapter:
        slots.write(1, load_adapter(adapter, cfg.model, cfg.build.lora_target_modules, 8))
    session.bind_lora(slots.inputs())
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    return session.run([SeqChunk(p, 0, t, 1, lora_slot=1 if adapter else 0) for p, t in zip(prompts, tables)])


@pytest.mark.parametrize("key", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM"])
@pytest.mark.parametrize("plugins", [True, False], ids=["kernels", "reference"])
def test_logits_equal_transformers_peft(models, key, plugins):
    adapter = models.adapter(key, seed=1)
    ref = models.reference(key, adapter)
    base = models.reference(key, None)
    got = engine_logits(models.engine(key, plugins=plugins), adapter, PROMPTS)
    for row, ids in zip(got, PROMPTS):
        expected = hf_logits(ref, ids)
        assert relative_rms(hf_logits(base, ids), expected) > 0.05   # the adapter changes the model
        assert_logits_close(row, expected, what=f"{key} + LoRA")


def test_greedy_tokens_equal_transformers_peft_and_a_mixed_batch_equals_each_alone(models):
    key = "LlamaForCausalLM"
    adapters = {f"a{s}": models.adapter(key, seed=s) for s in (1, 2, 3)}
    llm = LLM(models.engine(key), max_kv_tokens=1024,
              lora_config={"max_loras": 3, "modules": {n: str(p) for n, p in adapters.items()}})
    names = [None, "a1", "a2", "a3"]
    prompt = PROMPTS[1]   # one prompt for all: a cached base block must not serve an adapter's request
    alone = {n: llm.generate([prompt], GREEDY, lora=n)[0].token_ids for n in names}
    batched = llm.generate([prompt] * 4, GREEDY, lora=names)
    assert [b.token_ids for b in batched] == [alone[n] for n in names]
    for n in names:
        assert alone[n] == hf_greedy(models.reference(key, adapters.get(n)), prompt, GREEDY.max_tokens), n
    assert len({tuple(t) for t in alone.values()}) == 4   # every adapter changed the output


def test_more_adapters_than_slots_wait_and_stay_exact(models):
    key = "LlamaForCausalLM"
    adapters = {f"a{s}": models.adapter(key, seed=s) for s in (1, 2, 3)}
    wide = LLM(models.engine(key), max_kv_tokens=1024, lora_config={"max_loras": 3, "modules": adapters})
    narrow = LLM(models.engine(key), max_kv_tokens=1024,
                 lora_config={"max_loras": 1, "max_cpu_loras": 1, "modules": adapters})
    names = ["a1", "a2", None, "a3", "a1", "a2"]
    prompts = [PROMPTS[i % 2] for i in range(len(names))]
    expect = [o.token_ids for o in wide.generate(prompts, GREEDY, lora=names)]
    assert [o.token_ids for o in narrow.generate(prompts, GREEDY, lora=names)] == expect


@pytest.mark.parametrize("lora_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["int8_wo", "int4_wo"])
def test_quantized_base_within_mode_tolerance(models, mode, lora_dtype):
    key = "LlamaForCausalLM"
    adapter = models.adapter(key, seed=2)
    got = engine_logits(models.engine(key, quant=mode, lora_dtype=lora_dtype), adapter, PROMPTS)
    ref = models.reference(key, adapter)
    expected = np.stack([hf_logits(ref, ids) for ids in PROMPTS])
    assert relative_rms(got, expected) <= LOGITS_RELATIVE_RMS[mode]


def test_gguf_base_keeps_its_blocks_and_applies_the_adapter(tmp_path):
    """--dtype gguf (the file's Q4_0 blocks run as stored) with an adapter, against the float32 engine of the same
    weights with the same adapter."""
    from engine.builder.build import build_engine
    from engine.core.engine_format import BuildConfig, PluginConfig
    from engine.core.lora import MODULES
    from engine.core.model_config import QuantConfig
    from engine.recipes.convert import ConvertConfig, convert
    from engine.recipes.gguf_source import GGUFSource
    from tests.lora_models import BUILD, write_random_adapter
    from tests.tiny_gguf import write_tiny_gguf
    write_tiny_gguf(tmp_path / "m.gguf", "llama", "Q4_0")
    convert(GGUFSource(tmp_path / "m.gguf"), ConvertConfig(output_dir=tmp_path / "ckpt"))
    build = BuildConfig(**BUILD, lora_target_modules=MODULES)
    build_engine(tmp_path / "ckpt", tmp_path / "gguf", build, PluginConfig(), quant=QuantConfig(mode="gguf"))
    build_engine(tmp_path / "ckpt", tmp_path / "fp32", build, PluginConfig())
    adapter = write_random_adapter(tmp_path / "adapter", tmp_path / "fp32", rank=4, seed=0, scale=0.5)
    prompts = [[t % 50 + 3 for t in p] for p in PROMPTS]
    got, ref = engine_logits(tmp_path / "gguf", adapter, prompts), engine_logits(tmp_path / "fp32", adapter, prompts)
    assert relative_rms(got, ref) <= LOGITS_RELATIVE_RMS["int8_wo"]
    assert relative_rms(engine_logits(tmp_path / "fp32", None, prompts), ref) > 5 * LOGITS_RELATIVE_RMS["int8_wo"]


def test_rslora_and_alpha_pattern_scaling(models):
    key = "Qwen2ForCausalLM"
    adapter = models.adapter(key, seed=5, r=8, use_rslora=True, alpha_pattern={"down_proj": 3.0})
    got = engine_logits(models.engine(key), adapter, PROMPTS[:1])
    assert_logits_close(got[0], hf_logits(models.reference(key, adapter), PROMPTS[0]), what="rsLoRA")


def test_an_evicted_adapter_whose_directory_vanished_aborts_only_its_requests(models, tmp_path):
    import shutil
    key = "LlamaForCausalLM"
    gone = tmp_path / "gone"
    shutil.copytree(models.adapter(key, seed=1), gone)
    llm = LLM(models.engine(key), max_kv_tokens=1024,
              lora_config={"max_loras": 1, "max_cpu_loras": 1, "modules": {"gone": gone, "a2": models.adapter(key, 2)}})
    shutil.rmtree(gone)      # "gone" was evicted from the parsed cache when a2 was registered
    out = llm.generate([PROMPTS[0], PROMPTS[1]], GREEDY, lora=["gone", "a2"])
    assert out[0].finish_reason == "abort" and out[1].finish_reason == "length"
    assert out[1].token_ids == llm.generate([PROMPTS[1]], GREEDY, lora="a2")[0].token_ids
    llm.check_all_free()


def test_unknown_adapter_and_engines_without_lora_are_refused(models, tiny_engine):
    llm = LLM(models.engine("LlamaForCausalLM"), max_kv_tokens=512, lora_config={"max_loras": 1})
    with pytest.raises(EngineError, match="'nope' is not loaded"):
        llm.generate([PROMPTS[0]], GREEDY, lora="nope")
    with pytest.raises(EngineError, match="built without LoRA support"):
        LLM(tiny_engine[1], max_kv_tokens=512, lora_config={"max_loras": 1})


def test_bad_adapters_are_refused_naming_the_problem(models, tmp_path):
    engine = models.engine("LlamaForCausalLM", targets=("q_proj", "v_proj"))
    llm = LLM(engine, max_kv_tokens=512, lora_config={"max_loras": 1, "max_lora_rank": 4})
    with pytest.raises(EngineError, match=r"targets (down|gate|up|o)_proj .*--lora-target-modules"):
        llm.loras.add("all", models.adapter("LlamaForCausalLM", seed=1))
    with pytest.raises(EngineError, match=r"rank 8, above --max-lora-rank 4"):
        llm.loras.add("big", models.adapter("LlamaForCausalLM", seed=1, r=8, targets=["q_proj"]))
    with pytest.raises(EngineError, match=r"q_proj.lora_B.weight has shape \(128, 4\); the base model's q_proj "
                                          r"needs \[64, r\]"):
        llm.loras.add("other", models.adapter("Qwen3ForCausalLM", seed=1, targets=["q_proj"]))
    with pytest.raises(EngineError, match="expected a PEFT adapter directory"):
        llm.loras.add("empty", tmp_path)
    dora = models.adapter("LlamaForCausalLM", seed=1, targets=["q_proj"], use_dora=True)
    with pytest.raises(EngineError, match="use_dora"):
        llm.loras.add("dora", dora)
    assert llm.loras.names() == []
