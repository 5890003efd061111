"""Gated MLP: down(act(gate(x)) * up(x)), act = SiLU (Llama) or tanh-approximated GELU (Gemma).

    plugin=True:   x ─MatMul [H, 2I]─▶ Split ─┬─ gate ─act─┐
                                             └─ up ───────Mul─▶ MatMul [I, H] ─▶ y
    plugin=False:  gate = x @ Wg^T, up = x @ Wu^T (two MatMuls), act spelled out in elementwise ops.

The fused lowering reads x once for both projections. SiLU is Sigmoid*Mul, which ORT fuses into its QuickGelu
kernel; GELU is the opset-20 Gelu(approximate="tanh"), which ORT runs as one kernel. With `kernel` (the engine's
ops, --engine-kernels-plugin) a SiLU gate is one SwiGLU node over the fused projection instead of Split, QuickGelu
and Mul (plugins/kernels/swiglu.cc), or none where the projection is the engine's QuantMatMul, whose swiglu=1
epilogue computes it (builder/model_graph.py composes quantized MLPs from gate_times_up too); that QuantMatMul
and the down projection's then become one QuantMLP node (quant_mlp: one ORT dispatch fewer a layer, NOTES 42).

Initializers (weight_name is the MLP's prefix, e.g. "layers.0.mlp"): plugin: "{weight_name}.gate_up.weight"
[H, 2I]; reference: "{weight_name}.gate.weight", "{weight_name}.up.weight"; both "{weight_name}.down.weight".
All hold the torch weights transposed at build time, or, with `kernel` where the CPU runs them, as QuantMatMul's
float32 tiles (plugins/linear.float_matmul): then the SiLU MLP is one QuantMLP node, as a quantized one is.
"""
from __future__ import annotations

import math

import numpy as np
from onnx import helper

from engine.core.errors import EngineError
from engine.core.model_config import ACTIVATIONS
from engine.plugins import quant_matmul
from engine.plugins.linear import float_matmul

from .graph import ENGINE_DOMAIN, Graph, Scope


def gated_mlp(g: Graph, x: str, gate_up: np.ndarray, down: np.ndarray, activation: str, *, name: str,
              weight_name: str, plugin: bool, kernel: bool = False) -> str:
    """x [T, H]; gate_up [2I, H] = [gate rows; up rows]; down [H, I] -> [T, H]."""
    if activation not in ACTIVATIONS:
        raise EngineError(f"activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    if gate_up.ndim != 2 or gate_up.shape[0] % 2 or down.shape != (gate_up.shape[1], gate_up.shape[0] // 2):
        raise EngineError(f"{weight_name}: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not form "
                          "a gated MLP ([2I, H] and [H, I]): re-run `engine convert`")
    inter = gate_up.shape[0] // 2
    gate_up = np.asarray(gate_up, dtype=np.float32)
    op = g.scope(name)

    def project(x: str, w: np.ndarray, what: str) -> str:
        return float_matmul(g, op, x, w, f"{weight_name}.{what}.weight", kernel=kernel)

    if plugin:
        hidden = gate_times_up(g, op, project(x, gate_up, "gate_up"), inter, activation, kernel=kernel)
    else:
        gate, up = project(x, gate_up[:inter], "gate"), project(x, gate_up[inter:], "up")
        hidden = op("Mul", [activate(g, op, gate, activation, plugin), up])
    return quant_mlp(g, project(hidden, np.asarray(down, dtype=np.float32), "down"), name=f"{name}/QuantMLP")


def gate_times_up(g: Graph, op: Scope, fused: str, inter: int, activation: str, *, kernel: bool) -> str:
    """act(gate) * up of a fused gate|up projection [T, 2I] -> [T, I]. SiLU with `kernel`: the engine's SwiGLU op,
    or, where the projection is the engine's QuantMatMul, that op's own SwiGLU epilogue (swiglu=1: its prefill
    tiles write act(gate) * up without storing the [T, 2I] projection)."""
    if kernel and activation == "silu":
        producer = g.producer(fused)
        if producer is not None and producer.op_type == "QuantMatMul" and producer.domain == ENGINE_DOMAIN \
                and inter % 16 == 0:
            producer.attribute.append(helper.make_attribute("swiglu", 1))
            return fused
        return op("SwiGLU", [fused], domain=ENGINE_DOMAIN)
    gate, up = op("Split", [fused, g.const([inter, inter])], outputs=2, axis=-1)
    return op("Mul", [activate(g, op, gate, activation, True), up])


def activate(g: Graph, op: Scope, x: str, activation: str, plugin: bool) -> str:
    if activation == "silu":
        return op("Mul", [x, op("Sigmoid", [x])])
    if plugin:
        return op("Gelu", [x], approximate="tanh")
    # gelu_tanh(x) = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
    f32 = np.float32
    cube = op("Mul", [op("Mul", [x, x]), x])
    inner = op("Mul", [op("Add", [x, op("Mul", [cube, g.const(0.044715, f32)])]),
                       g.const(math.sqrt(2 / math.pi), f32)])
    return op("Mul", [op("Mul", [x, g.const(0.5, f32)]), op("Add", [op("Tanh", [inner]), g.const(1.0, f32)])])


def quant_mlp(g: Graph, y: str, *, name: str) -> str:
    """y, the output of a quantized MLP's down projection, from one QuantMLP node named `name` where the down
    projection and gate|up (with its swiglu=1 epilogue) are both the engine's QuantMatMul and nothing else reads the
    [T, I] between them (the same arithmetic: plugins/kernels/quant_matmul.cc); the nodes as they were elsewhere."""
    down = quant_matmul.foldable(g, y, 0)
    gate_up = quant_matmul.foldable(g, down.input[0], 1, swiglu=True) if down is not None else None
    if gate_up is None:
        return y
    gate_up.op_type = "QuantMLP"
    gate_up.input.append(down.input[1])
    gate_up.attribute.extend(helper.make_attribute(f"down_{a.name}", helper.get_attribute_value(a))
                             for a in down.attribute)
    gate_up.output[:] = list(down.output)
    g.rename(gate_up, name)
    g.nodes.remove(down)
    return y
