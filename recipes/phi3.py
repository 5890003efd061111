"""Phi-3 (Phi-3-mini/medium 4k, Phi-3.5-mini with short context): Mistral's sliding window, fused projections.

Checked against transformers 5.24 (models/phi3/configuration_phi3.py, modeling_phi3.py):
- self_attn.qkv_proj is one Linear with rows [q (heads * head_dim); k (kv_heads * head_dim); v (same)]
  (Phi3Attention slices its output at query_pos = heads * head_dim), and mlp.gate_up_proj has rows
  [gate (intermediate); up (intermediate)] (Phi3MLP: `gate, up = gate_up_proj(x).chunk(2, -1)`,
  `up * act(gate)`). modify_tensors splits both into the logical q/k/v and gate/up tensors, which the checkpoint
  re-packs per rank (core/sharding.py): the per-rank slicing of a fused tensor differs from a plain chunk.
- One mask for all layers, as Mistral: sliding when config.sliding_window is set (Phi-3-mini-4k: 2047), full
  otherwise; the window is copied unchanged (see Recipe.sliding_fields).
- RMSNorm, decoder block and lm_head are Llama's (resid dropouts are identity at inference); rms_norm_eps
  defaults to 1e-5.
Refused with an EngineError: rope_type "longrope" (also written "su" / "yarn" in older configs; the 128k models),
whose short/long factors switch with the sequence length, and partial_rotary_factor < 1 (Phi-4-mini), which
rotates only part of each head.
"""
from __future__ import annotations

from functools import cached_property
from typing import Iterable

import torch

from engine.core.errors import EngineError
from engine.core.model_config import ModelConfig, RopeConfig
from engine.core.sharding import PARTS
from engine.core.tensors import split_name

from .llama import LlamaRecipe
from .mistral import MistralRecipe


class Phi3Recipe(MistralRecipe):
    architecture = "Phi3ForCausalLM"
    TENSOR_NAMES = {
        **{hf: canon for hf, canon in LlamaRecipe.TENSOR_NAMES.items()
           if not hf.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                               "up_proj.weight"))},
        # fused in the source; modify_tensors splits them
        "model.layers.{i}.self_attn.qkv_proj.weight": "layers.{i}.attention.qkv.weight",
        "model.layers.{i}.mlp.gate_up_proj.weight": "layers.{i}.mlp.gate_up.weight",
    }
    DEFAULTS = {"sliding_window": None, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}

    def rope_config(self, params: dict) -> RopeConfig:
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type in ("longrope", "su", "yarn"):
            raise EngineError(f"rope type {rope_type!r} of this {self.architecture} model (the long-context Phi-3 "
                              "variants, whose rotary factors switch with the sequence length) is not supported; "
                              "use a short-context variant (e.g. Phi-3-mini-4k-instruct)")
        return super().rope_config(params)

    def modify_tensors(self, hf_name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        name = self.canonical_name(hf_name)
        if name is None:
            return
        prefix, packed, kind = split_name(name)
        if packed not in PARTS:
            yield name, tensor
            return
        model = self._model
        sizes = {"attention.qkv": [model.q_size, model.kv_size, model.kv_size],
                 "mlp.gate_up": [model.intermediate_size] * 2}[packed]
        if tensor.shape[0] != sum(sizes):
            raise EngineError(f"{hf_name} has {tensor.shape[0]} rows, config.json implies {sum(sizes)} "
                              f"({' + '.join(map(str, sizes))}); the checkpoint does not match its config")
        starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        for part, start, end in zip(PARTS[packed], starts, starts[1:]):
            # a GGUF file's kept blocks (GGUFTensor) are sliced by whole rows, as a float tensor is
            t = tensor[start:end] if isinstance(tensor, torch.Tensor) else tensor.rows(slice(start, end))
            yield f"{prefix}{part}.{kind}", t

    @cached_property
    def _model(self) -> ModelConfig:
        return self.model_config()
