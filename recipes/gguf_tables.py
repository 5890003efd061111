"""What a llama.cpp GGUF file's names mean to the engine: its architectures and tensor names as Hugging Face's (the
names llama.cpp's convert_hf_to_gguf.py wrote them from), the metadata transformers' GGUF config does not read, and
the HF config transformers makes of the metadata (gguf_config_dict). recipes/gguf_source.py reads the file.
"""
from __future__ import annotations

import re

# GGUF `general.architecture` -> the HF architecture llama.cpp's convert_hf_to_gguf.py made it from.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Llama 1-3, SmolLM2, TinyLlama; Mistral 7B is written as llama too
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",  # llama.cpp writes the text model only (the vision tower is an mmproj file)
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    # Mixtral is written as llama with llama.expert_count (gguf_config_dict makes it mixtral)
}

# GGUF tensor name -> HF tensor name; "{i}" stands for the layer index (llama.cpp's gguf-py tensor_mapping.py).
_LLAMA_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embedding is tied
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",  # rows permuted by llama.cpp
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",  # rows permuted by llama.cpp
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
# Mixture-of-experts layers (llama.cpp's Qwen2MoeModel, Qwen3MoeModel and Mixtral as LlamaModel): the experts merged
# into 3-D tensors [experts, out, in]; gate and up both map to transformers' stacked gate_up_proj, which the source
# makes by concatenating them in this order (as transformers' Qwen2MoeTensorProcessor does).
_MOE_TENSORS = {
    "blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight",   # the router (llama.cpp keeps it float)
    "blk.{i}.ffn_gate_exps.weight": "model.layers.{i}.mlp.experts.gate_up_proj",
    "blk.{i}.ffn_up_exps.weight": "model.layers.{i}.mlp.experts.gate_up_proj",
    "blk.{i}.ffn_down_exps.weight": "model.layers.{i}.mlp.experts.down_proj",
}
# Qwen2-MoE's shared expert and its gate (a 1-D [hidden] in the file; the processor makes it [1, hidden])
_SHARED_EXPERT_TENSORS = {
    **{f"blk.{{i}}.ffn_{x}_shexp.weight": f"model.layers.{{i}}.mlp.shared_expert.{x}_proj.weight"
       for x in ("gate", "up", "down")},
    "blk.{i}.ffn_gate_inp_shexp.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
}
TENSOR_NAMES = {
    "llama": {**_LLAMA_TENSORS, **_MOE_TENSORS},
    # Qwen2 / Qwen2.5: bias on q, k, v
    "qwen2": {**_LLAMA_TENSORS, **{f"blk.{{i}}.attn_{x}.bias": f"model.layers.{{i}}.self_attn.{x}_proj.bias"
                                   for x in "qkv"}},
    # Qwen3: RMSNorm of q and k per head
    "qwen3": {**_LLAMA_TENSORS, **{f"blk.{{i}}.attn_{x}_norm.weight": f"model.layers.{{i}}.self_attn.{x}_norm.weight"
                                   for x in "qk"}},
}
# Gemma (llama.cpp's Gemma2Model): q/k not permuted, norms stored as 1 + w, sandwich norms: ffn_norm is the pre-MLP
# norm, post_attention_norm and post_ffw_norm the post-attention and post-MLP ones; Gemma 2 is always tied
_GEMMA2_TENSORS = {**{g: hf for g, hf in _LLAMA_TENSORS.items() if g != "output.weight"},
                   **{f"blk.{{i}}.{g}.weight": f"model.layers.{{i}}.{hf}.weight" for g, hf in (
                       ("post_attention_norm", "post_attention_layernorm"), ("ffn_norm", "pre_feedforward_layernorm"),
                       ("post_ffw_norm", "post_feedforward_layernorm"))}}
