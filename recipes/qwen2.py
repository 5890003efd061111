"""Qwen2 / Qwen2.5: Llama + bias on the q, k and v projections (o_proj has none), optional sliding windows.

Checked against transformers 5.24 (models/qwen2/configuration_qwen2.py, modeling_qwen2.py):
- q_proj, k_proj, v_proj are Linear(bias=True); o_proj and the MLP have no bias.
- Qwen2Config.__post_init__: `sliding_window = sliding_window if use_sliding_window else None`, so a config with
  use_sliding_window false (every released Qwen2.5) has no window whatever its sliding_window says. When
  config.json has no layer_types, layer i is "sliding_attention" iff a window is set and i >= max_window_layers;
  an explicit layer_types list wins. Each attention layer uses the window only when its type is sliding.
- head_dim is `getattr(config, "head_dim", hidden_size // num_attention_heads)`.
"""
from __future__ import annotations

from .llama import LlamaRecipe


class Qwen2Recipe(LlamaRecipe):
    architecture = "Qwen2ForCausalLM"
    TENSOR_NAMES = {
        **LlamaRecipe.TENSOR_NAMES,
        "model.layers.{i}.self_attn.q_proj.bias": "layers.{i}.attention.q.bias",
        "model.layers.{i}.self_attn.k_proj.bias": "layers.{i}.attention.k.bias",
        "model.layers.{i}.self_attn.v_proj.bias": "layers.{i}.attention.v.bias",
    }
    DEFAULTS = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
                "max_position_embeddings": 32768, "rms_norm_eps": 1e-6}
    QKV_BIAS = True

    def model_config_fields(self) -> dict:
        fields = super().model_config_fields()
        fields["qkv_bias"] = self.QKV_BIAS
        window = self.get("sliding_window") if self.get("use_sliding_window", False) else None
        fields.update(self.sliding_fields(self.layer_types(), window))
        return fields

    def hf_layer_types(self) -> list[str] | None:
        types = self.hf.get("layer_types")
        if types:
            return types
        window = self.get("sliding_window") if self.get("use_sliding_window", False) else None
        first_sliding = self.get("max_window_layers", 0)
        return ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                for i in range(self.require("num_hidden_layers"))]
