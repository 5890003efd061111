"""Tensor-parallel TensorRT engines, checked as far as a machine without TensorRT and a GPU allows:
- the TensorRT flavour of a tp=2 engine is right: cut at its all-reduces and run by onnxruntime's tensor-parallel
  runtime, it gives the tp=1 flavour's logits and greedy tokens;
- its all-reduce markers (mark_all_reduces) are Identities in a graph of standard ops only, one per row-parallel
  projection, each between the partial sum and its readers;
- insert_all_reduces follows its rule on a stand-in of TensorRT's network API (this checks our rewiring, not
  TensorRT), and refuses TensorRT 10, which has no DistCollective layer;
- the NCCL communicator capsule holds the pointer under the name TensorRT's sample uses.
Building and running real tp=2 TensorRT engines is tests/tensorrt/test_gpu.py (skipped without two GPUs)."""
from __future__ import annotations

import ctypes
import dataclasses
import types

import pytest

from engine.builder.rank_tensors import rank_tensors
from engine.plugins.graph import MS_DOMAIN
from engine.builder.model_graph import build_graph
from engine.builder.tensorrt_backend import tensorrt_plugins
from engine.builder.tensorrt_collectives import AllReduce, check_tensorrt_tp, insert_all_reduces, mark_all_reduces
from engine.core.artifacts import load_checkpoint_config
from engine.core.model_config import QuantConfig
from engine.core.errors import EngineError
from engine.runtime.session import EngineSession
from engine.runtime.tp.session import TPSession
from engine.runtime.tp.trt_shard import communicator_capsule
from tests.builder.engines import ALL_PLUGINS, prompts
from tests.tensorrt.conftest import TRT_FLAVOUR_BUILD
from tests.tensorrt.test_graph import TRT10_PARSER_OPS
from tests.tp.parity import check_same_as_tp1

KEY = "LlamaForCausalLM"


def test_tp2_flavour_matches_tp1(tiny):
    reference = EngineSession(tiny.trt_flavour(KEY), num_blocks=64)
    session = TPSession(tiny.trt_flavour(KEY, tp_size=2), num_blocks=64)
    try:
        check_same_as_tp1(reference, session, prompts(3, (5, 13, 30), seed=4), steps=6, what="TensorRT flavour tp=2")
    finally:
        session.close()


def rank_graph(tiny, rank: int):
    ckpt_dir = tiny.checkpoint(KEY)
    ckpt = load_checkpoint_config(ckpt_dir)
    build = dataclasses.replace(TRT_FLAVOUR_BUILD, tp_size=2)
    graph = build_graph(ckpt.model, rank_tensors(ckpt_dir, ckpt, 2, rank), build, tensorrt_plugins(ALL_PLUGINS), 2,
                        QuantConfig(), rank)
    return ckpt.model, graph.model()


@pytest.mark.parametrize("rank", [0, 1])
def test_all_reduce_markers(tiny, rank):
    model_config, model = rank_graph(tiny, rank)
    marks = mark_all_reduces(model)
    assert len(marks) == 2 * model_config.num_layers  # after o_proj and after mlp down, every layer
    assert all(o.domain != MS_DOMAIN for o in model.opset_import)
    nodes = list(model.graph.node)
    for node in nodes:
        assert node.domain in ("", "ai.onnx") and node.op_type in TRT10_PARSER_OPS, f"{node.domain}.{node.op_type}"
    identities = {(n.input[0], n.output[0]) for n in nodes if n.op_type == "Identity"}
    made_by = {out: n for n in nodes for out in n.output}
    for mark in marks:
        assert (mark.partial, mark.reduced) in identities
        assert made_by[mark.partial].op_type == "MatMul"  # the row-parallel projection's partial sum
        readers = [n for n in nodes if mark.partial in n.input]
        assert [n.op_type for n in readers] == ["Identity"], "only the marker may read a partial sum"


# ---- a stand-in of TensorRT's network API: only what insert_all_reduces touches ----------------------------------

