"""Tiny random Hugging Face models of every registered family (2 layers, fixed seed), saved with save_pretrained,
with a small BPE tokenizer and a chat template so they run end to end like real checkpoints.

TINY_CONFIGS is keyed by the exact HF architecture name; tests/recipes/test_registry.py fails when a registered
family has no entry here.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 512
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = ("The capital of France is Paris. The quick brown fox jumps over the lazy dog. "
           "Engines compile checkpoints into fast graphs; tokens flow through attention and MLP layers. "
           "0123456789 naïve café — über 東京 ✓ emoji 🙂. ") * 20


def _common(**extra) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    base.update(extra)
    return base


def _llama():
    from transformers import LlamaConfig
    return LlamaConfig(**_common(rope_theta=10000.0))


def _llama3_rope_tied():
    from transformers import LlamaConfig
    return LlamaConfig(**_common(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 500000.0}))


# architecture -> config factory. Extra variants of a family use "Arch:variant" keys.
TINY_CONFIGS = {
    "LlamaForCausalLM": _llama,
    "LlamaForCausalLM:llama3-rope-tied": _llama3_rope_tied,
}


def make_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE, "add_bos_token": False}, indent=1))


def make_tiny_model(key: str, out_dir: Path, seed: int = 0) -> Path:
    """Save the tiny model `key` of TINY_CONFIGS (random weights from `seed`) with its tokenizer to out_dir."""
    from transformers import AutoModelForCausalLM
    config = TINY_CONFIGS[key]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    make_tokenizer(out_dir)
    return out_dir


def architecture(key: str) -> str:
    return key.split(":")[0]
