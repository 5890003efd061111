"""The LoRA inputs and nodes of an engine built with --lora-target-modules (core/lora.py has the layout), a mixin of
model_graph's builder:

    normed ─qkv_proj─▶ LoraAdd(lora.{i}.qkv.a|b) ─▶ attention ─o_proj─▶ LoraAdd(dense) ─▶ add + norm
    normed ─gate_up_proj─▶ LoraAdd(gate_up) ─▶ act(gate) * up ─down_proj─▶ LoraAdd(down) ─▶ ...

The adapters are graph inputs that the session binds to its resident slots (runtime/lora/); lora_index names each
token's slot. Each adapted projection's output gets its LoraAdd node (plugins/lora.py); proj() adds it.
"""
from __future__ import annotations

import re

from onnx import TensorProto

from engine.core import lora
from engine.core.errors import EngineError
from engine.plugins.lora import lora_add

# canonical projection tensors -> their LoRA group (core/lora.GROUPS); a MoE layer's experts are not adapted
_GROUP_OF = {"attention.qkv.weight": "qkv", "attention.dense.weight": "dense", "mlp.gate_up.weight": "gate_up",
             "mlp.down.weight": "down"}
_LAYER_TENSOR = re.compile(r"layers\.(\d+)\.(.+)")


def check_lora_build(model, build) -> None:
    """Refuse what LoRA engines do not support yet, naming the flag."""
    if not build.lora_target_modules:
        return
    if build.lora_dtype not in lora.LORA_DTYPES:
        raise EngineError(f"lora_dtype {build.lora_dtype!r} is not one of {', '.join(lora.LORA_DTYPES)}", usage=True)
    why = ("tensor parallelism (--tp > 1)" if build.tp_size > 1 else
           "the tensorrt backend" if build.backend == "tensorrt" else
           "mixture-of-experts models" if model.moe is not None else None)
    if why:
        raise EngineError(f"--lora-target-modules is not supported with {why} yet; build without it, or with "
                          "--tp 1 --backend onnxruntime on a dense model", usage=True)


class LoraLayers:
    def lora_inputs(self) -> None:
        self.lora_groups = lora.target_groups(self.b.lora_target_modules)
        if not self.lora_groups:
            return
        g, elem = self.g, TensorProto.BFLOAT16 if self.b.lora_dtype == "bfloat16" else TensorProto.FLOAT
        g.input(lora.LORA_INDEX, TensorProto.INT64, ["T"])
        for i in range(self.m.num_layers):
            for group in self.lora_groups:
                k, n = lora.group_shape(self.m, group)
                g.input(lora.lora_a_name(i, group), elem, ["lora_slots", f"lora_rows_{group}", k])
                g.input(lora.lora_b_name(i, group), elem, ["lora_slots", f"lora_rows_{group}", n])

    def lora_group(self, weight_name: str) -> tuple[int, str] | None:
        """(layer, group) of a projection tensor this engine adapts, else None."""
        match = _LAYER_TENSOR.fullmatch(weight_name)
        group = _GROUP_OF.get(match.group(2)) if match else None
        return (int(match.group(1)), group) if group in self.lora_groups else None

    def with_lora(self, y: str, x: str, weight_name: str, name: str) -> str:
        """y, plus the LoRA delta of each token's adapter where this engine adapts the projection."""
        target = self.lora_group(weight_name)
        if target is None:
            return y
        layer, group = target
        return lora_add(self.g, y, x, lora.LORA_INDEX, lora.lora_a_name(layer, group),
                        lora.lora_b_name(layer, group), columns=lora.group_columns(self.m, group),
                        name=f"{name}/lora", kernel=self.p.engine_kernels_plugin,
                        bf16=self.b.lora_dtype == "bfloat16")
