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

# family -> how llama.cpp writes it: arch (general.architecture, default the key), name (general.name, default
# "tiny KEY"), head_dim, tied embeddings, q/k/v biases, q/k norms, gemma (sandwich norms stored as 1 + w, Gemma's
# metadata), fused (Phi-3's attn_qkv and gate|up ffn_up)
SPECS = {
    "llama": dict(head_dim=16, tied=True, bias=False, qk_norm=False),
    "qwen2": dict(head_dim=16, tied=False, bias=True, qk_norm=False),
    # transformers' GGUF loader does not read head_dim for qwen3 and uses Qwen3Config's default, 128
    "qwen3": dict(head_dim=128, tied=False, bias=False, qk_norm=True),
    # Mistral 7B as llama.cpp writes it: arch llama (q/k permuted), named "mistral"
    "mistral": dict(arch="llama", name="mistral", head_dim=16, tied=False, bias=False, qk_norm=False),
    # transformers' GGUF config takes query_pre_attn_scalar from no key (default 256): head_dim 256 keeps them equal
    "gemma2": dict(head_dim=256, tied=True, bias=False, qk_norm=False, gemma=True),
    "gemma3": dict(head_dim=256, tied=True, bias=False, qk_norm=True, gemma=True),
    # Phi-3's head_dim is hidden / heads
    "phi3": dict(head_dim=16, tied=False, bias=False, qk_norm=False, fused=True),
}
SLIDING_WINDOW = 8   # Gemma's, as the tiny HF models' (tests/tiny_models.py)
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 4, 2
# qtype "mix": a kind per projection, as a Q4_K_M file mixes them (a v of another kind than q and k; every legacy
# block kind gguf can write)
MIX = {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q4_0", "gate_proj": "Q4_1", "up_proj": "Q4_1",
       "down_proj": "Q5_1", "embed_tokens": "Q8_0", "lm_head": "Q5_0"}
