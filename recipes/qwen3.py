"""Qwen3 (dense): Qwen2 without the qkv bias, with RMSNorm of q and k over head_dim and an explicit head_dim.

Checked against transformers 5.24 (models/qwen3/configuration_qwen3.py, modeling_qwen3.py):
- q_norm / k_norm are Qwen3RMSNorm(head_dim) (plain x * rsqrt(mean(x^2) + eps) * w, the weight multiplied after
  casting back to the input dtype, as Llama's), applied per head to q and k after the projection and before the
  rotary embedding; eps is rms_norm_eps.
- head_dim comes from config (Qwen3Config's default is 128, not hidden_size / heads: Qwen3-0.6B has hidden 1024,
  16 heads, head_dim 128), so q_size can differ from hidden_size.
- attention_bias (default false) would put a bias on q, k, v AND o_proj; we have no o_proj bias, so Llama's
  check refuses it.
- Sliding windows: the same use_sliding_window / max_window_layers / layer_types rules as Qwen2.
"""
from __future__ import annotations

from .llama import LlamaRecipe
from .qwen2 import Qwen2Recipe


class Qwen3Recipe(Qwen2Recipe):
    architecture = "Qwen3ForCausalLM"
    TENSOR_NAMES = {
        **LlamaRecipe.TENSOR_NAMES,
        "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attention.q_norm.weight",
        "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attention.k_norm.weight",
    }
    DEFAULTS = {**Qwen2Recipe.DEFAULTS, "head_dim": 128}
    QKV_BIAS = False

    def model_config_fields(self) -> dict:
        return {**super().model_config_fields(), "qk_norm": True}
