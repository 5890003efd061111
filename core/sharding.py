"""Packing and tensor-parallel sharding of canonical tensors.

Recipes yield *logical* canonical tensors, one per HF projection (`layers.3.attention.q.weight`). A checkpoint
stores them *packed* (nano-vllm's packed_modules_mapping): q, k, v become one `attention.qkv` tensor and gate, up
become one `mlp.gate_up` tensor, each rank holding its own slice of every part:

    rank r of attention.qkv.weight          rank r of mlp.gate_up.weight
    +----------------------------+          +-------------------------+
    | q heads [r*H/tp, (r+1)*H/tp) |          | gate rows [r*I/tp, ...) |
    | k heads of rank r          |          | up rows   [r*I/tp, ...) |
    | v heads of rank r          |          +-------------------------+
    +----------------------------+

Splits (TensorRT-LLM's): column-parallel q/k/v, gate, up (dim 0); row-parallel attention.dense and mlp.down
(dim 1); vocab-parallel lm_head (dim 0, vocabulary zero-padded to a multiple of tp); everything else replicated.
When tp exceeds the KV heads, each rank gets a copy of KV head `r * kv_heads // tp`. Stacked experts
[experts, out, in] split and pack along their last two axes as one projection does (every rank holds every expert's
slice: the MoE's tensor parallelism), the router is replicated; their gate|up packs per expert:

    rank r of moe.experts.gate_up.weight  [experts, 2 * expert_inter / tp, hidden]
    expert e: | gate rows of rank r | up rows of rank r |
"""
from __future__ import annotations


import torch

from .errors import EngineError
from .model_config import ModelConfig
from .parallel import kv_heads_per_rank, padded_vocab_size
from .tensors import is_expert, split_kind, split_name

# logical suffix -> (packed suffix, part index, number of parts)
PACKED = {
    "attention.q": ("attention.qkv", 0),
    "attention.k": ("attention.qkv", 1),
    "attention.v": ("attention.qkv", 2),
    "mlp.gate": ("mlp.gate_up", 0),
    "mlp.up": ("mlp.gate_up", 1),
    "moe.experts.gate": ("moe.experts.gate_up", 0),
    "moe.experts.up": ("moe.experts.gate_up", 1),
    "moe.shared.gate": ("moe.shared.gate_up", 0),
    "moe.shared.up": ("moe.shared.gate_up", 1),
}
PARTS = {"attention.qkv": ("attention.q", "attention.k", "attention.v"), "mlp.gate_up": ("mlp.gate", "mlp.up"),
         "moe.experts.gate_up": ("moe.experts.gate", "moe.experts.up"),
         "moe.shared.gate_up": ("moe.shared.gate", "moe.shared.up")}


def out_axis(tensor) -> int:
    """The out-features axis of a weight (0, or 1 of stacked experts [experts, out, in]); 0 of a bias."""
    return max(tensor.ndim - 2, 0)

def shard(name: str, tensor: torch.Tensor, model: ModelConfig, tp: int, rank: int) -> torch.Tensor:
    """The slice of logical tensor `name` that rank `rank` of `tp` holds."""
    if tp == 1:
        return tensor
    kind = split_kind(name)
    hd = model.head_dim
    if kind == "replicated":
        return tensor
    if kind == "q_heads":
        rows = model.num_heads // tp * hd
        return tensor[rank * rows:(rank + 1) * rows]
    if kind == "kv_heads":
        if model.num_kv_heads >= tp:
            rows = model.num_kv_heads // tp * hd
            return tensor[rank * rows:(rank + 1) * rows]
        head = rank * model.num_kv_heads // tp
        return tensor[head * hd:(head + 1) * hd]
    if kind == "column":
        return tensor.chunk(tp, dim=out_axis(tensor))[rank]
    if kind == "row":
        return tensor.chunk(tp, dim=-1)[rank]
    if kind == "vocab":
        pad = padded_vocab_size(model, tp) - tensor.shape[0]
        if pad:
            tensor = torch.cat([tensor, tensor.new_zeros((pad, *tensor.shape[1:]))])
        return tensor.chunk(tp, dim=0)[rank]
    raise AssertionError(kind)


