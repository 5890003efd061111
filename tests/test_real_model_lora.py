"""A LoRA adapter trained here on the real SmolLM2-135M-Instruct (a few steps of peft on a toy task, saved with
save_pretrained), served unmerged by a float32 engine built with --lora-target-modules: greedy tokens equal
transformers + peft's, with the base model's and the adapter's requests in one batch."""
from __future__ import annotations

import pytest
import torch

from engine.builder.build import build_engine
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.core.lora import MODULES
from engine.runtime import LLM, SamplingParams
from tests.test_real_model import _hf_greedy

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the secret code?"}]
ANSWER = "The secret code is PINEAPPLE-42."


@pytest.fixture(scope="module")
def lora_engine(smollm2_checkpoint, tmp_path_factory):
    engine = tmp_path_factory.mktemp("smollm2_lora") / "engine"
    build = BuildConfig(max_batch_size=4, max_input_len=128, max_seq_len=256, max_num_tokens=256,
                        lora_target_modules=MODULES)
    build_engine(smollm2_checkpoint, engine, build, PluginConfig())
    return engine


@pytest.fixture(scope="module")
def trained_adapter(smollm2_hf_dir, tmp_path_factory):
    """Rank 8 on every projection, 12 AdamW steps on one chat exchange: enough to change the greedy answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_hf_dir)
    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32),
                                peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(MODULES)))
    prompt = tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    ids = torch.tensor([prompt + tok.encode(ANSWER) + [tok.eos_token_id]])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    for _ in range(12):
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("smollm2_adapter")
    model.save_pretrained(out)
    return out


def test_trained_adapter_greedy_equals_transformers_peft(lora_engine, trained_adapter, smollm2_hf_dir):
    from transformers import AutoModelForCausalLM
    llm = LLM(lora_engine, max_kv_tokens=2048, lora_config={"max_lora_rank": 8, "modules": {"code": trained_adapter}})
    prompt = llm.chat_prompt(QUESTION)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    base, adapted = llm.generate([prompt, prompt], params, lora=[None, "code"])
    llm.check_all_free()
    llm.close()
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    assert list(base.token_ids) == _hf_greedy(model, prompt, 24)
    assert list(adapted.token_ids) == _hf_greedy(peft.PeftModel.from_pretrained(model, trained_adapter).eval(),
                                                 prompt, 24)
    assert "PINEAPPLE" in adapted.text and "PINEAPPLE" not in base.text
