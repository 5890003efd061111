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


# A sliding window shorter than the test prompts, so that sliding layers differ from full ones.
WINDOW = 8


def _mistral():
    from transformers import MistralConfig
    return MistralConfig(**_common(sliding_window=WINDOW))


def _mistral_mqa():
    # one KV head: tp 2 and 4 replicate it; no window (sliding_window null, as Mistral v0.2+)
    from transformers import MistralConfig
    return MistralConfig(**_common(num_key_value_heads=1, sliding_window=None))


def _qwen2():
    # qkv bias, tied embeddings (Qwen2.5-0.5B); sliding_window set but use_sliding_window false -> no window
    from transformers import Qwen2Config
    return Qwen2Config(**_common(tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False,
                                 sliding_window=WINDOW))


def _qwen2_sliding():
    # layers >= max_window_layers slide: layer 0 full, layer 1 sliding
    from transformers import Qwen2Config
    return Qwen2Config(**_common(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))


def _qwen3():
    # head_dim 32 != hidden_size / heads (16), as Qwen3-0.6B: q_size 128 against hidden 64
    from transformers import Qwen3Config
    return Qwen3Config(**_common(head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0))


def _gemma2():
    # default layer_types: layer 0 sliding, layer 1 full. Larger weights and small soft-caps so that both caps
    # change the logits (by ~0.2 and ~1.3 here); query_pre_attn_scalar != head_dim so the attention scale matters.
    from transformers import Gemma2Config
    return Gemma2Config(**_common(head_dim=16, tie_word_embeddings=True, sliding_window=WINDOW,
                                  query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                  final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
                                  initializer_range=0.1))


def _gemma3():
    # sliding + full layers with different rotary (linear scaling on the full layers only, as gemma-3-4b)
    from transformers import Gemma3TextConfig
    return Gemma3TextConfig(**_common(
        head_dim=32, tie_word_embeddings=True, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}))


def _phi3():
    # fused qkv_proj / gate_up_proj; GQA (Phi-3-medium) and a window on every layer (Phi-3-mini-4k)
    from transformers import Phi3Config
    return Phi3Config(**_common(sliding_window=WINDOW, rms_norm_eps=1e-5))


# Mixture-of-experts families: experts narrower than the dense MLP, top-2 routing, every combination of the routing
# weights' normalization and of shared / dense parts that the families have.
def _mixtral():
    # 4 experts, top-2 renormalized (always, in Mixtral); Mistral's one window for all layers
    from transformers import MixtralConfig
    return MixtralConfig(**_common(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                   sliding_window=WINDOW))


def _qwen2_moe():
    # 8 experts, top-2 NOT renormalized (norm_topk_prob false, the default), a gated shared expert, qkv bias; layer 0
    # dense (decoder_sparse_step 2), layer 1 the mixture of experts
    from transformers import Qwen2MoeConfig
    return Qwen2MoeConfig(**_common(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
                                    num_experts_per_tok=2, decoder_sparse_step=2, rope_theta=1000000.0))


def _qwen3_moe():
    # 8 experts, top-2 renormalized (norm_topk_prob true, as the released models), q/k norms, head_dim 32
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**_common(head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=True, rope_theta=1000000.0))


# architecture -> config factory. Extra variants of a family use "Arch:variant" keys.
TINY_CONFIGS = {
    "LlamaForCausalLM": _llama,
    "LlamaForCausalLM:llama3-rope-tied": _llama3_rope_tied,
    "MistralForCausalLM": _mistral,
    "MistralForCausalLM:mqa-no-window": _mistral_mqa,
    "Qwen2ForCausalLM": _qwen2,
    "Qwen2ForCausalLM:sliding": _qwen2_sliding,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": _gemma2,
    "Gemma3ForCausalLM": _gemma3,
    "Phi3ForCausalLM": _phi3,
    "MixtralForCausalLM": _mixtral,
    "Qwen2MoeForCausalLM": _qwen2_moe,
    "Qwen3MoeForCausalLM": _qwen3_moe,
}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


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
    # transformers initialises norm weights to 1 (Gemma: 0) and biases to 0; perturb every 1-D parameter so that
    # a norm or bias that is dropped, misplaced or mis-offset changes the numbers.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    make_tokenizer(out_dir)
    return out_dir


def architecture(key: str) -> str:
    return key.split(":")[0]


def is_moe(key: str) -> bool:
    return architecture(key) in MOE_ARCHITECTURES
