"""Tensor-parallel arithmetic on a ModelConfig: which tp sizes split a model, heads and vocabulary per rank.

Plain integers only (no torch), so the runtime can use it; core/sharding.py slices the tensors.
"""
from __future__ import annotations

from .errors import EngineError
from .model_config import ModelConfig


def valid_tp_sizes(model: ModelConfig) -> list[int]:
    return [tp for tp in range(1, model.num_heads + 1) if _tp_problem(model, tp) is None]


def _tp_problem(model: ModelConfig, tp: int) -> str | None:
    if model.num_heads % tp:
        return f"num_heads {model.num_heads} is not divisible by {tp}"
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        return f"num_kv_heads {model.num_kv_heads} neither divides nor is divisible by {tp}"
    if model.intermediate_size % tp:
        return f"intermediate_size {model.intermediate_size} is not divisible by {tp}"
    moe = model.moe
    if moe is not None and (moe.intermediate_size % tp or moe.shared_intermediate_size % tp):
        return (f"the experts' intermediate_size {moe.intermediate_size} or the shared expert's "
                f"{moe.shared_intermediate_size} is not divisible by {tp}")
    return None


def check_tp(model: ModelConfig, tp: int) -> None:
    if tp < 1:
        raise EngineError(f"--tp {tp} must be at least 1", usage=True)
    problem = _tp_problem(model, tp)
    if problem:
        raise EngineError(f"--tp {tp} cannot split {model.architecture}: {problem}; tensor-parallel sizes that "
                          f"work for this model: {', '.join(map(str, valid_tp_sizes(model)))}", usage=True)


def check_expert_parallel(model: ModelConfig, tp: int, ep: int) -> None:
    """--moe-ep-size `ep` of a build at `tp`: experts split into ep groups of ranks, each expert tp / ep ways."""
    if ep < 1 or tp % ep:
        raise EngineError(f"--moe-ep-size {ep} must divide --tp {tp} (--moe-tp-size x --moe-ep-size = --tp)",
                          usage=True)
    if ep == 1:
        return
    moe = model.moe
    if moe is None:
        raise EngineError(f"--moe-ep-size {ep} splits the experts of a mixture-of-experts model; {model.architecture} "
                          "has none: leave it out", usage=True)
    if moe.num_experts % ep:
        raise EngineError(f"--moe-ep-size {ep} does not divide the {moe.num_experts} experts of this "
                          f"{model.architecture}", usage=True)
    if moe.intermediate_size % (tp // ep):
        raise EngineError(f"--moe-tp-size {tp // ep} does not divide the experts' intermediate_size "
                          f"{moe.intermediate_size}", usage=True)


def kv_heads_per_rank(model: ModelConfig, tp: int) -> int:
    return max(model.num_kv_heads // tp, 1)


def padded_vocab_size(model: ModelConfig, tp: int) -> int:
    return -(-model.vocab_size // tp) * tp
