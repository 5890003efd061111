"""The all-reduces of a tp > 1 TensorRT engine, as DistCollective layers inside each rank's engine (TensorRT 11+,
"Multi-Device Inference"; builder/tensorrt_backend.py's module docstring says why and how).

    mark_all_reduces(model)                         com.microsoft AllReduce nodes -> Identity markers + name pairs
    insert_all_reduces(trt, network, marks, tp)     after parsing: a DistCollective ALL_REDUCE per marker

The names used (INetworkDefinition.add_dist_collective(input, dist_collective_op, reduce_op, root, groups),
CollectiveOperation.ALL_REDUCE, ReduceOperation.SUM, ILayer.num_ranks / get_input / set_input, and
IExecutionContext.set_communicator in runtime/trt_session.py) were checked against TensorRT's Python bindings source
(python/src/infer/pyGraph.cpp, pyCore.cpp of the TensorRT 11 repository) and the strings of the 11.4.0.106 bindings.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx

from engine.core.errors import EngineError
from engine.plugins.graph import MS_DOMAIN


@dataclass(frozen=True)
class AllReduce:
    """One all-reduce of a rank graph: the tensor holding this rank's partial sum and the name its readers use."""
    partial: str
    reduced: str


def check_tensorrt_tp(trt, tp: int) -> None:
    """tp > 1 needs TensorRT 11's DistCollective layer (`trt`: the tensorrt module)."""
    if tp > 1 and not hasattr(trt.INetworkDefinition, "add_dist_collective"):
        raise EngineError(f"--tp {tp} with --backend tensorrt needs TensorRT 11 or later (its DistCollective layer "
                          f"runs the all-reduce) and TensorRT {trt.__version__} is installed: upgrade TensorRT, or "
                          "build with --tp 1 or --backend onnxruntime", usage=True)


def mark_all_reduces(model: onnx.ModelProto) -> tuple[AllReduce, ...]:
    """Turn every com.microsoft AllReduce node of `model` (in place) into an Identity, which TensorRT's parser
    knows, and return the name pairs for `insert_all_reduces`; the contrib opset goes when nothing else uses it."""
    marks = []
    for node in model.graph.node:
        if node.op_type == "AllReduce" and node.domain == MS_DOMAIN:
            marks.append(AllReduce(node.input[0], node.output[0]))
            node.op_type, node.domain = "Identity", ""
            del node.attribute[:]
    if not any(node.domain == MS_DOMAIN for node in model.graph.node):
        kept = [o for o in model.opset_import if o.domain != MS_DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return tuple(marks)


def insert_all_reduces(trt, network, all_reduces: tuple[AllReduce, ...], num_ranks: int) -> None:
    """Sum each marked partial over the ranks inside the engine: a DistCollective ALL_REDUCE layer on the partial,
    and every layer that read the marker's output (or the partial itself, should the parser have folded the
    Identity away) reads the collective's output instead. TensorRT 11+ only: build_engine runs check_tensorrt_tp
    before anything is built."""
    if not all_reduces:
        return
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    made = {layer.get_output(j).name: layer.get_output(j) for layer in layers for j in range(layer.num_outputs)}
    for mark in all_reduces:
        if mark.partial not in made:
            raise EngineError(f"TensorRT's parsed network has no tensor {mark.partial!r} to all-reduce; this graph "
                              "flavour has not been verified on a GPU yet: please report it, and use --backend "
                              "onnxruntime meanwhile")
        collective = network.add_dist_collective(made[mark.partial], trt.CollectiveOperation.ALL_REDUCE,
                                                 trt.ReduceOperation.SUM, -1, None)
        collective.num_ranks = num_ranks
        collective.name = f"all_reduce({mark.partial})"
        for layer in layers:
            for j in range(layer.num_inputs):
                tensor = layer.get_input(j)
                if tensor is not None and tensor.name in (mark.partial, mark.reduced):
                    layer.set_input(j, collective.get_output(0))