FUSED_MIX = {"qkv_proj": MIX["q_proj"], "gate_up_proj": MIX["gate_proj"]}   # Phi-3's fused tensors: one kind each


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
                    kinds: dict[str, str] | None = None, name: str | None = None) -> dict[str, torch.Tensor]:
    """Write the tiny `arch` model to `path`; `rope_scaling` = (type, factor) adds llama.cpp's rope.scaling keys;
    `kinds` overrides MIX's kind of some projections with qtype "mix" (e.g. {"o_proj": "IQ4_NL"}); `name`
    overrides general.name. Returns the tensors as transformers reads them back (HF names)."""
    import gguf

    spec = SPECS[arch]
    gguf_arch = spec.get("arch", arch)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok_dir = path.parent / f".{path.stem}-tokenizer"
    tok_dir.mkdir(exist_ok=True)
    tokens, types, merges = _tokenizer(tok_dir)
    gen = np.random.default_rng(seed)
    hf = _hf_tensors(spec, len(tokens), gen)

    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_name(name or spec.get("name", f"tiny {arch}"))
    _write_hparams(w, arch, rope_scaling)
    _write_tokenizer(w, tokens, types, merges)
    stored: dict[str, torch.Tensor] = {}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[gguf_arch.upper()], LAYERS)  # llama.cpp's own HF -> GGUF names
    mix = {**MIX, **FUSED_MIX, **(kinds or {})} if qtype == "mix" else {}
    for hf_name, value in hf.items():
        quant = getattr(gguf.GGMLQuantizationType, mix.get(hf_name.split(".")[-2], "F32") if qtype == "mix" else qtype)
        gguf_name = names.get_name(hf_name.rsplit(".", 1)[0]) + "." + hf_name.rsplit(".", 1)[1]
        stored[hf_name] = _add_tensor(w, spec, gguf_arch, hf_name, gguf_name, value, quant, gen)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _hf_tensors(spec: dict, vocab: int, gen: np.random.Generator) -> dict[str, np.ndarray]:
    """The model's random weights under their Hugging Face names."""
    hd = spec["head_dim"]
    rand = lambda *shape: (gen.standard_normal(shape) * 0.1).astype(np.float32)  # noqa: E731
    one = 0 if spec.get("gemma") else 1   # Gemma's RMSNorm multiplies by 1 + w: its weights are near 0
    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": rand(vocab, HIDDEN),
                                 "model.norm.weight": one + rand(HIDDEN)}
    if not spec["tied"]:
        hf["lm_head.weight"] = rand(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        hf.update({p + "input_layernorm.weight": one + rand(HIDDEN), p + "post_attention_layernorm.weight": one + rand(HIDDEN),
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
            hf.update({p + "self_attn.q_norm.weight": one + rand(hd), p + "self_attn.k_norm.weight": one + rand(hd)})
        if spec.get("gemma"):
            hf.update({p + "pre_feedforward_layernorm.weight": rand(HIDDEN),
                       p + "post_feedforward_layernorm.weight": rand(HIDDEN)})
        if spec.get("fused"):
            hf[p + "self_attn.qkv_proj.weight"] = np.concatenate([hf.pop(p + f"self_attn.{x}_proj.weight")
                                                                  for x in "qkv"])
            hf[p + "mlp.gate_up_proj.weight"] = np.concatenate([hf.pop(p + "mlp.gate_proj.weight"),
                                                                hf.pop(p + "mlp.up_proj.weight")])
    return hf


def _write_tokenizer(w, tokens: list[str], types: list[int], merges: list[str]) -> None:
    w.add_vocab_size(len(tokens))
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


def _add_tensor(w, spec: dict, gguf_arch: str, name: str, gguf_name: str, value: np.ndarray, quant,
                gen: np.random.Generator) -> torch.Tensor:
    """Write one tensor as `quant`; return its values as a GGUF reader gets them back."""
    import gguf
    data = value
    if gguf_arch == "llama" and name.endswith("q_proj.weight"):
        data = _permute(value, HEADS, HEADS)
    elif gguf_arch == "llama" and name.endswith("k_proj.weight"):
        data = _permute(value, HEADS, KV_HEADS)
    if spec.get("gemma") and name.endswith("norm.weight"):
        # llama.cpp stores Gemma's norms as 1 + w; transformers takes 1 back off, in float32
        data = value + np.float32(1)
        w.add_tensor(gguf_name, data)
        return torch.from_numpy(data - np.float32(1))
    if value.ndim == 1 or quant == gguf.GGMLQuantizationType.F32:  # llama.cpp keeps 1-D tensors in F32
        w.add_tensor(gguf_name, data)
        return torch.from_numpy(value.copy())
    if quant == gguf.GGMLQuantizationType.F16:
        w.add_tensor(gguf_name, data.astype(np.float16))
        return torch.from_numpy(value.astype(np.float16).astype(np.float32))
    if quant.name in RANDOM_BLOCKS:   # a kind gguf cannot quantize: random blocks, stored as they dequantize
        raw = _random_blocks(quant.name, value.shape, gen)
        w.add_tensor(gguf_name, raw, raw_dtype=quant)
        return torch.from_numpy(gguf.quants.dequantize(raw, quant).copy())
    w.add_tensor(gguf_name, gguf.quants.quantize(data, quant), raw_dtype=quant)
    # quantization rounds per block of a row; permuting rows first does not change any row's values
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(value, quant), quant).copy())


def _write_hparams(w, arch: str, rope_scaling: tuple[str, float] | None) -> None:
    """The keys convert_hf_to_gguf.py's model class for `arch` writes (LlamaModel, Qwen2Model, Gemma2Model,
    Gemma3Model, Phi3MiniModel)."""
    import gguf
    spec = SPECS[arch]
    hd = spec["head_dim"]
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    if arch != "gemma2":   # Gemma 2's rotary base is the default, written by none
        w.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if not spec.get("gemma"):
        w.add_rope_dimension_count(hd)
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    if spec.get("gemma"):
        w.add_sliding_window(SLIDING_WINDOW)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if arch == "phi3":   # llama.cpp and transformers both ignore Phi-3's window (llama.cpp: "Phi SWA is disabled")
        w.add_rope_scaling_orig_ctx_len(256)
        w.add_sliding_window(SLIDING_WINDOW)
    else:
        w.add_key_length(hd)
        w.add_value_length(hd)
