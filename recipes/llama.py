"""Llama (SmolLM2, TinyLlama, Llama 2/3.x with rope scaling): the family every other recipe is a diff over."""
from __future__ import annotations

from engine.core.errors import EngineError

from .base import Recipe


class LlamaRecipe(Recipe):
    architecture = "LlamaForCausalLM"
    TENSOR_NAMES = {
        "model.embed_tokens.weight": "vocab_embedding.weight",
        "model.layers.{i}.input_layernorm.weight": "layers.{i}.attn_norm.weight",
        "model.layers.{i}.self_attn.q_proj.weight": "layers.{i}.attention.q.weight",
        "model.layers.{i}.self_attn.k_proj.weight": "layers.{i}.attention.k.weight",
        "model.layers.{i}.self_attn.v_proj.weight": "layers.{i}.attention.v.weight",
        "model.layers.{i}.self_attn.o_proj.weight": "layers.{i}.attention.dense.weight",
        "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.mlp_norm.weight",
        "model.layers.{i}.mlp.gate_proj.weight": "layers.{i}.mlp.gate.weight",
        "model.layers.{i}.mlp.up_proj.weight": "layers.{i}.mlp.up.weight",
        "model.layers.{i}.mlp.down_proj.weight": "layers.{i}.mlp.down.weight",
        "model.norm.weight": "final_norm.weight",
        "lm_head.weight": "lm_head.weight",
    }

    def model_config_fields(self) -> dict:
        for flag in ("attention_bias", "mlp_bias"):
            if self.get(flag, False):
                raise EngineError(f"{self.architecture} with {flag}=true is not supported yet")
        return {}
