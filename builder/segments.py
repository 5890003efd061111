"""Cut one rank's graph of a tp > 1 engine at its all-reduce points into segment graphs (see core/engine_format.py).

The graph builder marks each all-reduce with a com.microsoft AllReduce node (after o_proj and after mlp down of every
layer). ONNX Runtime's CPU build has no kernel for it, and a collective inside the graph would tie the engine to one
communication library, so the graph is cut there and the runtime does the collective between segments:

    nodes in order:  embed, layer 0 attn ... o_proj ─[AllReduce]─ add+norm, mlp ... down ─[AllReduce]─ layer 1 ...
    segments:        |──────────── seg 0 ────────────|           |────── seg 1 ──────|           |── seg 2 ...
                     out: allreduce.0, hidden          in: allreduce.0, hidden
                                                       out: allreduce.1, hidden'

The AllReduce node is dropped and its input and output are both renamed allreduce.{k}: segment k writes the partial
sum, the runtime reduces it in place, segment k + 1 reads it. A value made in one segment and used in a later one
becomes an output of the first and an input of the other under its own name. Weights go to the segment that uses
them; a small initializer used by several segments (rotary tables, shape constants) is copied into each.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from engine.core.engine_format import SUM, allreduce_name, segment_file, segment_reduces
from engine.plugins.graph import MS_DOMAIN, Graph, model_of, uses_engine_kernels

from . import onnxruntime_backend as ortb


@dataclass
class Segment:
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    initializers: list[onnx.TensorProto] = field(default_factory=list)

    def model(self, name: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs)
        # Appended one at a time (protobuf copies on append), so a weight is not held twice for long.
        self.initializers.reverse()
        while self.initializers:
            graph.initializer.append(self.initializers.pop())
        return model_of(graph)


def _is_all_reduce(node: onnx.NodeProto) -> bool:
    return node.op_type == "AllReduce" and node.domain == MS_DOMAIN


def _reduce_op(node: onnx.NodeProto) -> str:
    """A sum, or the max a node marks with reduce_op (model_graph.all_reduce_max)."""
    return next((helper.get_attribute_value(a).decode() for a in node.attribute if a.name == "reduce_op"), SUM)


def split_at_all_reduce(graph: Graph) -> tuple[list[Segment], list[str]]:
    """The segments of `graph` (consumed: its nodes and initializers move into the segments) and the reduction at
    the end of each but the last."""
    segments = [Segment()]
    reduces: list[str] = []
    rename: dict[str, str] = {}
    for node in graph.nodes:
        if _is_all_reduce(node):
            name = allreduce_name(len(segments) - 1)
            rename[node.input[0]] = rename[node.output[0]] = name
            reduces.append(_reduce_op(node))
            segments.append(Segment())
        else:
            assert not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute), \
                f"{node.name}: subgraphs cannot be cut"
            segments[-1].nodes.append(node)
    graph.nodes = []
    for seg in segments:
        for node in seg.nodes:
            for i, x in enumerate(node.input):
                node.input[i] = rename.get(x, x)
            for i, x in enumerate(node.output):
                node.output[i] = rename.get(x, x)

    graph_inputs = {v.name: v for v in graph.inputs}
    graph_outputs = {v.name: v for v in graph.outputs}
    inits = {t.name: t for t in graph.initializers}
    graph.initializers = []
    producer: dict[str, int] = {}
    for k, seg in enumerate(segments):
        for node in seg.nodes:
            for x in node.output:
                if x:
                    producer[x] = k
    users: dict[str, set[int]] = {}
    needed: list[list[str]] = []
    for k, seg in enumerate(segments):
        made = {x for node in seg.nodes for x in node.output if x}
        names = list(dict.fromkeys(x for node in seg.nodes for x in node.input if x and x not in made))
        needed.append(names)
        for x in names:
            users.setdefault(x, set()).add(k)

    for k, seg in enumerate(segments):
        for x in needed[k]:
            if x in inits:
                continue
            if x in graph_inputs:
                seg.inputs.append(graph_inputs[x])
            else:
                assert producer[x] < k, (x, producer[x], k)
                seg.inputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, None))
        made = [x for node in seg.nodes for x in node.output if x]
        for x in made:
            if x in graph_outputs:
                seg.outputs.append(graph_outputs[x])
            elif any(u > k for u in users.get(x, ())):
                seg.outputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, None))
    # Initializers last, each moved into its only user or copied into each of several.
    for name, tensor in inits.items():
        where = sorted(users.get(name, ()))
        for k in where[1:]:
            copy = onnx.TensorProto()
            copy.CopyFrom(tensor)
            segments[k].initializers.append(copy)
        if where:
            segments[where[0]].initializers.append(tensor)
    for k in range(len(segments) - 1):
        # The runtime keeps two all-reduce buffers: a partial sum must be read by the next segment only.
        assert users.get(allreduce_name(k), set()) <= {k + 1}, (allreduce_name(k), users.get(allreduce_name(k)))
    return segments, reduces


def save_segments(graph: Graph, out_dir: Path, rank: int, *, num_layers: int, quant_mode: str | None, opt_level: str,
                  fold_at_load: bool = False) -> None:
    """Cut `graph` (consumed) and write each segment optimized by ORT, like a tp=1 engine: rank{r}.seg{k}.onnx."""
    segments, reduces = split_at_all_reduce(graph)
    # the runtime reads the reductions from the engine's config, not from the graphs
    assert tuple(reduces) == segment_reduces(num_layers, quant_mode), (reduces, num_layers, quant_mode)
    for k in range(len(segments)):
        seg, segments[k] = segments[k], None
        raw = out_dir / f"rank{rank}.seg{k:03d}.raw.onnx"
        proto = seg.model(f"rank{rank}_seg{k}")
        del seg
        kernels = uses_engine_kernels(proto)
        ortb.save_raw(proto, raw)
        del proto
        ortb.optimize(raw, out_dir / segment_file(rank, k), opt_level=opt_level, fold_at_load=fold_at_load,
                      kernels=kernels)