TENSOR_NAMES.update(
    gemma2=_GEMMA2_TENSORS,
    gemma3={**_GEMMA2_TENSORS, "output.weight": "lm_head.weight",   # + q/k norms; untied models have an output
            **{g: hf for g, hf in TENSOR_NAMES["qwen3"].items() if "_norm" in g and "attn_" in g}},
    # Phi-3 stays fused as llama.cpp writes it: attn_qkv is q|k|v, ffn_up is gate|up (the recipe splits both)
    phi3={**{g: hf for g, hf in _LLAMA_TENSORS.items() if not re.search(r"attn_[qkv]\.|ffn_(gate|up)", g)},
          "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
          "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight"},
)
TENSOR_NAMES.update(qwen2moe={**TENSOR_NAMES["qwen2"], **_MOE_TENSORS, **_SHARED_EXPERT_TENSORS},
                    qwen3moe={**TENSOR_NAMES["qwen3"], **_MOE_TENSORS})

# GGUF key -> the config key that must equal it, where transformers' GGUF config reads no key: Gemma's q scale
# (llama.cpp's key_length ** -0.5, (hidden / heads) ** -0.5 for the 27B models; transformers' query_pre_attn_scalar
# ** -0.5, default 256), Gemma 2's soft-caps, Phi-3's rotary width (partial for Phi-4-mini; head_dim = hidden / heads)
_GEMMA_SCALE = {"attention.key_length": "query_pre_attn_scalar", "final_logit_softcapping": "final_logit_softcapping"}
UNREAD = {"gemma2": {**_GEMMA_SCALE, "attn_logit_softcapping": "attn_logit_softcapping"}, "gemma3": _GEMMA_SCALE,
           "phi3": {"rope.dimension_count": "head_dim"}}


# load_gguf_checkpoint's own renames of a GGUF architecture to a model_type
_RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Keys the MoE configs need that transformers' GGUF config tables do not read (llama.cpp's convert_hf_to_gguf.py writes
# them): without them transformers takes the class defaults (Qwen2MoeConfig's 1408 and 5632 expert widths), which fit
# only the models they came from. Mixtral has no table of its own in transformers: llama's, and the expert counts.
_MOE_KEYS = {
    "qwen2_moe": {"expert_feed_forward_length": "moe_intermediate_size",
                  "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
                  "expert_weights_norm": "norm_topk_prob"},
    "qwen3_moe": {"expert_feed_forward_length": "moe_intermediate_size", "expert_weights_norm": "norm_topk_prob"},
    "mixtral": {"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
}


def model_type_of(metadata: dict) -> str:
    """The model_type a file's architecture becomes: transformers' renames (llama named exactly "mistral" is mistral),
    and llama with experts is Mixtral (llama.cpp writes Mixtral as llama; transformers loads it as a dense llama and
    drops the experts)."""
    architecture = metadata["general.architecture"]
    if architecture == "llama" and metadata.get("llama.expert_count"):
        return "mixtral"
    if "llama" in architecture and metadata.get("general.name") == "mistral":
        return "mistral"
    return _RENAMED.get(architecture, architecture)


def gguf_config_dict(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """transformers' load_gguf_checkpoint(path, return_tensors=False)["config"] for a GGUF_ARCHITECTURES file, from
    its metadata (as read_gguf_metadata returns it) and tensor names.

    The same steps with the same tables: tied embeddings when there is no output.weight, the architecture's defaults,
    then every key the config table names, renamed (a one-element array counts as its element), and the vocabulary
    size from the token list when no key states it. The model type as model_type_of says, gemma3 as gemma3_text,
    as there; the MoE keys of _MOE_KEYS beside transformers' tables. The other branches of load_gguf_checkpoint
    (t5, stablelm, gemma4, lfm2, gpt-oss, ...) are for architectures this source refuses.
    """
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = metadata["general.architecture"]
    updated = model_type_of(metadata)
    tables = {**GGUF_CONFIG_MAPPING,
              updated: {**GGUF_CONFIG_MAPPING.get(updated, GGUF_CONFIG_MAPPING.get(architecture, {})),
                        **_MOE_KEYS.get(updated, {})}}
    config: dict = {"tie_word_embeddings": "output.weight" not in tensor_names}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {})
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, config_key = key.replace(architecture, updated).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str):
            value = value.replace(architecture, updated)
        renamed = tables.get(prefix, {}).get(config_key)
        if renamed is not None and renamed != -1:
            config[renamed] = value
    if config.get("model_type") == "gemma3":   # a GGUF holds Gemma 3's text model only
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        tokens = metadata["tokenizer.ggml.tokens"]  # the reader gives a string array's length unless asked for it
        config["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    return config
