"""The canonical model as a torch module, for calibration: ModelOpt quantizes torch `nn.Linear`s, and the build only
has the canonical checkpoint. Built from a ModelConfig and the packed tensors of one tp=1 rank, so it runs every
registered family without knowing a Hugging Face name, and its module names are the canonical tensor stems:

    layers.{i}.attention.qkv    nn.Linear [q+k+v, hidden] (+ bias: Qwen2)   one Linear per packed projection, so
    layers.{i}.attention.dense  nn.Linear [hidden, q]                        one calibrated scale set maps onto
    layers.{i}.mlp.gate_up      nn.Linear [2*inter, hidden]                  one graph projection (a fused qkv has
    layers.{i}.mlp.down         nn.Linear [hidden, inter]                    one SmoothQuant / AWQ input scale)
    lm_head                     nn.Linear [vocab, hidden]  (the embedding, when tied)

A mixture-of-experts layer (ModelConfig.moe) holds `moe` instead of `mlp`: its router, the stacked experts as
parameters [experts, N, K] (calibrated modes refuse these models: quantization/modes.py) and a shared expert.

The forward is the builder's graph (builder/model_graph.py) in torch over whole sequences of one batch (no paging):
RMSNorm with the family's weight offset, rotary from plugins/rotary.py's tables, causal attention with GQA, sliding
window and logit softcap, the gated MLP, sandwich norms. KVCache (one preallocated buffer per layer, written in
place) lets a forward continue a batch of equal-length sequences; quantization/kv_cache.py reads K/V through it.
The calibration text is sampled by the float reference engine (builder/reference.py), not here.
Tests check it against transformers. Knows nothing of ONNX or ModelOpt.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch import nn

from engine.core.model_config import ModelConfig
from engine.plugins.rotary import rotary_tables


class RMSNorm(nn.Module):
    def __init__(self, weight: np.ndarray, eps: float, offset: float):
        super().__init__()
        self.weight = nn.Parameter(torch.from_numpy(np.asarray(weight, np.float32) + np.float32(offset)),
                                   requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _linear(weight: np.ndarray, bias: np.ndarray | None = None) -> nn.Linear:
    out_f, in_f = weight.shape
    layer = nn.Linear(in_f, out_f, bias=bias is not None)
    layer.weight.data = torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32))
    layer.weight.requires_grad_(False)
    if bias is not None:
        layer.bias.data = torch.from_numpy(np.asarray(bias, dtype=np.float32))
        layer.bias.requires_grad_(False)
    return layer


class _Attention(nn.Module):
    def __init__(self, take, p: str, m: ModelConfig):
        super().__init__()
        self.qkv = _linear(take(p + "attention.qkv.weight"), take(p + "attention.qkv.bias") if m.qkv_bias else None)
        self.dense = _linear(take(p + "attention.dense.weight"))


class _MLP(nn.Module):
    def __init__(self, take, p: str, stem: str = "mlp"):
        super().__init__()
        self.gate_up = _linear(take(f"{p}{stem}.gate_up.weight"))
        self.down = _linear(take(f"{p}{stem}.down.weight"))

    def forward(self, x: torch.Tensor, act) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(act(gate) * up)


class _MoE(nn.Module):
    """The tokens of each expert through it, weighted and summed in ascending expert order (plugins/moe.py)."""

    def __init__(self, take, p: str, m: ModelConfig):
        super().__init__()
        self.cfg = m.moe
        self.router = _linear(take(p + "moe.router.weight"))
        stacked = lambda name: nn.Parameter(torch.from_numpy(take(p + name)), requires_grad=False)  # noqa: E731
        self.gate_up, self.down = stacked("moe.experts.gate_up.weight"), stacked("moe.experts.down.weight")
        if self.cfg.shared_intermediate_size:
            self.shared = _MLP(take, p, "moe.shared")
        if self.cfg.shared_gate:
            self.shared_gate = _linear(take(p + "moe.shared_gate.weight"))

    def forward(self, x: torch.Tensor, act) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.router(flat).softmax(-1).topk(self.cfg.top_k, dim=-1)
        if self.cfg.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        y = torch.zeros_like(flat)
        for e in range(self.cfg.num_experts):
            tokens, slot = torch.where(experts == e)
            gate, up = (flat[tokens] @ self.gate_up[e].T).chunk(2, dim=-1)
            y.index_add_(0, tokens, (act(gate) * up) @ self.down[e].T * weights[tokens, slot, None])
        if self.cfg.shared_intermediate_size:
            shared = self.shared(flat, act)
            y = y + (torch.sigmoid(self.shared_gate(flat)) * shared if self.cfg.shared_gate else shared)
        return y.reshape(x.shape)


class _Layer(nn.Module):
    def __init__(self, take, i: int, m: ModelConfig):
        super().__init__()
        p = f"layers.{i}."
        norm = lambda name: RMSNorm(take(p + name), m.norm_eps, m.norm_weight_offset)  # noqa: E731
        self.attn_norm, self.mlp_norm = norm("attn_norm.weight"), norm("mlp_norm.weight")
        self.attention = _Attention(take, p, m)
        if m.is_moe_layer(i):
            self.moe = _MoE(take, p, m)
        else:
            self.mlp = _MLP(take, p)
        if m.qk_norm:
            self.q_norm, self.k_norm = norm("attention.q_norm.weight"), norm("attention.k_norm.weight")
        if m.sandwich_norms:
            self.attn_post_norm, self.mlp_post_norm = norm("attn_post_norm.weight"), norm("mlp_post_norm.weight")


class CanonicalLM(nn.Module):
    """Causal LM over packed canonical tensors (consumed from `tensors`); forward(ids [B, L]) -> logits [B, L, V]."""

    def __init__(self, model: ModelConfig, tensors: Mapping[str, np.ndarray], max_positions: int):
        super().__init__()
        self.m = m = model

        def take(name: str) -> np.ndarray:
            return np.asarray(tensors[name], dtype=np.float32)

        self.embedding = nn.Embedding.from_pretrained(torch.from_numpy(take("vocab_embedding.weight")))
        self.layers = nn.ModuleList(_Layer(take, i, m) for i in range(m.num_layers))
        self.final_norm = RMSNorm(take("final_norm.weight"), m.norm_eps, m.norm_weight_offset)
        head = take("lm_head.weight") if "lm_head.weight" in tensors else take("vocab_embedding.weight")
        self.lm_head = _linear(head[:m.vocab_size])
        tables = {"full": rotary_tables(m.head_dim, m.rope, max_positions)}
        local = m.local_rope if m.local_rope is not None else m.rope
        tables["sliding"] = rotary_tables(m.head_dim, local, max_positions)
        self.rope = {k: (torch.from_numpy(c), torch.from_numpy(s)) for k, (c, s) in tables.items()}

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, kind: str) -> torch.Tensor:
        cos, sin = (t[positions][:, None, :] for t in self.rope[kind])      # [L, 1, hd/2]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def _attend(self, i: int, layer: _Layer, x: torch.Tensor, positions: torch.Tensor, cache: "KVCache | None"):
        m = self.m
        b, length, _ = x.shape
        hd, kinds = m.head_dim, m.layer_type(i)
        q, k, v = layer.attention.qkv(x).split([m.q_size, m.kv_size, m.kv_size], dim=-1)
        q = q.view(b, length, m.num_heads, hd)
        k = k.view(b, length, m.num_kv_heads, hd)
        v = v.view(b, length, m.num_kv_heads, hd)
        if m.qk_norm:
            q, k = layer.q_norm(q), layer.k_norm(k)
        q, k = self._rotate(q, positions, kinds), self._rotate(k, positions, kinds)
        if cache is not None:
            k, v = cache.append(i, int(positions[0]), k, v)
        # grouped-query attention without repeating K/V: query heads [kv_heads, rep], head h = g * rep + r
        q = q.view(b, length, m.num_kv_heads, m.num_heads // m.num_kv_heads, hd)
        scale = m.attention_scale if m.attention_scale is not None else hd ** -0.5
        scores = torch.einsum("bqgrd,bkgd->bgrqk", q, k) * scale
        if m.attn_logit_softcap:
            scores = torch.tanh(scores / m.attn_logit_softcap) * m.attn_logit_softcap
        key_pos = torch.arange(k.shape[1])
        visible = key_pos[None, :] <= positions[:, None]
        if kinds == "sliding":
            visible &= key_pos[None, :] > positions[:, None] - m.sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("bgrqk,bkgd->bqgrd", scores.softmax(-1), v).reshape(b, length, m.q_size)
        return layer.attention.dense(out)

    def forward(self, ids: torch.Tensor, start: int = 0, cache: "KVCache | None" = None) -> torch.Tensor:
        """Logits of `ids` [B, L] at positions start..start+L-1; `cache` keeps K/V between calls (and holds them
        after: quantization/kv_cache.py reads its ranges)."""
        m = self.m
        positions = torch.arange(start, start + ids.shape[1])
        hidden = self.embedding(ids)
        if m.embedding_multiplier != 1.0:
            hidden = hidden * torch.tensor(m.embedding_multiplier, dtype=torch.float32)
        for i, layer in enumerate(self.layers):
            out = self._attend(i, layer, layer.attn_norm(hidden), positions, cache)
            if m.sandwich_norms:
                out = layer.attn_post_norm(out)
            hidden = hidden + out
            act = nn.functional.silu if m.activation == "silu" else \
                (lambda v: nn.functional.gelu(v, approximate="tanh"))
            out = (layer.moe if m.is_moe_layer(i) else layer.mlp)(layer.mlp_norm(hidden), act)
            if m.sandwich_norms:
                out = layer.mlp_post_norm(out)
            hidden = hidden + out
        logits = self.lm_head(self.final_norm(hidden))
        if m.final_logit_softcap:
            logits = torch.tanh(logits / m.final_logit_softcap) * m.final_logit_softcap
        return logits


class KVCache:
    """K/V of positions 0..capacity-1 of a batch, per layer, in buffers [B, capacity, kv_heads, head_dim] that each
    call writes in place."""

    def __init__(self, model: ModelConfig, batch: int, capacity: int):
        shape = (batch, capacity, model.num_kv_heads, model.head_dim)
        self.k = [torch.empty(shape) for _ in range(model.num_layers)]
        self.v = [torch.empty(shape) for _ in range(model.num_layers)]

    def append(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, L, kv_heads, head_dim] at positions start..start+L-1; the K/V of positions 0..start+L-1."""
        end = start + k.shape[1]
        self.k[layer][:, start:end], self.v[layer][:, start:end] = k, v
        return self.k[layer][:, :end], self.v[layer][:, :end]

