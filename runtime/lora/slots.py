"""The resident adapters of a session: per layer and group one a [S, R_g, in] and one b [S, R_g, out] array
(core/lora.py's layout), allocated once and bound to the graph's LoRA inputs, so a slot is loaded by writing its
rows in place. Slot 0 is "no adapter" and stays zero. bfloat16 slots (ml_dtypes) round the adapter's float32
values to nearest even as they are written.
"""
from __future__ import annotations

import numpy as np

from engine.core import lora
from engine.core.model_config import ModelConfig

from .adapter import LoraWeights


class LoraSlots:
    def __init__(self, model: ModelConfig, target_modules: tuple[str, ...], num_slots: int, max_rank: int,
                 dtype: str = "float32"):
        self.model, self.num_slots, self.max_rank = model, num_slots, max_rank
        np_dtype = np.float32
        if dtype == "bfloat16":
            import ml_dtypes   # only here: its import costs a cold start ~0.3 s (0.8 s on a loaded host)
            np_dtype = ml_dtypes.bfloat16
        self.groups = lora.target_groups(target_modules)
        self.a: dict[tuple[int, str], np.ndarray] = {}
        self.b: dict[tuple[int, str], np.ndarray] = {}
        for i in range(model.num_layers):
            for g in self.groups:
                k, n = lora.group_shape(model, g)
                rows = lora.group_row_blocks(g) * max_rank
                self.a[(i, g)] = np.zeros((num_slots, rows, k), dtype=np_dtype)
                self.b[(i, g)] = np.zeros((num_slots, rows, n), dtype=np_dtype)

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.a.values(), *self.b.values()))

    def inputs(self) -> dict[str, np.ndarray]:
        """The graph's LoRA input names and the arrays to bind to them."""
        named = {}
        for (i, g), a in self.a.items():
            named[lora.lora_a_name(i, g)] = a
            named[lora.lora_b_name(i, g)] = self.b[(i, g)]
        return named

    def write(self, slot: int, weights: LoraWeights) -> None:
        """Load `weights` into `slot` (1 .. num_slots - 1), replacing what it held."""
        assert 0 < slot < self.num_slots, slot
        for key in self.a:
            self.a[key][slot] = 0
            self.b[key][slot] = 0
        for (layer, module), (a, b) in weights.modules.items():
            group = lora.MODULE_GROUP[module]
            start = lora.GROUPS[group].index(module) * self.max_rank
            rows = slice(start, start + a.shape[0])
            c0, c1 = lora.module_columns(self.model, module)
            self.a[(layer, group)][slot, rows] = a
            self.b[(layer, group)][slot, rows, c0:c1] = b
