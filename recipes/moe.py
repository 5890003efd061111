"""What the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) add to their dense relatives: the router, the
experts stacked on a leading axis under one canonical name each, and MoeConfig (core/model_config.py).

Hugging Face checkpoints store one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`; Mixtral:
`block_sparse_moe.experts.{e}.w1.weight`); transformers 5 holds them stacked in memory (`mlp.experts.gate_up_proj`
[experts, 2 * inter, hidden], `mlp.experts.down_proj` [experts, hidden, inter]) and writes them back per expert, but
accepts either. Both become the logical stacked tensors of core/tensors.py:

    experts.{e}.gate_proj.weight [inter, hidden], each e  ──stack──▶  moe.experts.gate.weight [experts, inter, hidden]
    experts.gate_up_proj [experts, 2 * inter, hidden]  ──halves──▶  moe.experts.gate.weight, moe.experts.up.weight

A per-expert tensor is held until the layer's last expert of that projection arrives (one projection of one layer:
the size of the stacked tensor the checkpoint stores anyway).
"""
from __future__ import annotations

import re
from typing import ClassVar, Iterable

import torch

from engine.core.errors import EngineError
from engine.core.model_config import MoeConfig

from .base import Recipe

# transformers 5's stacked layout, shared by the three families (their Experts modules)
STACKED_NAMES = {
    "model.layers.{i}.mlp.experts.gate_up_proj": ("moe.experts.gate.weight", "moe.experts.up.weight"),
    "model.layers.{i}.mlp.experts.down_proj": ("moe.experts.down.weight",),
}


def _pattern(hf: str) -> re.Pattern:
    return re.compile("^" + re.escape(hf).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{e\}", r"(?P<e>\d+)") + "$")


class MoeRecipe(Recipe):
    """A mixin over a dense family's recipe: `class MixtralRecipe(MoeRecipe, MistralRecipe)`."""
    # HF name of one expert's projection ("{i}" the layer, "{e}" the expert) -> logical stacked name (no "layers.{i}.")
    EXPERT_NAMES: ClassVar[dict[str, str]] = {}

    def __init__(self, hf_config: dict):
        super().__init__(hf_config)
        self._experts = [(_pattern(hf), canon) for hf, canon in self.EXPERT_NAMES.items()]
        self._stacked = [(_pattern(hf), canons) for hf, canons in STACKED_NAMES.items()]
        self._pending: dict[str, dict[int, torch.Tensor]] = {}

    # ---- config -------------------------------------------------------------------------------------------

    def moe_config(self) -> MoeConfig:
        """The family's MoeConfig; Qwen's override adds norm_topk_prob, the shared expert and dense layers."""
        raise NotImplementedError

    def num_experts(self) -> int:
        # Qwen3MoeConfig maps num_experts onto num_local_experts, which transformers 5 writes to config.json
        experts = self.get("num_experts", self.get("num_local_experts"))
        if experts is None:
            raise EngineError(f"config.json of this {self.architecture} model names no number of experts "
                              "(num_experts or num_local_experts); the model directory is incomplete")
        return experts

    def model_config_fields(self) -> dict:
        return {**super().model_config_fields(), "moe": self.moe_config()}

    # ---- tensors ------------------------------------------------------------------------------------------

    def modify_tensors(self, hf_name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for pattern, canon in self._experts:
            m = pattern.match(hf_name)
            if m:
                yield from self._stack(f"layers.{m['i']}.{canon}", int(m["e"]), tensor, hf_name)
                return
        for pattern, canons in self._stacked:
            m = pattern.match(hf_name)
            if m:
                parts = tensor.chunk(len(canons), dim=1) if len(canons) > 1 else (tensor,)
                yield from ((f"layers.{m['i']}.{canon}", part) for canon, part in zip(canons, parts))
                return
        yield from super().modify_tensors(hf_name, tensor)

    def _stack(self, name: str, expert: int, tensor: torch.Tensor, hf_name: str):
        """Hold expert `expert`'s tensor of stacked tensor `name`; yield the stack once every expert is in."""
        count = self.num_experts()
        if not 0 <= expert < count:
            raise EngineError(f"tensor {hf_name} is of expert {expert}, but config.json gives the model {count} "
                              "experts; the weights do not belong to this config.json")
        pending = self._pending.setdefault(name, {})
        if expert in pending:
            raise EngineError(f"the source has {hf_name} twice; the checkpoint is inconsistent")
        pending[expert] = tensor
        if len(pending) == count:
            del self._pending[name]
            shapes = {tuple(t.shape) for t in pending.values()}
            if len(shapes) != 1:
                raise EngineError(f"the experts of {name} have different shapes {sorted(shapes)}; the checkpoint "
                                  "is inconsistent")
            yield name, torch.stack([pending[e] for e in range(count)])
