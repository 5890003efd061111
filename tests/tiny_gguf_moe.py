"""Tiny mixture-of-experts GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them (Qwen2MoeModel,
Qwen3MoeModel, Mixtral as LlamaModel): the tiny random HF model of tests/tiny_models.py, its experts merged into 3-D
`blk.N.ffn_{gate,up,down}_exps` tensors, the router `ffn_gate_inp` and 1-D tensors as F32, every other weight (the
experts included) quantized by gguf.quants, the MoE keys (expert_count, expert_used_count, expert_feed_forward_length,
expert_shared_feed_forward_length) and tests/tiny_gguf.py's tokenizer in the metadata.

write_tiny_moe_gguf returns the HF model holding the weights as stored (dequantized), the reference for engines
converted from the file: transformers' own GGUF loader reads no expert widths (it takes the config class's defaults)
and loads a Mixtral GGUF as a dense llama, so it cannot be the reference here.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from tests.tiny_gguf import _add_tensor, _tokenizer, _write_tokenizer
from tests.tiny_models import TINY_CONFIGS


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    key: str            # tests/tiny_models.TINY_CONFIGS key
    arch: str           # general.architecture
    config: dict        # changes to the tiny config that a GGUF of this architecture can state


SPECS = {
    # llama.cpp's qwen2moe has experts in every layer (no decoder_sparse_step key)
    "qwen2moe": MoeSpec("Qwen2MoeForCausalLM", "qwen2moe", {"decoder_sparse_step": 1}),
    "qwen3moe": MoeSpec("Qwen3MoeForCausalLM", "qwen3moe", {}),
    # a llama GGUF states no sliding window
    "mixtral": MoeSpec("MixtralForCausalLM", "llama", {"sliding_window": None}),
}
# qtype "mix": experts in other kinds than the rest, as a Q4_K_M file (block-32 kinds: the tiny widths are 32 and 64)
MIX = {"gate_exps": "Q4_1", "up_exps": "Q4_1", "down_exps": "Q5_1"}


def tiny_moe_model(name: str, vocab: int, seed: int):
    """The tiny HF model of SPECS[name] with random weights (1-D ones perturbed, as tests/tiny_models does)."""
    from transformers import AutoModelForCausalLM
    config = TINY_CONFIGS[SPECS[name].key]()
    for key, value in {**SPECS[name].config, "vocab_size": vocab}.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def write_tiny_moe_gguf(path: Path, name: str, qtype: str = "Q8_0", seed: int = 0):
    """Write SPECS[name]'s tiny model to `path` with its weights in `qtype` (F32, F16, Q8_0 or "mix"); return the HF
    model (eval, float32) holding the stored values."""
    import gguf
    spec = SPECS[name]
    path.parent.mkdir(parents=True, exist_ok=True)
    tok_dir = path.parent / f".{path.stem}-tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tokens, types, merges = _tokenizer(tok_dir)
    model = tiny_moe_model(name, len(tokens), seed)
    config = model.config
    w = gguf.GGUFWriter(str(path), spec.arch)
    w.add_name(f"tiny {name}")
    _write_hparams(w, config)
    _write_tokenizer(w, tokens, types, merges)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[spec.arch.upper()], config.num_hidden_layers)
    stored = {}
    gen = np.random.default_rng(seed)
    for hf_name, value in _llama_cpp_tensors(model).items():
        module, suffix = hf_name.rsplit(".", 1)
        gguf_name = f"{names.get_name(module)}.{suffix}"
        shape = value.shape
        if gguf_name.endswith("ffn_gate_inp_shexp.weight"):   # llama.cpp stores it as [hidden]
            value = value[0]
        kind = getattr(gguf.GGMLQuantizationType, _kind(gguf_name, value, qtype))
        stored[hf_name] = _add_tensor(w, {}, spec.arch, hf_name, gguf_name, value, kind, gen).reshape(shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _load_stored(model, stored)
    config.rms_norm_eps = float(np.float32(config.rms_norm_eps))   # as the file stores it
    return model


def _kind(gguf_name: str, value: np.ndarray, qtype: str) -> str:
    """llama.cpp's choice: routers and 1-D tensors F32, the rest the file's type."""
    if value.ndim == 1 or ".ffn_gate_inp" in gguf_name:
        return "F32"
    if qtype == "mix":
        return next((kind for part, kind in MIX.items() if f".ffn_{part}." in gguf_name), "Q8_0")
    return qtype


def _llama_cpp_tensors(model) -> dict[str, np.ndarray]:
    """The model's weights under the HF names llama.cpp's converter maps, experts stacked per projection
    (`mlp.experts.gate_proj.weight` [experts, inter, hidden], as its Qwen2MoeModel / Mixtral stacking makes them)."""
    out = {}
    for name, t in model.state_dict().items():
        value = t.detach().numpy().astype(np.float32)
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = np.split(value, 2, axis=1)
            out[name[:-len("gate_up_proj")] + "gate_proj.weight"] = gate
            out[name[:-len("gate_up_proj")] + "up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = value
        else:
            out[name] = value
    return out


def _load_stored(model, stored: dict[str, torch.Tensor]) -> None:
    """Put the stored (dequantized) values back into the model, experts re-merged as transformers holds them."""
    state = {}
    for name, value in stored.items():
        if name.endswith("mlp.experts.gate_proj.weight"):
            stem = name[:-len("gate_proj.weight")]
            state[stem + "gate_up_proj"] = torch.cat([value, stored[stem + "up_proj.weight"]], dim=1)
        elif name.endswith("mlp.experts.down_proj.weight"):
            state[name[:-len(".weight")]] = value
        elif not name.endswith("mlp.experts.up_proj.weight"):
            state[name] = value
    model.load_state_dict(state, strict=True)


def _write_hparams(w, config) -> None:
    """The keys convert_hf_to_gguf.py writes for these models (LlamaModel, Qwen2MoeModel, Qwen3MoeModel)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    if config.model_type == "mixtral":
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.model_type == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
