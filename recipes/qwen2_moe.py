"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention, mixture-of-experts MLPs with a gated shared
expert.

Checked against transformers 5.25 (models/qwen2_moe/configuration_qwen2_moe.py, modeling_qwen2_moe.py):
- Qwen2MoeSparseMoeBlock: the routed experts as Qwen3-MoE's (softmax over num_experts, top num_experts_per_tok,
  renormalized iff norm_topk_prob, default false), plus `shared_expert`, a gated MLP of
  shared_expert_intermediate_size on every token, scaled by sigmoid(shared_expert_gate(x)) (a Linear [1, hidden]).
  The block always has both; dense layers (mlp_only_layers, decoder_sparse_step) as Qwen3-MoE's.
- q/k/v carry a bias iff config.qkv_bias (default true); o_proj has none.
- Qwen2MoeConfig.__post_init__ sets sliding_window to 0 unless use_sliding_window, and derives absent layer_types as
  "sliding_attention" iff (i + 1) % 2 and i < max_window_layers and use_sliding_window (not Qwen2's rule).
"""
from __future__ import annotations

from engine.core.model_config import MoeConfig

from .moe import MoeRecipe
from .qwen2 import Qwen2Recipe
from .qwen3_moe import QWEN_EXPERT_NAMES, qwen_dense_layers


class Qwen2MoeRecipe(MoeRecipe, Qwen2Recipe):
    architecture = "Qwen2MoeForCausalLM"
    TENSOR_NAMES = {
        **Qwen2Recipe.TENSOR_NAMES,   # the dense MLP of mlp_only_layers keeps Llama's names
        "model.layers.{i}.mlp.gate.weight": "layers.{i}.moe.router.weight",
        "model.layers.{i}.mlp.shared_expert.gate_proj.weight": "layers.{i}.moe.shared.gate.weight",
        "model.layers.{i}.mlp.shared_expert.up_proj.weight": "layers.{i}.moe.shared.up.weight",
        "model.layers.{i}.mlp.shared_expert.down_proj.weight": "layers.{i}.moe.shared.down.weight",
        "model.layers.{i}.mlp.shared_expert_gate.weight": "layers.{i}.moe.shared_gate.weight",
    }
    EXPERT_NAMES = QWEN_EXPERT_NAMES
    DEFAULTS = {**Qwen2Recipe.DEFAULTS, "qkv_bias": True, "decoder_sparse_step": 1, "norm_topk_prob": False,
                "shared_expert_intermediate_size": 5632}

    @property
    def QKV_BIAS(self) -> bool:   # noqa: N802 (Qwen2Recipe's class constant, a config key here)
        return bool(self.get("qkv_bias"))

    def moe_config(self) -> MoeConfig:
        return MoeConfig(num_experts=self.num_experts(), top_k=self.require("num_experts_per_tok"),
                         intermediate_size=self.require("moe_intermediate_size"),
                         normalize_top_k=bool(self.get("norm_topk_prob")),
                         shared_intermediate_size=self.require("shared_expert_intermediate_size"), shared_gate=True,
                         dense_layers=qwen_dense_layers(self))

    def hf_layer_types(self) -> list[str] | None:
        types = self.hf.get("layer_types")
        if types:
            return types
        sliding = self.get("use_sliding_window", False)
        first_full = self.get("max_window_layers", 0)
        return ["sliding_attention" if sliding and (i + 1) % 2 and i < first_full else "full_attention"
                for i in range(self.require("num_hidden_layers"))]
