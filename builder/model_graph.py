"""ModelConfig + one rank's packed tensors -> the engine Graph of that rank (interface: core/engine_format.py).

One decoder layer i (names follow onnxruntime-genai: /model/layers.{i}/attn/qkv_proj/MatMul ...):

    hidden ─┬───────────────────────────────────────────────────────────────┐ (residual stream)
    pending ┴▶ [add_]rms_norm(attn_norm) ─▶ qkv_proj (+bias) ─▶ Split q|k|v  │
               q ─▶ [q_norm] ─▶ rotary ─┐      k ─▶ [k_norm] ─▶ rotary ─▶ write_kv(kcache.i) ─┐
                                       │      v ───────────────────────▶ write_kv(vcache.i) ─┤
                                       └─▶ paged_attention(q_index, kv_slots, attn_mask[_sliding]) ◀┘
               ─▶ o_proj ─▶ [AllReduce tp>1] ─▶ [attn_post_norm]                           │
               ─▶ add_rms_norm(mlp_norm) with hidden ◀─────────────────────────────────────┘
                    │ normed               └▶ hidden (x + attention)
                    ▼
               gated_mlp(gate_up, down) ─▶ [AllReduce tp>1] ─▶ [mlp_post_norm] ─▶ pending (added by the next norm)
               (a mixture-of-experts layer, ModelConfig.moe: its routed and shared experts instead of gated_mlp,
               builder/moe_layers.py)

With the engine's kernels (--engine-kernels-plugin) and no q/k norm, everything from the Split to paged_attention
is one RotaryPagedAttention node (plugins/attention.rotary_paged_attention), whatever the KV dtype. With the
projections run as the engine's QuantMatMul (quantized, or float32 as its float32 tiles: plugins/linear.py), a layer
is three nodes: qkv_proj inside the attention node (QuantRotaryPagedAttention*), o_proj with the add and norm after it
(QuantMatMulAddRMSNorm), the MLP with the next layer's add and norm (QuantMLPAddRMSNorm): plugins/attention.py,
plugins/rms_norm.py, plugins/gated_mlp.py.

Before layer 0 `hidden` is the embedding (times embedding_multiplier) and nothing is pending; after the last
layer the rows named by logits_indices are gathered first, so the final add_rms_norm and the lm_head run only
on the S sampled tokens, then the optional final logit softcap c*tanh(x/c).

Every ModelConfig field is honoured here: qkv_bias, qk_norm, sandwich_norms, norm_weight_offset (folded into the
norm weights: RMSNorm by (offset + w)), embedding_multiplier, attention_scale, attn/final logit softcaps,
sliding_window + layer_types (a second mask), local_rope (second rotary tables), rope, activation,
tie_word_embeddings (lm_head reads vocab_embedding). Tensors are taken (popped) from `tensors` as they are
placed into the graph, so the caller never holds a weight twice.

Weight-only quantization (QuantConfig.mode int8_wo / int4_wo): every projection of the layers (qkv_proj, o_proj,
gate_up / gate + up, down) is quantized at build (RTN, or kept as the checkpoint's own 4-bit blocks when it has
them: quantization/weight_only.py) and lowered by
plugins/linear.py; the gated MLP is then composed here from those projections, since plugins/gated_mlp.py takes
float weights. Embeddings and lm_head stay float32 unless quantize_lm_head (at the layers' bits) or lm_head_dtype int8
(int8 blocks of 32 on llama.cpp's Q8_0 rule) or bfloat16; builder/vocab_tables.py lowers the embedding and lm_head
and the one table a tied model stores for both.

Calibrated modes (int8_sq, fp8, int4_awq): the tensors arrive with ModelOpt's quantized projections laid over the
checkpoint's (quantization/calibrated_weights.py) and are lowered by plugins/calibrated_linear.py (int4_awq layers that
keep the checkpoint's 4-bit blocks, source_grid, are lowered as int4_wo's; only lm_head is calibrated); with
quantize_lm_head a tied embedding reads the quantized lm_head's table (builder/vocab_tables.py).

Quantized KV cache (BuildConfig.kv_cache_dtype int8 / fp8): the pools kcache.{i} / vcache.{i} are int8 (fp8: e4m3
codes in uint8, plugins/e4m3.py), and each layer holds
its K and V scales (layers.{i}.attention.kv_cache.{k,v}_scaling_factor, this rank's KV heads) for write_kv and
paged_attention (plugins/attention.py), whatever the weights' mode.
"""
from __future__ import annotations

