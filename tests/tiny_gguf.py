"""Tiny GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them: random weights of a small model
(2 layers, fixed seed) under GGUF tensor names, llama's q/k rows permuted for its rotary layout, 2-D weights stored
as F32, F16, Q8_0 or a mix of block kinds (MIX), norms and biases as F32, the model's hyperparameters and a byte-level BPE tokenizer with a
chat template in the metadata.

write_tiny_gguf returns the HF-named tensors it wrote (as stored, i.e. after any quantization), so tests can check
a reader against both the originals and transformers' own GGUF loader.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.tiny_models import CHAT_TEMPLATE, make_tokenizer

# gguf architecture -> (head_dim, tied embeddings, extra HF tensors per layer)
SPECS = {
    "llama": dict(head_dim=16, tied=True, bias=False, qk_norm=False),
    "qwen2": dict(head_dim=16, tied=False, bias=True, qk_norm=False),
    # transformers' GGUF loader does not read head_dim for qwen3 and uses Qwen3Config's default, 128
    "qwen3": dict(head_dim=128, tied=False, bias=False, qk_norm=True),
}
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
# qtype "mix": a kind per projection, as a Q4_K_M file mixes them (a v of another kind than q and k; every legacy
# block kind gguf can write)
MIX = {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q4_0", "gate_proj": "Q4_1", "up_proj": "Q4_1",
       "down_proj": "Q5_1", "embed_tokens": "Q8_0", "lm_head": "Q5_0"}


def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: interleaved rotary halves -> its own row order."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _tokenizer(tmp: Path) -> tuple[list[str], list[int], list[str]]:
    make_tokenizer(tmp)
    data = json.loads((tmp / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["content"] for t in data["added_tokens"] if t["special"]}
    types = [3 if t in special else 1 for t in tokens]  # 3: CONTROL, 1: NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, types, merges


# kinds gguf-py cannot quantize -> (block values, block bytes): written as random blocks with a small float16 d first
RANDOM_BLOCKS = {"IQ4_NL": (32, 18)}


def _random_blocks(kind: str, shape: tuple[int, int], gen) -> np.ndarray:
    values, size = RANDOM_BLOCKS[kind]
    blocks = gen.integers(0, 256, (shape[0], shape[1] // values, size), dtype=np.uint8)
    blocks[:, :, :2] = np.full(blocks.shape[:2], 0.002, np.float16).view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(shape[0], -1)


def write_tiny_gguf(path: Path, arch: str, qtype: str = "F32", seed: int = 0,
                    rope_scaling: tuple[str, float] | None = None,
                    kinds: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Write the tiny `arch` model to `path`; `rope_scaling` = (type, factor) adds llama.cpp's rope.scaling keys;
    `kinds` overrides MIX's kind of some projections with qtype "mix" (e.g. {"o_proj": "IQ4_NL"})."""
    import gguf

    spec = SPECS[arch]
    hd = spec["head_dim"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tok_dir = path.parent / f".{path.stem}-tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tokens, types, merges = _tokenizer(tok_dir)
    vocab = len(tokens)

    gen = np.random.default_rng(seed)
    rand = lambda *shape: (gen.standard_normal(shape) * 0.1).astype(np.float32)  # noqa: E731
    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(vocab, HIDDEN),
                                 "model.norm.weight": 1 + rand(HIDDEN)}
    if not spec["tied"]:
        hf["lm_head.weight"] = rand(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        hf.update({p + "input_layernorm.weight": 1 + rand(HIDDEN), p + "post_attention_layernorm.weight": 1 + rand(HIDDEN),
                   p + "self_attn.q_proj.weight": rand(HEADS * hd, HIDDEN),
                   p + "self_attn.k_proj.weight": rand(KV_HEADS * hd, HIDDEN),
                   p + "self_attn.v_proj.weight": rand(KV_HEADS * hd, HIDDEN),
                   p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * hd),
                   p + "mlp.gate_proj.weight": rand(INTERMEDIATE, HIDDEN),
                   p + "mlp.up_proj.weight": rand(INTERMEDIATE, HIDDEN),
                   p + "mlp.down_proj.weight": rand(HIDDEN, INTERMEDIATE)})
        if spec["bias"]:
            hf.update({p + "self_attn.q_proj.bias": rand(HEADS * hd), p + "self_attn.k_proj.bias": rand(KV_HEADS * hd),
                       p + "self_attn.v_proj.bias": rand(KV_HEADS * hd)})
        if spec["qk_norm"]:
            hf.update({p + "self_attn.q_norm.weight": 1 + rand(hd), p + "self_attn.k_norm.weight": 1 + rand(hd)})

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hd)
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<s>"))
    w.add_eos_token_id(tokens.index("</s>"))
    w.add_pad_token_id(tokens.index("<pad>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    stored: dict[str, torch.Tensor] = {}
    for name, value in hf.items():
        kinds = {**MIX, **(kinds or {})} if qtype == "mix" else {}
        quant = getattr(gguf.GGMLQuantizationType, kinds.get(name.split(".")[-2], "F32") if qtype == "mix" else qtype)
        data = value
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = _permute(value, HEADS, HEADS)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = _permute(value, HEADS, KV_HEADS)
        gguf_name = _gguf_name(name)
        if value.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:  # llama.cpp keeps 1-D tensors in F32
            w.add_tensor(gguf_name, data)
            stored[name] = torch.from_numpy(value.copy())
        elif quant == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gguf_name, data.astype(np.float16))
            stored[name] = torch.from_numpy(value.astype(np.float16).astype(np.float32))
        elif quant.name in RANDOM_BLOCKS:   # a kind gguf cannot quantize: random blocks, stored as they dequantize
            raw = _random_blocks(quant.name, value.shape, gen)
            w.add_tensor(gguf_name, raw, raw_dtype=quant)
            stored[name] = torch.from_numpy(gguf.quants.dequantize(raw, quant).copy())
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(data, quant), raw_dtype=quant)
            # quantization rounds per block of a row; permuting rows first does not change any row's values
            stored[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(value, quant), quant).copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


_GGUF_NAMES = [("model.embed_tokens.", "token_embd."), ("model.norm.", "output_norm."), ("lm_head.", "output."),
               ("model.layers.", "blk."), (".input_layernorm.", ".attn_norm."),
               (".post_attention_layernorm.", ".ffn_norm."), (".self_attn.q_proj.", ".attn_q."),
               (".self_attn.k_proj.", ".attn_k."), (".self_attn.v_proj.", ".attn_v."),
               (".self_attn.o_proj.", ".attn_output."), (".self_attn.q_norm.", ".attn_q_norm."),
               (".self_attn.k_norm.", ".attn_k_norm."), (".mlp.gate_proj.", ".ffn_gate."),
               (".mlp.up_proj.", ".ffn_up."), (".mlp.down_proj.", ".ffn_down.")]


def _gguf_name(hf_name: str) -> str:
    name = hf_name
    for a, b in _GGUF_NAMES:
        name = name.replace(a, b)
    return name
