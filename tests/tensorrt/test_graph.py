"""The TensorRT flavour of every tiny family's graph: only ops TensorRT's ONNX parser lists, and, run by onnxruntime,
the same logits and greedy tokens as transformers, both with the pool updated in place (the onnxruntime session)
and with TensorRT's documented semantics, where kcache_out.{i} is a buffer distinct from kcache.{i} and the
runtime swaps the two after each step (runtime/trt_session.py). This checks the graph, not TensorRT."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from engine.core.engine_format import LOGITS, engine_file, kcache_name, kcache_out_name, vcache_name, vcache_out_name
from engine.core.parallel import kv_heads_per_rank
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import make_step_inputs
from tests.builder.engines import check_parity, engine_greedy, hf_greedy, prompts
from tests.tiny_models import TINY_CONFIGS, is_moe
from tests.tolerances import assert_logits_close

# mixture-of-experts models have no TensorRT flavour yet (the build refuses them: docs/moe.md)
DENSE_KEYS = sorted(k for k in TINY_CONFIGS if not is_moe(k))

# Ops marked supported ("Y") in onnx-tensorrt docs/operators.md for TensorRT 10.0/10.1 (commit 96e78110), the
# oldest parser the `tensorrt>=10` extra admits, restricted to what a decoder graph could use. Restrictions that
# matter to us: ScatterND without `reduction`; ReduceMean/Squeeze axes and Unsqueeze axes as initializers.
TRT10_PARSER_OPS = {
    "Add", "Cast", "Concat", "DequantizeLinear", "Div", "Equal", "Erf", "Exp", "Expand", "Gather", "GatherElements",
    "GatherND", "Gelu", "Gemm", "Identity", "MatMul", "Mul", "Neg", "Pow", "QuantizeLinear", "ReduceMean",
    "ReduceSum", "Reshape", "ScatterND", "Shape", "Sigmoid", "Slice", "Softmax", "Split", "Sqrt", "Squeeze",
    "Sub", "Tanh", "Transpose", "Unsqueeze", "Where",
}
STEPS = 12


@pytest.mark.parametrize("key", DENSE_KEYS)
def test_only_ops_tensorrt_parses(tiny, key):
    model = onnx.load(str(tiny.trt_flavour(key) / engine_file(0)), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    for node in model.graph.node:
        assert node.domain in ("", "ai.onnx"), f"{node.name}: {node.domain}.{node.op_type} is not a standard op"
        assert node.op_type in TRT10_PARSER_OPS, f"{node.name}: {node.op_type} is not in TensorRT 10.0's parser"
        if node.op_type == "ScatterND":
            reduction = {a.name: a.s for a in node.attribute}.get("reduction", b"none")
            assert reduction == b"none", f"{node.name}: ScatterND reduction {reduction!r}"
        if node.op_type in ("ReduceMean", "Squeeze", "Unsqueeze") and len(node.input) > 1:
            assert node.input[1] in initializers, f"{node.name}: axes must be an initializer"


@pytest.mark.parametrize("key", DENSE_KEYS)
def test_parity_in_place(tiny, key):
    session = EngineSession(tiny.trt_flavour(key), num_blocks=64)
    check_parity(session, tiny.hf_model(key), key, steps=STEPS, seed=2, decode_prompt=2)


class PingPongSession:
    """The TrtSession's pool discipline on onnxruntime: the pools go in as inputs, the updated pools come back as
    fresh outputs (no aliasing) and become the next step's inputs."""

    def __init__(self, engine_dir, num_blocks: int):
        self.config = load_engine_config(engine_dir)
        m, b = self.config.model, self.config.build
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self._session = ort.InferenceSession(str(engine_dir / engine_file(0)), so,
                                             providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._sliding = m.sliding_window if "sliding" in m.layer_types else None
        self.tokens_per_block = b.tokens_per_block
        kv = kv_heads_per_rank(m, 1) * m.head_dim
        self.pools = {name: np.zeros((num_blocks * b.tokens_per_block, kv), np.float32)
                      for i in range(m.num_layers) for name in (kcache_name(i), vcache_name(i))}
        self._outputs = [LOGITS] + [n for i in range(m.num_layers) for n in (kcache_out_name(i), vcache_out_name(i))]

    def run(self, chunks):
        feeds = {k: v for k, v in make_step_inputs(chunks, self.tokens_per_block, self._sliding).items()
                 if k in self._inputs}
        before = {k: v.copy() for k, v in self.pools.items()}
        logits, *pools = self._session.run(self._outputs, {**feeds, **self.pools})
        for name, old in before.items():  # the inputs were only read
            assert np.array_equal(self.pools[name], old), name
        self.pools = dict(zip((n.replace("_out", "") for n in self._outputs[1:]), pools))
        return logits[:, :self.config.model.vocab_size]


@pytest.mark.parametrize("key", ["LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen2ForCausalLM:sliding"])
def test_parity_with_separate_output_pools(tiny, key):
    session = PingPongSession(tiny.trt_flavour(key), num_blocks=32)
    model = tiny.hf_model(key)
    ids = prompts(1, (11,), seed=3)[0]
    blocks = list(range(3, 3 + -(-(len(ids) + STEPS) // session.tokens_per_block)))
    tokens, engine_logits = engine_greedy(session, ids, STEPS, blocks)
    ref_tokens, ref_logits = hf_greedy(model, ids, STEPS)
    assert_logits_close(engine_logits, ref_logits, what=f"{key} greedy decode logits, ping-pong pools")
    assert tokens == ref_tokens


@pytest.mark.parametrize("mode", ["int4_wo", "int8_wo"])
def test_weight_only_flavour_is_qdq(tiny, tmp_path, mode):
    """Weight-only engines reach TensorRT as DequantizeLinear (no zero point, as its parser requires) + MatMul,
    never com.microsoft MatMulNBits/GatherBlockQuantized; the tied lm_head quantized too."""
    from engine.builder.build import build_engine
    from engine.builder.tensorrt_backend import tensorrt_plugins
    from engine.core.model_config import QuantConfig
    from engine.quantization.accuracy import AccuracyOptions
    from tests.builder.engines import ALL_PLUGINS
    from tests.tensorrt.conftest import TRT_FLAVOUR_BUILD

    out = tmp_path / "engine"
    build_engine(tiny.checkpoint("LlamaForCausalLM:llama3-rope-tied"), out, TRT_FLAVOUR_BUILD,
                 tensorrt_plugins(ALL_PLUGINS), quant=QuantConfig(mode=mode, quantize_lm_head=True),
                 accuracy=AccuracyOptions(eval_tokens=0))
    model = onnx.load(str(out / engine_file(0)), load_external_data=False)
    ops = [n for n in model.graph.node]
    assert all(n.domain in ("", "ai.onnx") and n.op_type in TRT10_PARSER_OPS for n in ops), \
        sorted({f"{n.domain}.{n.op_type}" for n in ops})
    dq = [n for n in ops if n.op_type == "DequantizeLinear"]
    assert dq and all(len(n.input) == 2 for n in dq), "DequantizeLinear with a zero point"
