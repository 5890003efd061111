"""A small ONNX graph builder with onnxruntime-genai's fixed node naming scheme.

    g = Graph()
    x = g.input("input_ids", TensorProto.INT64, ["T"])
    w = g.weight("vocab_embedding.weight", array)                # initializer named by its canonical tensor name
    h = g.node("Gather", [w, x], name="/model/embed_tokens/Gather")  # -> "/model/embed_tokens/Gather/output_0"
    g.output(h, "hidden", TensorProto.FLOAT, ["T", 576])

Node outputs are named "{node name}/output_{k}", so a value's name says which node made it.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

OPSET = 23          # standard Attention, RMSNormalization, RotaryEmbedding
MS_OPSET = 1        # com.microsoft contrib ops
MS_DOMAIN = "com.microsoft"
ENGINE_DOMAIN = "engine"  # the engine's own kernels (plugins/native.py)
ENGINE_OPSET = 1


class Graph:
    def __init__(self, name: str = "model"):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._names: set[str] = set()
        self._consts: dict[tuple, str] = {}

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, value: str, name: str, elem_type: int, shape: list) -> str:
        """Expose `value` as graph output `name` (through an Identity when the names differ)."""
        if value != name:
            self.nodes.append(helper.make_node("Identity", [value], [name], name=f"/model/output/{name}/Identity"))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def weight(self, name: str, array: np.ndarray) -> str:
        """An initializer holding model weights, named by its canonical tensor name."""
        if name in self._names:
            raise AssertionError(f"duplicate initializer {name}")
        self._names.add(name)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, value, dtype=np.int64) -> str:
        """A small constant (shapes, axes, scalars), shared by every node that uses the same value."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._consts:
            name = f"/model/constants/{array.dtype.name}_{'x'.join(map(str, array.shape)) or 'scalar'}_{len(self._consts)}"
            self.initializers.append(numpy_helper.from_array(array, name))
            self._consts[key] = name
        return self._consts[key]

    def node(self, op_type: str, inputs: list[str], *, name: str, outputs: int = 1, domain: str = "",
             **attrs) -> str | list[str]:
        if name in self._names:
            raise AssertionError(f"duplicate node name {name}")
        self._names.add(name)
        outs = [f"{name}/output_{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, domain=domain or None, **attrs))
        return outs[0] if outputs == 1 else outs

    def rename(self, node: onnx.NodeProto, name: str) -> None:
        """Gives `node` (one of this graph's, folded into another op by a plugin) a new unique name."""
        if name in self._names:
            raise AssertionError(f"duplicate node name {name}")
        self._names.add(name)
        node.name = name

    def producer(self, value: str) -> onnx.NodeProto | None:
        """The node whose output `value` is (None for a graph input or an initializer)."""
        return next((n for n in reversed(self.nodes) if value in n.output), None)

    def scope(self, prefix: str) -> "Scope":
        """A node factory for one op instance; see Scope."""
        return Scope(self, prefix)

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        return model_of(graph)


def model_of(graph: onnx.GraphProto) -> onnx.ModelProto:
    """The engine's model around `graph`: the standard and contrib opsets, and the engine's own domain if used."""
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, MS_OPSET)]
    if any(n.domain == ENGINE_DOMAIN for n in graph.node):
        opsets.append(helper.make_opsetid(ENGINE_DOMAIN, ENGINE_OPSET))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="engine")
    model.ir_version = 10
    return model


def uses_engine_kernels(model: onnx.ModelProto) -> bool:
    return any(o.domain == ENGINE_DOMAIN for o in model.opset_import)


class Scope:
    """Emits the nodes of one op instance under a name prefix: "{prefix}/{OpType}", then "{prefix}/{OpType}_1",
    "_2" ... when the prefix emits several nodes of one type.

        op = g.scope("/model/layers.0/attn/rotary_q")
        y = op("Mul", [a, b])          # node "/model/layers.0/attn/rotary_q/Mul"
    """

    def __init__(self, graph: Graph, prefix: str):
        self.graph = graph
        self.prefix = prefix
        self._counts: dict[str, int] = {}

    def __call__(self, op_type: str, inputs: list[str], *, outputs: int = 1, domain: str = "",
                 unused: tuple[int, ...] = (), **attrs) -> str | list[str]:
        """`unused`: indices of optional outputs left unnamed, so the backend need not produce them."""
        k = self._counts.get(op_type, 0)
        self._counts[op_type] = k + 1
        name = f"{self.prefix}/{op_type}" + (f"_{k}" if k else "")
        outs = self.graph.node(op_type, inputs, name=name, outputs=outputs, domain=domain, **attrs)
        for i in unused:
            self.graph.nodes[-1].output[i] = ""
            outs[i] = ""
        return outs
