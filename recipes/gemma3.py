"""Gemma 3 (text-only Gemma3ForCausalLM: gemma-3-1b, and the text towers saved as such): Gemma 2 + q/k norms,
per-layer-type rotary, no attention soft-capping.

Checked against transformers 5.24 (models/gemma3/configuration_gemma3.py, modeling_gemma3.py). Everything in
recipes/gemma2.py holds (sandwich norms, float32 (1 + w) RMSNorm, embeddings * sqrt(hidden_size) rounded to the
weight dtype, scaling = query_pre_attn_scalar ** -0.5, gelu_pytorch_tanh, tied embeddings), except:
- q_norm / k_norm: Gemma3RMSNorm(head_dim), the same float32 (1 + w) norm (norm_weight_offset applies to them
  too), on q and k per head after the projections and BEFORE the rotary embedding.
- Rotary per layer type: Gemma3RotaryEmbedding keeps one inv_freq per type and each layer takes the one of its
  layer_types entry. rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}; older configs give
  rope_theta (+ rope_scaling) for the full layers, default theta 1e6, and rope_local_base_freq for the sliding
  layers, default 1e4 (rope_scaling never applies to them). ModelConfig.rope is the full layers' rotary,
  ModelConfig.local_rope the sliding layers' when it differs.
- Gemma3Attention never passes attn_logit_softcapping to the attention function, so no soft-capping of scores
  even when the config sets it (default null); final_logit_softcapping is applied when set (default null).
- layer_types default (config without them): layer i slides iff (i + 1) % sliding_window_pattern (default 6:
  five sliding layers, then one full).
"""
from __future__ import annotations

from engine.core.model_config import RopeConfig

from .gemma2 import Gemma2Recipe


class Gemma3Recipe(Gemma2Recipe):
    architecture = "Gemma3ForCausalLM"
    TENSOR_NAMES = {
        **Gemma2Recipe.TENSOR_NAMES,
        "model.layers.{i}.self_attn.q_norm.weight": "layers.{i}.attention.q_norm.weight",
        "model.layers.{i}.self_attn.k_norm.weight": "layers.{i}.attention.k_norm.weight",
    }
    DEFAULTS = {**Gemma2Recipe.DEFAULTS, "max_position_embeddings": 131072, "final_logit_softcapping": None,
                "attn_logit_softcapping": None, "sliding_window_pattern": 6, "rope_theta": 1_000_000.0,
                "rope_local_base_freq": 10_000.0}
    # layer type -> the legacy config key of its rotary base
    _THETA_KEYS = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}

    def model_config_fields(self) -> dict:
        fields = super().model_config_fields()
        fields.update(qk_norm=True, attn_logit_softcap=None)
        if "sliding" in fields["layer_types"]:
            local = self.rope("sliding_attention")
            fields["local_rope"] = None if local == self.rope("full_attention") else local
        return fields

    def rope(self, layer_type: str = "full_attention") -> RopeConfig:
        per_type = self.hf.get("rope_parameters") or {}
        params = dict(per_type.get(layer_type) or {"rope_type": "default"})
        if layer_type == "full_attention":
            params.update(self.hf.get("rope_scaling") or {})  # legacy rope_scaling is the full layers' only
        params.setdefault("rope_theta", self.get(self._THETA_KEYS[layer_type]))
        return self.rope_config(params)

    def hf_layer_types(self) -> list[str] | None:
        pattern = self.get("sliding_window_pattern")
        return self.hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(self.require("num_hidden_layers"))]
