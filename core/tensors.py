"""The canonical tensors of a model: every logical tensor's name and full shape, how each is split across
tensor-parallel ranks, and the shape one rank holds. One table serves the converter (completeness and shape
checks), the sharder (core/sharding.py) and the memory plan (builder/memory.py). Plain integers, no torch.

Logical names are per HF projection (`layers.3.attention.q.weight`), shapes in torch Linear layout
[out_features, in_features]. `lm_head.weight` is absent when the embeddings are tied. A mixture-of-experts layer
(ModelConfig.moe) has no `mlp.*`: its router `moe.router` [experts, hidden], its experts stacked on a leading axis
(`moe.experts.gate` [experts, expert_inter, hidden], `.up`, `.down` [experts, hidden, expert_inter]) and, with a
shared expert, `moe.shared.gate|up|down` as a dense MLP's plus `moe.shared_gate` [1, hidden] when it is gated.
Column and row splits cut the last two axes (out and in features), so a stacked expert splits as one projection.
"""
from __future__ import annotations

import math
import re

from .model_config import ModelConfig
from .parallel import kv_heads_per_rank, padded_vocab_size

# logical suffix (without ".weight"/".bias") -> how tensor parallelism splits it; absent means replicated
SPLITS = {
    "attention.q": "q_heads",
    "attention.k": "kv_heads",
    "attention.v": "kv_heads",
    "attention.dense": "row",
    "mlp.gate": "column",
    "mlp.up": "column",
    "mlp.down": "row",
    "moe.experts.gate": "column",
    "moe.experts.up": "column",
    "moe.experts.down": "row",
    "moe.shared.gate": "column",
    "moe.shared.up": "column",
    "moe.shared.down": "row",
    "lm_head": "vocab",
}

_LAYER = re.compile(r"^(layers\.\d+\.)(.+)\.(weight|bias)$")
_TOP = re.compile(r"^()(.+)\.(weight|bias)$")


def split_name(name: str) -> tuple[str, str, str]:
    """'layers.3.attention.q.weight' -> ('layers.3.', 'attention.q', 'weight')."""
    m = _LAYER.match(name) or _TOP.match(name)
    if m is None:
        raise ValueError(f"not a canonical tensor name: {name}")
    return m.group(1), m.group(2), m.group(3)


def split_kind(name: str) -> str:
    return SPLITS.get(split_name(name)[1], "replicated")


def logical_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every logical tensor of a complete model and its full (unsharded) shape."""
    h, hd, inter = model.hidden_size, model.head_dim, model.intermediate_size
    q, kv = model.q_size, model.kv_size
    shapes: dict[str, tuple[int, ...]] = {"vocab_embedding.weight": (model.vocab_size, h), "final_norm.weight": (h,)}
    if not model.tie_word_embeddings:
        shapes["lm_head.weight"] = (model.vocab_size, h)
    layer = {
        "attn_norm.weight": (h,),
        "attention.q.weight": (q, h),
        "attention.k.weight": (kv, h),
        "attention.v.weight": (kv, h),
        "attention.dense.weight": (h, q),
        "mlp_norm.weight": (h,),
        "mlp.gate.weight": (inter, h),
        "mlp.up.weight": (inter, h),
        "mlp.down.weight": (h, inter),
    }
    if model.qkv_bias:
        layer.update({"attention.q.bias": (q,), "attention.k.bias": (kv,), "attention.v.bias": (kv,)})
    if model.qk_norm:
        layer.update({"attention.q_norm.weight": (hd,), "attention.k_norm.weight": (hd,)})
    if model.sandwich_norms:
        layer.update({"attn_post_norm.weight": (h,), "mlp_post_norm.weight": (h,)})
    dense_mlp = ("mlp.gate.weight", "mlp.up.weight", "mlp.down.weight")
    moe_layer = {k: v for k, v in layer.items() if k not in dense_mlp} | moe_shapes(model)
    for i in range(model.num_layers):
        shapes.update({f"layers.{i}.{name}": shape
                       for name, shape in (moe_layer if model.is_moe_layer(i) else layer).items()})
    return shapes


def moe_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The logical tensors of a mixture-of-experts MLP (module docstring), by their names inside a layer."""
    moe = model.moe
    if moe is None:
        return {}
    h, e, inter, shared = model.hidden_size, moe.num_experts, moe.intermediate_size, moe.shared_intermediate_size
    shapes = {"moe.router.weight": (e, h), "moe.experts.gate.weight": (e, inter, h),
              "moe.experts.up.weight": (e, inter, h), "moe.experts.down.weight": (e, h, inter)}
    if shared:
        shapes.update({"moe.shared.gate.weight": (shared, h), "moe.shared.up.weight": (shared, h),
                       "moe.shared.down.weight": (h, shared)})
    if moe.shared_gate:
        shapes["moe.shared_gate.weight"] = (1, h)
    return shapes


def is_expert(name: str) -> bool:
    """Whether `name` is a stacked expert tensor (the ones expert parallelism splits by expert)."""
    return split_name(name)[1].startswith("moe.experts.")


def rank_shape(name: str, shape: tuple[int, ...], model: ModelConfig, tp: int, ep: int = 1) -> tuple[int, ...]:
    """The shape of the slice of logical tensor `name` that each of `tp` ranks holds; with expert parallelism
    (`ep` > 1, core/sharding.shard_experts) a stacked expert is split ep ways by expert and tp / ep ways as a
    projection."""
    if ep > 1 and is_expert(name):
        return rank_shape(name, (shape[0] // ep, *shape[1:]), model, tp // ep)
    kind = split_kind(name)
    rest = tuple(shape[1:])
    if kind == "replicated" or tp == 1:
        return tuple(shape)
    if kind == "q_heads":
        return (model.num_heads // tp * model.head_dim, *rest)
    if kind == "kv_heads":
        return (kv_heads_per_rank(model, tp) * model.head_dim, *rest)
    if kind == "column":   # the out features: axis 0, or 1 of stacked experts
        return (*shape[:-2], shape[-2] // tp, shape[-1])
    if kind == "row":      # the in features: the last axis
        return (*shape[:-1], shape[-1] // tp)
    if kind == "vocab":
        return (padded_vocab_size(model, tp) // tp, *rest)
    raise AssertionError(kind)


def rank_elements(model: ModelConfig, tp: int, ep: int = 1) -> int:
    """Weight elements one rank holds (every rank holds the same); a tied lm_head gets shards only when tp > 1."""
    shapes = logical_shapes(model)
    if model.tie_word_embeddings and tp > 1:
        shapes["lm_head.weight"] = shapes["vocab_embedding.weight"]
    return sum(math.prod(rank_shape(name, shape, model, tp, ep)) for name, shape in shapes.items())
