"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms), mixture-of-experts MLPs.

Checked against transformers 5.25 (models/qwen3_moe/configuration_qwen3_moe.py, modeling_qwen3_moe.py):
- Layer i's MLP is Qwen3MoeSparseMoeBlock unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
  (then a dense MLP of intermediate_size). No shared expert.
- Qwen3MoeTopKRouter (`mlp.gate`): softmax(x @ W^T) in float32 over num_experts, the num_experts_per_tok largest,
  divided by their sum iff norm_topk_prob (config default false; the released models set it true). Experts
  (`mlp.experts.{e}.gate_proj|up_proj|down_proj`) are gated MLPs of moe_intermediate_size.
- Qwen3MoeConfig maps num_experts onto num_local_experts, which is what transformers 5 writes to config.json.
- head_dim: `getattr(config, "head_dim", hidden_size // num_attention_heads)` (released configs give 128); the
  attention's sliding_window is config.sliding_window, set only with use_sliding_window, then on every layer
  (one mask, as Mistral's). attention_bias is refused as for Qwen3.
"""
from __future__ import annotations

from engine.core.model_config import MoeConfig

from .moe import MoeRecipe
from .qwen3 import Qwen3Recipe

QWEN_EXPERT_NAMES = {
    "model.layers.{i}.mlp.experts.{e}.gate_proj.weight": "moe.experts.gate.weight",
    "model.layers.{i}.mlp.experts.{e}.up_proj.weight": "moe.experts.up.weight",
    "model.layers.{i}.mlp.experts.{e}.down_proj.weight": "moe.experts.down.weight",
}


def qwen_dense_layers(recipe: MoeRecipe) -> tuple[int, ...]:
    """Qwen2/3-MoE's layers with a dense MLP: listed in mlp_only_layers, or off the decoder_sparse_step."""
    only = set(recipe.get("mlp_only_layers", []))
    step = recipe.get("decoder_sparse_step", 1)
    return tuple(i for i in range(recipe.require("num_hidden_layers"))
                 if i in only or (i + 1) % step)


class Qwen3MoeRecipe(MoeRecipe, Qwen3Recipe):
    architecture = "Qwen3MoeForCausalLM"
    TENSOR_NAMES = {
        **Qwen3Recipe.TENSOR_NAMES,   # the dense MLP of mlp_only_layers keeps Llama's names
        "model.layers.{i}.mlp.gate.weight": "layers.{i}.moe.router.weight",
    }
    EXPERT_NAMES = QWEN_EXPERT_NAMES
    DEFAULTS = {**{k: v for k, v in Qwen3Recipe.DEFAULTS.items() if k != "head_dim"},
                "sliding_window": 4096, "decoder_sparse_step": 1, "norm_topk_prob": False}

    def moe_config(self) -> MoeConfig:
        return MoeConfig(num_experts=self.num_experts(), top_k=self.require("num_experts_per_tok"),
                         intermediate_size=self.require("moe_intermediate_size"),
                         normalize_top_k=bool(self.get("norm_topk_prob")), dense_layers=qwen_dense_layers(self))

    def hf_layer_types(self) -> list[str] | None:
        sliding = self.get("use_sliding_window", False)
        kind = "sliding_attention" if sliding else "full_attention"
        return [kind] * self.require("num_hidden_layers")