class Tensor:
    def __init__(self, name):
        self.name = name


class Layer:
    def __init__(self, name, inputs, outputs):
        self.name, self.inputs, self.outputs = name, list(inputs), [Tensor(o) for o in outputs]
        self.num_ranks = 1

    num_inputs = property(lambda self: len(self.inputs))
    num_outputs = property(lambda self: len(self.outputs))

    def get_input(self, j):
        return self.inputs[j]

    def set_input(self, j, tensor):
        self.inputs[j] = tensor

    def get_output(self, j):
        return self.outputs[j]


class Network:
    def __init__(self):
        self.layers, self.collectives = [], []

    def add(self, name, inputs, outputs):
        made = {t.name: t for layer in self.layers for t in layer.outputs}
        self.layers.append(Layer(name, [made.get(i) or Tensor(i) for i in inputs], outputs))

    num_layers = property(lambda self: len(self.layers))

    def get_layer(self, i):
        return self.layers[i]

    def add_dist_collective(self, tensor, op, reduce_op, root, groups):
        layer = Layer("collective", [tensor], [f"reduced({tensor.name})"])
        self.collectives.append((layer, op, reduce_op, root, groups))
        self.layers.append(layer)
        return layer


TRT11 = types.SimpleNamespace(__version__="11.4.0", INetworkDefinition=Network,
                              CollectiveOperation=types.SimpleNamespace(ALL_REDUCE="ALL_REDUCE"),
                              ReduceOperation=types.SimpleNamespace(SUM="SUM"))


@pytest.mark.parametrize("identity_kept", [True, False])
def test_insert_all_reduces_rewires_every_reader(identity_kept):
    """o_proj's partial sum feeds the marker; the residual add and a later norm read the marker's output. Whether the
    parser kept the Identity or folded it (readers then read the partial), every reader reads the collective."""
    net = Network()
    net.add("o_proj", ["attn"], ["partial"])
    if identity_kept:
        net.add("marker", ["partial"], ["reduced"])
    readers = "reduced" if identity_kept else "partial"
    net.add("residual", ["hidden", readers], ["hidden2"])
    net.add("norm", [readers], ["normed"])
    insert_all_reduces(TRT11, net, (AllReduce("partial", "reduced"),), 4)
    [(collective, op, reduce_op, root, groups)] = net.collectives
    assert (op, reduce_op, root, groups, collective.num_ranks) == ("ALL_REDUCE", "SUM", -1, None, 4)
    assert collective.get_input(0).name == "partial"
    out = collective.get_output(0)
    by_name = {layer.name: layer for layer in net.layers}
    assert by_name["residual"].get_input(1) is out and by_name["norm"].get_input(0) is out
    assert by_name["residual"].get_input(0).name == "hidden"


def test_insert_all_reduces_names_a_missing_tensor():
    net = Network()
    net.add("o_proj", ["attn"], ["other"])
    with pytest.raises(EngineError, match="no tensor 'partial'"):
        insert_all_reduces(TRT11, net, (AllReduce("partial", "reduced"),), 2)


def test_tensorrt_10_refuses_tp():
    trt10 = types.SimpleNamespace(__version__="10.13.3", INetworkDefinition=type("INetworkDefinition", (), {}))
    check_tensorrt_tp(trt10, 1)
    with pytest.raises(EngineError, match=r"--tp 2 .*TensorRT 11 or later.*TensorRT 10\.13\.3 is installed"):
        check_tensorrt_tp(trt10, 2)
    check_tensorrt_tp(TRT11, 2)


def test_communicator_capsule():
    buffer = ctypes.create_string_buffer(8)
    capsule = communicator_capsule(ctypes.addressof(buffer))
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    assert get_name(capsule) == b"ncclComm_t"
    assert get_pointer(capsule, b"ncclComm_t") == ctypes.addressof(buffer)
    with pytest.raises(EngineError, match="not initialised"):
        communicator_capsule(0)
