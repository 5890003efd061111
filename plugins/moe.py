"""Mixture-of-experts MLP over packed tokens: each token runs only its top_k experts (core/model_config.MoeConfig).

    p = softmax(x @ router^T) [T, E];  weights, experts = top_k(p) [T, k];
    weights /= sum(weights)                                                    (normalize)
    y[t] = sum over t's experts e, in ascending e, of weights[t, e] * expert_e(x[t])       (transformers' order)

Reference lowering, standard ONNX ops; each expert's MLP (`expert(e, rows) -> out`, built by the caller: float32 or
quantized projections) runs on just the rows routed to it:

    x ─MatMul(router^T)─▶ Softmax ─▶ TopK(k) ─▶ weights [T, k], experts [T, k]   [─▶ Div(ReduceSum): normalize]
      routed = ScatterElements(zeros [T, E], experts, 1)   gate = ScatterElements(zeros [T, E], experts, weights)
    for e in 0 .. E-1:
      rows = Transpose(NonZero(routed[:, e])) [n_e, 1]
      y = ScatterND(y, rows, expert(e, GatherND(x, rows)) * GatherND(gate[:, e], rows), reduction=add)
                                                                                    (y starts as zeros [T, H])

Kernel lowering (`kernel`, the engine's ops): one node, plugins/kernels/moe.cc, the routing and the grouping inside:

    x ──engine MoE(router [E, H], gate_up [E, tiles...], down [E, tiles...], top_k, normalize)──▶ y

Expert parallelism (a rank holds experts f .. f + L - 1 of E): both route over all E experts and compute only the
rank's, whose stacks hold L experts; the ranks' outputs add up across the tensor-parallel all-reduce.

its experts' weights stacked QuantMatMul tiles (plugins/quant_matmul.py: float32 tiles, or int8 / int4 blocks).
Initializers: "{weight_name}.router.weight" [H, E] for MatMul, or [E, H] as the kernel reads it; the kernel's
"{weight_name}.experts.gate_up.weight" and "{weight_name}.experts.down.weight".
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
from onnx import TensorProto, helper

from .graph import ENGINE_DOMAIN, Graph


def route(g: Graph, op, x: str, router: np.ndarray, top_k: int, normalize: bool, weight_name: str) -> tuple[str, str]:
    """The reference's routing: (weights float [T, k], experts int64 [T, k])."""
    logits = op("MatMul", [x, g.weight(f"{weight_name}.router.weight", np.asarray(router, np.float32).T)])
    weights, experts = op("TopK", [op("Softmax", [logits], axis=-1), g.const([top_k])], outputs=2, axis=-1,
                          largest=1, sorted=1)
    if normalize:
        weights = op("Div", [weights, op("ReduceSum", [weights, g.const([-1])], keepdims=1)])
    return weights, experts


def moe_reference(g: Graph, x: str, router: np.ndarray, top_k: int, normalize: bool,
                  expert: Callable[[int, str], str], *, name: str, weight_name: str,
                  computed: Iterable[int] | None = None) -> str:
    """x [T, H] -> [T, H] in standard ONNX ops (module docstring); `expert(e, rows [n, H])` -> [n, H]. `computed`:
    the experts this graph computes (default all; expert parallelism: a rank's group), routed over all of them."""
    op = g.scope(name)
    num_experts = router.shape[0]
    weights, experts = route(g, op, x, router, top_k, normalize, weight_name)
    zeros = op("ConstantOfShape", [op("Concat", [op("Shape", [x], end=1), g.const([num_experts])], axis=0)],
               value=_scalar(0.0))
    routed = op("ScatterElements", [zeros, experts, op("ConstantOfShape", [op("Shape", [weights])],
                                                       value=_scalar(1.0))], axis=1)
    gate = op("ScatterElements", [zeros, experts, weights], axis=1)
    y = op("ConstantOfShape", [op("Shape", [x])], value=_scalar(0.0))
    for e in range(num_experts) if computed is None else computed:
        column = g.const(e)
        rows = op("Transpose", [op("NonZero", [op("Gather", [routed, column], axis=1)])], perm=[1, 0])
        out = expert(e, op("GatherND", [x, rows]))
        scale = op("Unsqueeze", [op("GatherND", [op("Gather", [gate, column], axis=1), rows]), g.const([-1])])
        y = op("ScatterND", [y, rows, op("Mul", [out, scale])], reduction="add")
    return y


def moe_kernel(g: Graph, x: str, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray, *, top_k: int,
               normalize: bool, gate_up_attrs: dict, down_attrs: dict, name: str, weight_name: str,
               first_expert: int = 0) -> str:
    """x [T, H] -> [T, H] as one engine MoE node over stacked QuantMatMul weights (`*_attrs`: their N, bits,
    group_size, offsets and gate|up's swiglu, as QuantMatMul's attributes); the stack holds experts first_expert ..
    first_expert + len(stack) - 1 of the router's (all of them, or a rank's group with expert parallelism)."""
    op = g.scope(name)
    inputs = [x, g.weight(f"{weight_name}.router.weight", np.ascontiguousarray(router, np.float32)),
              g.weight(f"{weight_name}.experts.gate_up.weight", gate_up),
              g.weight(f"{weight_name}.experts.down.weight", down)]
    return op("MoE", inputs, domain=ENGINE_DOMAIN, top_k=top_k, normalize=int(normalize), first_expert=first_expert,
              **gate_up_attrs, **{f"down_{k}": v for k, v in down_attrs.items()})


def _scalar(value: float):
    """ConstantOfShape's fill value."""
    return helper.make_tensor("value", TensorProto.FLOAT, [1], [value])
