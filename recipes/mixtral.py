"""Mixtral (8x7B, 8x22B): Mistral's attention and sliding window, every layer's MLP a mixture of experts.

Checked against transformers 5.25 (models/mixtral/configuration_mixtral.py, modeling_mixtral.py):
- MixtralDecoderLayer always builds MixtralSparseMoeBlock (no dense layers, no shared expert). Its router
  (MixtralTopKRouter, `block_sparse_moe.gate` in checkpoints) computes softmax(x @ W^T) in float32 over all
  num_local_experts, keeps the num_experts_per_tok largest and divides them by their sum: always normalized.
- Each expert (`block_sparse_moe.experts.{e}`) is w2(silu(w1 x) * w3 x): w1 the gate, w3 the up, w2 the down
  projection, of intermediate_size each. router_jitter_noise only acts in training.
- Attention, norms and the one mask for all layers are Mistral's (MixtralConfig's sliding_window defaults to null,
  its rope_theta to 1e6).
"""
from __future__ import annotations

from engine.core.model_config import MoeConfig

from .llama import LlamaRecipe
from .mistral import MistralRecipe
from .moe import MoeRecipe


class MixtralRecipe(MoeRecipe, MistralRecipe):
    architecture = "MixtralForCausalLM"
    TENSOR_NAMES = {
        **{hf: canon for hf, canon in LlamaRecipe.TENSOR_NAMES.items() if ".mlp." not in hf},
        "model.layers.{i}.block_sparse_moe.gate.weight": "layers.{i}.moe.router.weight",
        "model.layers.{i}.mlp.gate.weight": "layers.{i}.moe.router.weight",   # transformers 5's in-memory name
    }
    EXPERT_NAMES = {
        "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight": "moe.experts.gate.weight",
        "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight": "moe.experts.up.weight",
        "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight": "moe.experts.down.weight",
    }
    DEFAULTS = {"sliding_window": None, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
                "num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6}

    def moe_config(self) -> MoeConfig:
        return MoeConfig(num_experts=self.num_experts(), top_k=self.require("num_experts_per_tok"),
                         intermediate_size=self.require("intermediate_size"), normalize_top_k=True)