import dataclasses
from typing import MutableMapping

import numpy as np
from onnx import TensorProto, helper

from engine.core import engine_format as ec
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.core.errors import EngineError
from engine.core.model_config import ModelConfig, QuantConfig
from engine.core.parallel import kv_heads_per_rank
from engine.plugins.attention import paged_attention, rotary_paged_attention, write_kv
from engine.plugins.calibrated_linear import calibrated_linear
from engine.plugins.gated_mlp import activate, gate_times_up, gated_mlp, quant_mlp
from engine.plugins.gguf_tiles import gguf_linear
from engine.plugins.graph import MS_DOMAIN, Graph
from engine.plugins.linear import linear
from engine.plugins.rms_norm import add_rms_norm, rms_norm
from engine.plugins.rotary import rotary, rotary_tables
from engine.quantization.calibrated_weights import CALIBRATED
from engine.quantization.kv_cache import QUANTIZED as KV_QUANTIZED, layer_scales
from engine.quantization.modes import GGUF, INT8_HEAD_GROUP
from engine.quantization.weight_only import BITS, WeightOnlyScheme

from .lora_layers import LoraLayers
from .moe_layers import MoeLayers
from .vocab_tables import VocabTables

Tensors = MutableMapping[str, np.ndarray]


class _Builder(VocabTables, MoeLayers, LoraLayers):
    def __init__(self, model: ModelConfig, tensors: Tensors, build: BuildConfig, plugins: PluginConfig,
                 tp: int, quant: QuantConfig, rank: int = 0):
        self.m, self.t, self.b, self.p, self.tp, self.q, self.rank = model, tensors, build, plugins, tp, quant, rank
        # the pools' element type: float32, or int8 / fp8 (e4m3 codes in uint8) with the calibrated scales of
        # quant.kv_cache (kv_cache.py)
        self.kv_dtype = build.kv_cache_dtype
        self.kv_quantized = build.kv_cache_dtype in KV_QUANTIZED
        assert not self.kv_quantized or quant.kv_cache, "a quantized KV cache needs its calibrated scales"
        self.kv_type = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int8": TensorProto.INT8,
                        "fp8": TensorProto.UINT8}[self.kv_dtype]
        # calibrated modes: `tensors` is a quantization.calibrated_weights.CalibratedTensors holding the scales;
        # int4_awq layers that keep the checkpoint's 4-bit blocks (source_grid) are not calibrated, only its lm_head is
        self.calibrated = quant.mode in CALIBRATED
        self.scheme = (WeightOnlyScheme(4 if quant.source_grid else BITS[quant.mode], quant.group_size,
                                        quant.accuracy_level, quant.source_grid)
                       if quant.mode in BITS or quant.source_grid else None)
        # lm_head and the embedding are never on the layers' grid (a GGUF keeps them finer): RTN at the layers'
        # bits with quantize_lm_head, or int8 blocks on Q8_0's rule with lm_head_dtype int8
        if quant.lm_head_dtype == "int8":
            self.head_scheme = WeightOnlyScheme(8, INT8_HEAD_GROUP, self.scheme.accuracy_level, q8_0=True)
        else:
            self.head_scheme = dataclasses.replace(self.scheme, keep_grid=False) if self.scheme else None
        self.head_quantized = quant.quantize_lm_head or quant.lm_head_dtype == "int8"
        # --dtype gguf: the weights a GGUF checkpoint keeps as blocks run on their tiles (plugins/gguf_tiles.py)
        self.gguf = quant.mode == GGUF
        self.bf16_head = quant.lm_head_dtype == "bfloat16"   # lm_head (and a tied embedding) as Bf16MatMul's table
        self.g = Graph()
        self.heads = model.num_heads // tp
        self.kv_heads = kv_heads_per_rank(model, tp)

    def take(self, name: str) -> np.ndarray:
        if name not in self.t:
            raise EngineError(f"the checkpoint lacks {name} needed by a {self.m.architecture} model; it is "
                              "incomplete: convert it again with `engine convert`")
        return np.asarray(self.t.pop(name), dtype=np.float32)

    def norm_weight(self, name: str) -> np.ndarray:
        w = self.take(name)
        return w + np.float32(self.m.norm_weight_offset) if self.m.norm_weight_offset else w

    def proj(self, x: str, weight_name: str, name: str, bias: np.ndarray | None = None, *,
             row_parallel: bool = False) -> str:
        """A projection of the layers: float32 MatMul, or quantized with the build's scheme, plus its LoRA node
        where the engine adapts it (lora_layers.py). A row-parallel one (attention.dense, mlp.down) takes a slice
        of each token at tp > 1."""
        return self.with_lora(self.projection(x, weight_name, name, bias, row_parallel=row_parallel), x,
                              weight_name, name)

    def projection(self, x: str, weight_name: str, name: str, bias: np.ndarray | None = None, *,
                   row_parallel: bool = False) -> str:
        if self.is_calibrated(weight_name):
            w = self.t.pop_calibrated(weight_name, self.q.mode, self.q.group_size)
            amax = self.all_reduce_max if row_parallel and self.tp > 1 else None
            return calibrated_linear(self.g, x, w, bias, name=name, weight_name=weight_name,
                                     plugin=self.p.weight_only_quant_matmul_plugin,
                                     accuracy_level=self.q.accuracy_level or 0, kernel=self.p.engine_kernels_plugin,
                                     token_amax=amax)
        parts = self.t.gguf_parts(weight_name) if self.gguf else None
        if parts is not None:
            return gguf_linear(self.g, x, parts, bias, name=name, weight_name=weight_name,
                               float_x=self.q.float_activations)
        return linear(self.g, x, self.take(weight_name), bias, name=name, weight_name=weight_name,
                      scheme=self.scheme, plugin=self.p.weight_only_quant_matmul_plugin,
                      kernel=self.p.engine_kernels_plugin)

    def is_calibrated(self, weight_name: str) -> bool:
        return self.calibrated and self.t.has_calibrated(weight_name)

    def mlp(self, x: str, w: str, name: str, stem: str = "mlp", inter: int | None = None) -> str:
        """Gated MLP of tensors "{w}{stem}.gate_up|down.weight" (a MoE's shared expert: stem "moe.shared", its
        `inter` per rank); with quantized weights composed from quantized projections:

            gemm_swiglu_plugin:  x ─proj gate_up─▶ Split ─▶ act(gate) * up ─▶ proj down
                                 (SiLU with the engine's kernels: one SwiGLU node from Split to Mul, or with
                                 QuantMatMul projections one QuantMLP node for all of it)
            else:                x ─proj gate─▶ act ─┐ x ─proj up─▶ Mul ─▶ proj down
        """
        m, p, g = self.m, self.p, self.g
        t = f"{w}{stem}."   # the tensors' prefix: "layers.0.mlp." or "layers.0.moe.shared."
        inter = inter or m.intermediate_size // self.tp
        calibrated = self.is_calibrated(t + "gate_up.weight")
        adapted = self.lora_group(t + "gate_up.weight") or self.lora_group(t + "down.weight")
        if self.scheme is None and not calibrated and not self.gguf and not adapted:
            return gated_mlp(g, x, self.take(t + "gate_up.weight"), self.take(t + "down.weight"),
                             m.activation, name=name, weight_name=t[:-1], plugin=p.gemm_swiglu_plugin,
                             kernel=p.engine_kernels_plugin)
        op = g.scope(name)
        plugin, kernel = p.weight_only_quant_matmul_plugin, p.engine_kernels_plugin
        if p.gemm_swiglu_plugin or self.gguf or adapted:   # a LoRA node adapts the fused gate|up projection
            fused = self.proj(x, t + "gate_up.weight", f"{name}/gate_up_proj")
            hidden = gate_times_up(g, op, fused, inter, m.activation, kernel=kernel)
            down = self.proj(hidden, t + "down.weight", f"{name}/down_proj", row_parallel=True)
            return quant_mlp(g, down, name=f"{name}/QuantMLP")
        if calibrated:
            fused = self.t.pop_calibrated(t + "gate_up.weight", self.q.mode, self.q.group_size)
            half = fused.shape[0] // 2
            gate, up = (calibrated_linear(g, x, part, None, name=f"{name}/{what}_proj",
                                          weight_name=t + f"{what}.weight", plugin=plugin,
                                          accuracy_level=self.q.accuracy_level or 0, kernel=kernel)
                        for what, part in (("gate", fused.rows(0, half)), ("up", fused.rows(half, 2 * half))))
        else:
            gate_up = self.take(t + "gate_up.weight")
            half = gate_up.shape[0] // 2
            gate = linear(g, x, gate_up[:half], None, name=f"{name}/gate_proj", weight_name=t + "gate.weight",
                          scheme=self.scheme, plugin=plugin, kernel=kernel)
            up = linear(g, x, gate_up[half:], None, name=f"{name}/up_proj", weight_name=t + "up.weight",
                        scheme=self.scheme, plugin=plugin, kernel=kernel)
            del gate_up
        hidden = op("Mul", [activate(g, op, gate, m.activation, p.gemm_swiglu_plugin), up])
        return self.proj(hidden, t + "down.weight", f"{name}/down_proj", row_parallel=True)

    def all_reduce(self, x: str, name: str) -> str:
        """Sum of the row-parallel partial results across ranks (com.microsoft AllReduce, NCCL builds)."""
        if self.tp == 1:
            return x
        return self.g.node("AllReduce", [x], name=f"{name}/AllReduce", domain=MS_DOMAIN, group_size=self.tp)

    def all_reduce_max(self, x: str, name: str) -> str:
        """Max across ranks (int8_sq's per-token amax at a row-parallel projection: core/engine_format.py)."""
        return self.g.node("AllReduce", [x], name=f"{name}/AllReduceMax", domain=MS_DOMAIN, group_size=self.tp,
                           reduce_op="max")

    def cache_output(self, value: str, name: str, kv_size: int) -> str:
        """Make the node that produced `value` (the ScatterND of write_kv, or RotaryPagedAttention) write graph
        output `name` itself.

        Graph.output would add an Identity, and an Identity between the ScatterND and the bound output makes
        ORT copy the whole pool every step (measured: 2.9 ms -> 320 ms per decode step with 200 MB of pool)."""
        node = next(n for n in reversed(self.g.nodes) if value in n.output)
        node.output[list(node.output).index(value)] = name
        self.g.outputs.append(helper.make_tensor_value_info(name, self.kv_type, ["num_slots", kv_size]))
        return name

    # ---- graph ----------------------------------------------------------------------------------------------

    def inputs(self) -> None:
        g, i64 = self.g, TensorProto.INT64
        g.input(ec.INPUT_IDS, i64, ["T"])
        g.input(ec.POSITIONS, i64, ["T"])
        g.input(ec.SLOT_MAPPING, i64, ["T"])
        g.input(ec.Q_INDEX, i64, ["B", "Qmax"])
        g.input(ec.KV_SLOTS, i64, ["B", "Lmax"])
        g.input(ec.ATTN_MASK, TensorProto.BOOL, ["B", 1, "Qmax", "Lmax"])
        if "sliding" in self.m.layer_types:
            g.input(ec.ATTN_MASK_SLIDING, TensorProto.BOOL, ["B", 1, "Qmax", "Lmax"])
        g.input(ec.OUT_INDEX, i64, ["T"])
        g.input(ec.LOGITS_INDICES, i64, ["S"])
        self.lora_inputs()
        kv = self.kv_heads * self.m.head_dim
        for i in range(self.m.num_layers):
            g.input(ec.kcache_name(i), self.kv_type, ["num_slots", kv])
            g.input(ec.vcache_name(i), self.kv_type, ["num_slots", kv])

    def rotary_caches(self) -> dict[str, tuple[str, str]]:
        """Rotary tables by layer type, shared by all layers of that type."""
        m = self.m
        full = rotary_tables(m.head_dim, m.rope, self.b.max_seq_len)
        caches = {"full": (self.g.weight("rotary.cos_cache", full[0]), self.g.weight("rotary.sin_cache", full[1]))}
        if m.local_rope is not None and "sliding" in m.layer_types:
            local = rotary_tables(m.head_dim, m.local_rope, self.b.max_seq_len)
            caches["sliding"] = (self.g.weight("rotary_local.cos_cache", local[0]),
                                 self.g.weight("rotary_local.sin_cache", local[1]))
        else:
            caches["sliding"] = caches["full"]
        return caches

    def attention(self, i: int, qkv: str, rope: dict) -> str:
        """Rotary, the K/V write and paged attention of layer i over its q|k|v projection -> [T, heads * hd]."""
        m, p, g = self.m, self.p, self.g
        w, pre = f"layers.{i}.", f"/model/layers.{i}"
        hd, q_size, kv_size = m.head_dim, self.heads * m.head_dim, self.kv_heads * m.head_dim
        kind = m.layer_type(i)
        cos, sin = rope[kind]
        mask = ec.ATTN_MASK_SLIDING if kind == "sliding" else ec.ATTN_MASK
        scale = m.attention_scale if m.attention_scale is not None else hd ** -0.5
        ks = vs = k_scale = v_scale = None
        if self.kv_quantized:
            ks, vs = layer_scales(self.q.kv_cache, m, i, self.tp, self.rank)
            k_scale = g.weight(w + "attention.kv_cache.k_scaling_factor", ks)
            v_scale = g.weight(w + "attention.kv_cache.v_scaling_factor", vs)
        if p.engine_kernels_plugin and not m.qk_norm:
            attn, kc, vc = rotary_paged_attention(
                g, qkv, ec.POSITIONS, cos, sin, ec.kcache_name(i), ec.vcache_name(i), ec.SLOT_MAPPING,
                q_index=ec.Q_INDEX, kv_slots=ec.KV_SLOTS, mask=mask, out_index=ec.OUT_INDEX, num_heads=self.heads,
                num_kv_heads=self.kv_heads, scale=scale, softcap=m.attn_logit_softcap,
                name=f"{pre}/attn/paged_attention", k_scale=k_scale, v_scale=v_scale, kv_dtype=self.kv_dtype)
            self.cache_output(kc, ec.kcache_out_name(i), kv_size)
            self.cache_output(vc, ec.vcache_out_name(i), kv_size)
            return attn
        if m.qk_norm:
            q, k, v = g.node("Split", [qkv, g.const([q_size, kv_size, kv_size])],
                             name=f"{pre}/attn/qkv_split/Split", outputs=3, axis=-1)
            q = rms_norm(g, q, self.norm_weight(w + "attention.q_norm.weight"), m.norm_eps,
                         name=f"{pre}/attn/q_norm", weight_name=w + "attention.q_norm.weight",
                         plugin=p.rmsnorm_plugin)
            k = rms_norm(g, k, self.norm_weight(w + "attention.k_norm.weight"), m.norm_eps,
                         name=f"{pre}/attn/k_norm", weight_name=w + "attention.k_norm.weight",
                         plugin=p.rmsnorm_plugin)
            q = rotary(g, q, ec.POSITIONS, cos, sin, num_heads=self.heads, head_dim=hd,
                       name=f"{pre}/attn/q_rotary", plugin=p.rotary_plugin)
            k = rotary(g, k, ec.POSITIONS, cos, sin, num_heads=self.kv_heads, head_dim=hd,
                       name=f"{pre}/attn/k_rotary", plugin=p.rotary_plugin)
        else:
            # Rotate q and k as one tensor of heads + kv_heads heads: a position's angles are the same for every
            # head, and one rotary node instead of two saves 2 of the ~26 nodes of a layer (decode at batch 1
            # is bound by per-node overhead: bench/NOTES.md).
            qk, v = g.node("Split", [qkv, g.const([q_size + kv_size, kv_size])],
                           name=f"{pre}/attn/qkv_split/Split", outputs=2, axis=-1)
            qk = rotary(g, qk, ec.POSITIONS, cos, sin, num_heads=self.heads + self.kv_heads, head_dim=hd,
                        name=f"{pre}/attn/qk_rotary", plugin=p.rotary_plugin)
            q, k = g.node("Split", [qk, g.const([q_size, kv_size])], name=f"{pre}/attn/qk_split/Split",
                          outputs=2, axis=-1)
        kc = self.cache_output(write_kv(g, ec.kcache_name(i), ec.SLOT_MAPPING, k, name=f"{pre}/attn/k_cache",
                                        scale=k_scale, kv_dtype=self.kv_dtype, channels=kv_size,
                                        kernel=p.engine_kernels_plugin),
                               ec.kcache_out_name(i), kv_size)
        vc = self.cache_output(write_kv(g, ec.vcache_name(i), ec.SLOT_MAPPING, v, name=f"{pre}/attn/v_cache",
                                        scale=v_scale, kv_dtype=self.kv_dtype, channels=kv_size,
                                        kernel=p.engine_kernels_plugin),
                               ec.vcache_out_name(i), kv_size)
        return paged_attention(
            g, q, kc, vc, q_index=ec.Q_INDEX, kv_slots=ec.KV_SLOTS, mask=mask, out_index=ec.OUT_INDEX,
            num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=hd, scale=scale, softcap=m.attn_logit_softcap,
            name=f"{pre}/attn/paged_attention", plugin=p.gpt_attention_plugin, kernel=p.engine_kernels_plugin,
            k_scale=ks, v_scale=vs, kv_dtype=self.kv_dtype)

    def layer(self, i: int, hidden: str, pending: str | None, rope: dict) -> tuple[str, str]:
        m, p, g = self.m, self.p, self.g
        w, pre = f"layers.{i}.", f"/model/layers.{i}"
        if pending is None:
            normed = rms_norm(g, hidden, self.norm_weight(w + "attn_norm.weight"), m.norm_eps,
                              name=f"{pre}/input_layernorm", weight_name=w + "attn_norm.weight",
                              plugin=p.rmsnorm_plugin, whole_rows=True)
        else:
            normed, hidden = add_rms_norm(g, pending, hidden, self.norm_weight(w + "attn_norm.weight"), m.norm_eps,
                                          name=f"{pre}/input_layernorm", weight_name=w + "attn_norm.weight",
                                          plugin=p.rmsnorm_plugin, kernel=p.engine_kernels_plugin)
        bias = self.take(w + "attention.qkv.bias") if m.qkv_bias else None
        qkv = self.proj(normed, w + "attention.qkv.weight", f"{pre}/attn/qkv_proj", bias)
        attn = self.attention(i, qkv, rope)
        out = self.proj(attn, w + "attention.dense.weight", f"{pre}/attn/o_proj", row_parallel=True)
        out = self.all_reduce(out, f"{pre}/attn/o_proj")
        if m.sandwich_norms:
            out = rms_norm(g, out, self.norm_weight(w + "attn_post_norm.weight"), m.norm_eps,
                           name=f"{pre}/post_attention_layernorm", weight_name=w + "attn_post_norm.weight",
                           plugin=p.rmsnorm_plugin, whole_rows=True)
        normed, hidden = add_rms_norm(g, out, hidden, self.norm_weight(w + "mlp_norm.weight"), m.norm_eps,
                                      name=f"{pre}/pre_feedforward_layernorm", weight_name=w + "mlp_norm.weight",
                                      plugin=p.rmsnorm_plugin, kernel=p.engine_kernels_plugin)
        mlp = self.moe(normed, w, f"{pre}/moe") if m.is_moe_layer(i) else self.mlp(normed, w, f"{pre}/mlp")
        mlp = self.all_reduce(mlp, f"{pre}/mlp/down_proj")
        if m.sandwich_norms:
            mlp = rms_norm(g, mlp, self.norm_weight(w + "mlp_post_norm.weight"), m.norm_eps,
                           name=f"{pre}/post_feedforward_layernorm", weight_name=w + "mlp_post_norm.weight",
                           plugin=p.rmsnorm_plugin, whole_rows=True)
        return hidden, mlp

    def build(self) -> Graph:
        m, g = self.m, self.g
        self.inputs()
        hidden, head = self.embed()
        if m.embedding_multiplier != 1.0:
            # Gemma multiplies by sqrt(hidden_size) rounded to the compute dtype, as transformers does.
            hidden = g.node("Mul", [hidden, g.const(m.embedding_multiplier, np.float32)],
                            name="/model/embed_tokens/Mul")
        rope = self.rotary_caches()
        pending = None
        for i in range(m.num_layers):
            hidden, pending = self.layer(i, hidden, pending, rope)
        # Only the sampled rows go through the final norm and the lm_head.
        rows = g.node("Gather", [hidden, ec.LOGITS_INDICES], name="/model/logits_rows/Gather", axis=0)
        last = g.node("Gather", [pending, ec.LOGITS_INDICES], name="/model/logits_rows/Gather_1", axis=0)
        normed, _ = add_rms_norm(g, last, rows, self.norm_weight("final_norm.weight"), m.norm_eps,
                                 name="/model/norm", weight_name="final_norm.weight", plugin=self.p.rmsnorm_plugin)
        logits = self.lm_head(normed, head)
        if m.final_logit_softcap:
            cap = g.const(m.final_logit_softcap, np.float32)
            logits = g.node("Mul", [g.node("Tanh", [g.node("Div", [logits, cap], name="/lm_head/softcap/Div")],
                                           name="/lm_head/softcap/Tanh"), cap], name="/lm_head/softcap/Mul")
        g.output(logits, ec.LOGITS, TensorProto.FLOAT, ["S", "vocab"])
        if self.t:
            raise EngineError(f"the checkpoint has tensors a {m.architecture} model does not use: "
                              f"{sorted(self.t)[:5]}; it was written for another model config")
        return g


def build_graph(model: ModelConfig, tensors: Tensors, build: BuildConfig, plugins: PluginConfig,
                tp: int, quant: QuantConfig | None = None, rank: int = 0) -> Graph:
    """The graph of rank `rank`; consumes `tensors` (packed canonical names -> arrays of that rank). `quant` must be
    resolved (quantization.modes.resolve) when it has a mode, and hold the KV scales (quant.kv_cache) of an int8 KV
    cache; the rank picks its KV heads' scales."""
    return _Builder(model, tensors, build, plugins, tp, quant or QuantConfig(), rank).build()
