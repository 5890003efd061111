"""Mistral (Mistral 7B v0.1-v0.3, Mistral-Nemo, Mistral Small): Llama with an optional sliding window.

Checked against transformers 5.24 (models/mistral/modeling_mistral.py, configuration_mistral.py):
- Tensors and the decoder block are Llama's; head_dim may differ from hidden_size / heads (Nemo: 128).
- MistralModel builds ONE mask for all layers: `create_sliding_window_causal_mask` when config.sliding_window is
  not None, else the causal mask. So every layer is "sliding" when a window is set. MistralConfig accepts a
  `layer_types` key but only warns about it ("use Ministral classes instead"); MistralForCausalLM ignores it, and
  so do we, so that our model computes what transformers computes for this architecture.
- MistralConfig's sliding_window defaults to 4096 when config.json omits the key (Mistral 7B v0.1 era); an
  explicit null (v0.2 and later) means full attention.
"""
from __future__ import annotations

from .llama import LlamaRecipe


class MistralRecipe(LlamaRecipe):
    architecture = "MistralForCausalLM"
    DEFAULTS = {"sliding_window": 4096, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6}

    def model_config_fields(self) -> dict:
        fields = super().model_config_fields()
        window = self.get("sliding_window")
        types = ("sliding",) * self.require("num_hidden_layers") if window else ()
        fields.update(self.sliding_fields(types, window))
        return fields
