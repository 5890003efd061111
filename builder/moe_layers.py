"""The mixture-of-experts MLP of a layer (ModelConfig.moe), a part of the builder's graph (builder/model_graph.py):

    normed ─▶ routed experts (plugins/moe.py) ───────────────────────────────────┐
          └─▶ [shared expert: gated MLP ─▶ Mul sigmoid(normed @ shared_gate^T)] ──┴─Add─▶ [AllReduce tp>1]
                                                              (Qwen2-MoE)

The routed experts are one engine MoE node (the kernels' own op) where the build runs every expert projection as
QuantMatMul would: float32 tiles (a float32 build with the engine's kernels on a CPU with their vector code, whole
tiles of 16 columns) or a weight-only build's int8 / int4 blocks (QuantMatMul's conditions: plugins/quant_matmul.runs).
Elsewhere the reference lowering in standard ONNX ops, each expert's MLP composed as a dense one is (float32
gated_mlp, or MatMulNBits / DequantizeLinear projections). At tp > 1 every rank holds a slice of every expert (their
intermediate features, as a dense MLP's) and routes each token itself: the router is replicated, so the ranks agree;
with --moe-ep-size each rank holds its group's experts only (BuildConfig.moe_ep_size, core/sharding.shard_experts)
and adds nothing for a token's other experts, which the other groups add.
Calibrated modes and GGUF blocks are refused for these models (quantization/modes.resolve).
"""
from __future__ import annotations

import numpy as np

from engine.plugins import quant_matmul
from engine.plugins.gated_mlp import gate_times_up, gated_mlp, quant_mlp
from engine.plugins.linear import linear
from engine.plugins.moe import moe_kernel, moe_reference
from engine.quantization.weight_only import quantize


class MoeLayers:
    """A mixin of the graph builder (model_graph._Builder): self.g, self.m, self.b, self.p, self.tp, self.rank,
    self.scheme, self.take, self.mlp are its."""

    def moe(self, x: str, w: str, name: str) -> str:
        """Layer `w`'s mixture of experts over x [T, H] -> [T, H] (this rank's part of it at tp > 1)."""
        g, moe = self.g, self.m.moe
        t = w + "moe."
        router = self.take(t + "router.weight")
        gate_up, down = self.take(t + "experts.gate_up.weight"), self.take(t + "experts.down.weight")
        # this rank's experts: all of them, or with --moe-ep-size its group's (core/sharding.shard_experts)
        first = self.rank % self.b.moe_ep_size * gate_up.shape[0]
        kernel = self._stacked_tiles(gate_up, down, t)
        if kernel is not None:
            (gate_up_tiles, gate_up_attrs), (down_tiles, down_attrs) = kernel
            y = moe_kernel(g, x, router, gate_up_tiles, down_tiles, top_k=moe.top_k, normalize=moe.normalize_top_k,
                           gate_up_attrs=gate_up_attrs, down_attrs=down_attrs, name=f"{name}/experts",
                           weight_name=t[:-1], first_expert=first)
        else:
            def expert(e: int, rows: str) -> str:
                return self._expert_mlp(rows, gate_up[e - first], down[e - first], f"{name}/experts.{e}",
                                        f"{t}experts.{e}")
            y = moe_reference(g, x, router, moe.top_k, moe.normalize_top_k, expert, name=f"{name}/experts",
                              weight_name=t[:-1], computed=range(first, first + gate_up.shape[0]))
        del gate_up, down
        if not moe.shared_intermediate_size:
            return y
        shared = self.mlp(x, w, f"{name}/shared_expert", stem="moe.shared",
                          inter=moe.shared_intermediate_size // self.tp)
        if moe.shared_gate:
            op = g.scope(f"{name}/shared_expert_gate")
            gate = op("MatMul", [x, g.weight(t + "shared_gate.weight", self.take(t + "shared_gate.weight").T)])
            shared = op("Mul", [shared, op("Sigmoid", [gate])])
        return g.node("Add", [y, shared], name=f"{name}/Add")

    def _stacked_tiles(self, gate_up: np.ndarray, down: np.ndarray, t: str):
        """((gate|up tiles [E, ...], attributes), (down tiles, attributes)) for the engine's MoE node, each expert
        packed as QuantMatMul's weights; None where the build does not run these projections as QuantMatMul."""
        p, s = self.p, self.scheme
        (_, n_up, h), (_, n_down, inter) = gate_up.shape, down.shape
        if self.m.activation != "silu":   # the kernel's experts are SwiGLU (every MoE family's)
            return None
        if s is None:
            if not all(quant_matmul.float_runs(n, kernel=p.engine_kernels_plugin) for n in (n_up, n_down)):
                return None
        elif not (quant_matmul.runs(s.group_size, s.accuracy_level, plugin=p.weight_only_quant_matmul_plugin,
                                    kernel=p.engine_kernels_plugin) and h % s.group_size == 0
                  and inter % s.group_size == 0):
            return None
        swiglu = (n_up // 2) % quant_matmul.LANES == 0   # QuantMatMul's SwiGLU epilogue takes whole tiles
        return (self._pack_experts(gate_up, f"{t}experts.gate_up.weight", swiglu=swiglu),
                self._pack_experts(down, f"{t}experts.down.weight", swiglu=False))

    def _pack_experts(self, weights: np.ndarray, name: str, *, swiglu: bool) -> tuple[np.ndarray, dict]:
        """Each expert's weight [N, K] as QuantMatMul's float32 tiles or quantized blocks, stacked on axis 0."""
        _, n, k = weights.shape
        if self.scheme is None:
            tiles = np.stack([quant_matmul.pack_float(e) for e in weights])
            attrs = dict(N=n, bits=quant_matmul.FLOAT_BITS, group_size=k, offsets=0)
        else:
            quantized = [quantize(np.asarray(e, np.float32), self.scheme, name=f"{name}[{i}]")
                         for i, e in enumerate(weights)]
            tiles = np.stack([quant_matmul.pack(q) for q in quantized])
            q = quantized[0]
            attrs = dict(N=n, bits=q.bits, group_size=q.group_size, offsets=int(q.offsets is not None))
        return tiles, {**attrs, **({"swiglu": 1} if swiglu else {})}

    def _expert_mlp(self, rows: str, gate_up: np.ndarray, down: np.ndarray, name: str, weight_name: str) -> str:
        """One expert's gated MLP over its rows, for the reference lowering: as a dense MLP of these weights."""
        g, p, m = self.g, self.p, self.m
        kernel = p.engine_kernels_plugin
        if self.scheme is None:
            return gated_mlp(g, rows, gate_up, down, m.activation, name=name, weight_name=weight_name,
                             plugin=p.gemm_swiglu_plugin, kernel=kernel)
        plugin = p.weight_only_quant_matmul_plugin
        fused = linear(g, rows, gate_up, None, name=f"{name}/gate_up_proj",
                       weight_name=f"{weight_name}.gate_up.weight", scheme=self.scheme, plugin=plugin, kernel=kernel)
        hidden = gate_times_up(g, g.scope(name), fused, gate_up.shape[0] // 2, m.activation, kernel=kernel)
        out = linear(g, hidden, down, None, name=f"{name}/down_proj", weight_name=f"{weight_name}.down.weight",
                     scheme=self.scheme, plugin=plugin, kernel=kernel)
        return quant_mlp(g, out, name=f"{name}/QuantMLP")