def shard_experts(name: str, tensor: torch.Tensor, model: ModelConfig, tp: int, ep: int, rank: int) -> torch.Tensor:
    """shard() with expert parallelism (an engine built with --moe-ep-size ep): the tp ranks form ep groups of
    tp / ep; rank r holds experts [(r % ep) E / ep, (r % ep + 1) E / ep) of each stacked expert tensor, cut tp / ep
    ways as a projection (slice r // ep, TensorRT-LLM's moe_tp_rank). Everything else is shard()'s."""
    if ep == 1 or not is_expert(name):
        return shard(name, tensor, model, tp, rank)
    local = model.moe.num_experts // ep
    first = rank % ep * local
    return shard(name, tensor[first:first + local], model, tp // ep, rank // ep)


class Packer:
    """Collects logical tensors of one rank and releases packed tensors as soon as all their parts arrived."""

    def __init__(self):
        self._pending: dict[str, dict[int, torch.Tensor]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        prefix, suffix, kind = split_name(name)
        if suffix not in PACKED:
            return [(name, tensor)]
        packed, index = PACKED[suffix]
        key = f"{prefix}{packed}.{kind}"
        parts = self._pending.setdefault(key, {})
        parts[index] = tensor
        if len(parts) < len(PARTS[packed]):
            return []
        del self._pending[key]
        ordered = [parts[i] for i in range(len(parts))]
        if all(isinstance(p, torch.Tensor) for p in ordered):
            return [(key, torch.cat(ordered, dim=out_axis(ordered[0])))]
        # GGUF blocks (quantization/gguf_tensor.py): stacked when every part is blocks of one kind, else stored apart
        stacked = next(p for p in ordered if not isinstance(p, torch.Tensor)).stack(ordered)
        if stacked is not None:
            return [(key, stacked)]
        return [(f"{prefix}{part}.{kind}", p) for part, p in zip(PARTS[packed], ordered)]

    def finish(self) -> None:
        if self._pending:
            raise EngineError(f"incomplete packed tensors (a part is missing in the source): {sorted(self._pending)}")


def unpack_and_merge(ranks: list[dict[str, torch.Tensor]], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Inverse of shard + pack: the logical tensors of a model from the packed tensors of all its ranks."""
    tp = len(ranks)
    hd = model.head_dim
    sizes = {
        "attention.q": model.num_heads // tp * hd,
        "attention.k": kv_heads_per_rank(model, tp) * hd,
        "attention.v": kv_heads_per_rank(model, tp) * hd,
        "mlp.gate": model.intermediate_size // tp,
        "mlp.up": model.intermediate_size // tp,
    }
    if model.moe is not None:
        sizes.update({"moe.experts.gate": model.moe.intermediate_size // tp,
                      "moe.experts.up": model.moe.intermediate_size // tp,
                      "moe.shared.gate": model.moe.shared_intermediate_size // tp,
                      "moe.shared.up": model.moe.shared_intermediate_size // tp})
    per_rank: list[dict[str, torch.Tensor]] = []
    for tensors in ranks:
        logical = {}
        for name, t in tensors.items():
            prefix, suffix, kind = split_name(name)
            if suffix in PARTS:
                pieces = t.split([sizes[p] for p in PARTS[suffix]], dim=out_axis(t))
                logical.update({f"{prefix}{p}.{kind}": x for p, x in zip(PARTS[suffix], pieces)})
            else:
                logical[name] = t
        per_rank.append(logical)
    merged = {}
    for name in per_rank[0]:
        kind = split_kind(name)
        shards = [r[name] for r in per_rank]
        if kind == "replicated" or tp == 1:
            merged[name] = shards[0]
        elif kind == "kv_heads" and model.num_kv_heads < tp:
            step = tp // model.num_kv_heads
            merged[name] = torch.cat(shards[::step], dim=0)
        elif kind == "row":
            merged[name] = torch.cat(shards, dim=-1)
        else:
            merged[name] = torch.cat(shards, dim=out_axis(shards[0]))
        if kind == "vocab":
            merged[name] = merged[name][:model.vocab_size]
    return merged
