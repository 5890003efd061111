"""Paged attention over the runtime-owned KV pools, and the in-place write of each step's new K/V.

Pool layout (one pair per layer; slot = block_id * tokens_per_block + offset in block):

    kcache / vcache  [num_slots, kv_heads*hd]     row = one token's K (or V), all KV heads

A step packs T tokens of B sequences (core/engine_format.py has the exact index semantics):

    q [T, heads*hd] ─Gather(q_index [B, Qmax])─▶ Q [B, Qmax, heads*hd] ─┐
    kcache ─Gather(kv_slots [B, Lmax])─▶ K [B, Lmax, kv*hd] ─────────────┼─▶ attention(mask [B, 1, Qmax, Lmax])
    vcache ─Gather(kv_slots [B, Lmax])─▶ V [B, Lmax, kv*hd] ─────────────┘      │ [B, Qmax, heads*hd]
                            [T, heads*hd] ◀─Gather(out_index [T])─ [B*Qmax, heads*hd]

Only the context of the sequences in the step is gathered, never the whole pool. Padded query rows
(j >= q_len[b]) may see no key at all; out_index never selects them, and both lowerings keep every row
independent, so whatever such a row holds cannot reach a real token. Padded context entries read slot 0 under a
False mask: their weight is exactly 0, but 0 * NaN is NaN, so the pools must hold finite values in every slot
(the runtime allocates them with zeros, not np.empty).

Quantized pools (--kv-cache-dtype int8|fp8; scales from quantization/kv_cache.py, float32 [kv_size] per axis):

    new K/V [T, kv*hd] ─QuantizeLinear(scale)─▶ int8 ─ScatterND─▶ kcache int8 ─Gather─▶ [B, Lmax, kv*hd] int8
                                                                              ─Cast─▶ float32 ─▶ attention
    fp8: the pools hold e4m3 codes as uint8 (plugins/e4m3.py: ORT has no float8 ScatterND/Gather): encode before
    the ScatterND, a 256-entry value table after the Gather, the rest as int8
    q [T, heads*hd] ─Mul(k_scale per query head)─▶ ...      attention out [T, heads*hd] ─Mul(v_scale per query head)
The scales are folded out of the context instead of dequantizing it: per channel c, q·(s ⊙ k) = (s ⊙ q)·k and
Σ_j p_j (s ⊙ v_j) = s ⊙ Σ_j p_j v_j, so the context [B, Lmax, kv*hd] is only cast, and the two Muls run over the
step's T rows. DequantizeLinear per axis over the context made SmolLM2's int8-KV decode 1.9x slower than float KV
(bench/NOTES.md entry 15). Both lowerings read the same cast K/V and scaled q, so the reference stays equivalent.
float16 pools (--kv-cache-dtype float16) need no scales: write_kv clips the rows to +-65504 and casts them, the
gathered context is cast back to float32 (the kernel widens each row as it reads it).

Lowerings: `kernel=True` (the default build, --engine-kernels-plugin) is one node of the engine's own op
(domain "engine", plugins/kernels/paged_attention.cc, compiled on first use by plugins/native.py) taking q, the
pools, q_index, kv_slots, mask and out_index as they are: it reads each visible pool row in place, for the T packed
tokens only, with the quantized pools' values widened as it reads them (fp8: from the e4m3 bits), so none of the
gathers above exist (they were half of a decode step's time outside the matmuls: bench/NOTES.md entries 10, 23).
Without q/k norm, `rotary_paged_attention` goes one further: one node takes the projection's q|k|v, rotates q and
k, writes k and v into the pools (quantized as write_kv does) and attends, in place of the ~9 small nodes per layer
of Split, RotaryEmbedding, Unsqueeze/Squeeze, ScatterND (and the quantizers) and the attention op (bench/NOTES.md
entry 24).
Otherwise the context is gathered as drawn above and `plugin=True` runs the standard opset-23 Attention op (GQA by
q_num_heads/kv_num_heads, boolean mask, scale, softcap); `plugin=False` spells it out: explicit GQA head expansion,
MatMul, softcap = c*tanh(s/c), Where(mask, s, -1e30), Softmax, MatMul.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from engine.core.errors import EngineError

from . import e4m3, quant_matmul
from .graph import ENGINE_DOMAIN, Graph, Scope

# Masked scores are replaced (not offset) by this: finite, so an all-masked padded row softmaxes to a uniform
# average instead of NaN, and far below any real score, so exp() of it is exactly 0 beside a visible key.
MASKED_SCORE = -1e30
FLOAT16_MAX = 65504.0
# the engine's kernel (plugins/kernels/paged_attention.cc) for each pool dtype
KERNELS = {"float32": "PagedAttention", "float16": "PagedAttentionFp16", "int8": "PagedAttentionInt8",
           "fp8": "PagedAttentionFp8"}


def write_kv(g: Graph, cache: str, slot_mapping: str, new: str, *, name: str, scale: str | None = None,
             kv_dtype: str = "float32", channels: int = 0, kernel: bool = False) -> str:
    """ScatterND rows new [T, kv_size] into cache [num_slots, kv_size] at slot_mapping [T]; returns the updated
    cache. The runtime binds the result to the buffer of `cache`, so ORT writes in place (DESIGN.md). A quantized
    pool (`scale` float32 [kv_size] = `channels`) first quantizes the rows: int8 round(new / scale) saturated, fp8
    the e4m3 codes of new / scale (plugins/e4m3.py; `kernel`: in the engine's op). A float16 pool stores the rows
    rounded to float16, saturated at +-65504 (never an infinity: the kernel's stores do the same)."""
    op = g.scope(name)
    index = op("Unsqueeze", [slot_mapping, g.const([1])])   # [T, 1]: one index tuple per row
    if kv_dtype == "float16":
        new = op("Cast", [op("Clip", [new, g.const(-FLOAT16_MAX, np.float32), g.const(FLOAT16_MAX, np.float32)])],
                 to=TensorProto.FLOAT16)
    elif kv_dtype == "int8":
        new = op("QuantizeLinear", [new, scale], axis=-1, output_dtype=TensorProto.INT8)
    elif kv_dtype == "fp8":
        new = e4m3.encode(g, op, new, scale, channels, kernel=kernel)
    return op("ScatterND", [cache, index, new])


def paged_attention(g: Graph, q: str, kcache: str, vcache: str, *, q_index: str, kv_slots: str, mask: str,
                    out_index: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                    softcap: float | None, name: str, plugin: bool, kernel: bool = False,
                    k_scale: np.ndarray | None = None, v_scale: np.ndarray | None = None,
                    kv_dtype: str = "float32") -> str:
    """q [T, num_heads*hd] (rotary applied), pools already holding this step's K/V -> [T, num_heads*hd]. With
    k_scale / v_scale (int8 and fp8 pools: float32 [kv*hd]) the gathered context is converted to float32 unscaled
    (int8: cast; fp8: its e4m3 values) and the scales are folded into q and the output (module docstring)."""
    _check_heads(num_heads, num_kv_heads, softcap)
    op = g.scope(name)
    group = num_heads // num_kv_heads
    if k_scale is not None:
        q = op("Mul", [q, g.const(per_query_head(k_scale, num_kv_heads, group), np.float32)])
    if kernel:
        out = op(KERNELS[kv_dtype], [q, kcache, vcache, q_index, kv_slots, mask, out_index], domain=ENGINE_DOMAIN,
                 num_heads=num_heads, num_kv_heads=num_kv_heads, scale=float(scale), softcap=float(softcap or 0))
    else:
        out = _gathered(g, op, q, kcache, vcache, q_index=q_index, kv_slots=kv_slots, mask=mask, out_index=out_index,
                        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=scale,
                        softcap=softcap, plugin=plugin, kv_dtype=kv_dtype)
    if v_scale is not None:
        out = op("Mul", [out, g.const(per_query_head(v_scale, num_kv_heads, group), np.float32)])
    return out


def rotary_paged_attention(g: Graph, qkv: str, positions: str, cos: str, sin: str, kcache: str, vcache: str,
                           slot_mapping: str, *, q_index: str, kv_slots: str, mask: str, out_index: str,
                           num_heads: int, num_kv_heads: int, scale: float, softcap: float | None, name: str,
                           k_scale: str | None = None, v_scale: str | None = None,
                           kv_dtype: str = "float32") -> tuple[str, str, str]:
    """The engine's one-node form (plugins/kernels/paged_attention.cc, RotaryPagedAttention*) of Split q|k|v,
    rotary(q, k) (plugins/rotary.py), write_kv(k), write_kv(v) and paged_attention:
    qkv [T, (num_heads + 2 num_kv_heads) * hd] -> (out [T, num_heads * hd], updated kcache, updated vcache).
    Quantized pools take their scales as initializers `k_scale` / `v_scale` (float32 [kv * hd]); the op stores the
    rows as write_kv does and folds the scales into q and the output as paged_attention does. The caller makes the
    two pools graph outputs bound to the input pools' buffers, as for write_kv."""
    _check_heads(num_heads, num_kv_heads, softcap)
    op = g.scope(name)
    inputs = [qkv, positions, cos, sin, kcache, vcache, slot_mapping, q_index, kv_slots, mask, out_index]
    if kv_dtype in ("int8", "fp8"):
        inputs += [k_scale, v_scale]
    out, kc, vc = op(f"Rotary{KERNELS[kv_dtype]}", inputs, outputs=3, domain=ENGINE_DOMAIN, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, scale=float(scale), softcap=float(softcap or 0))
    _fold_projection(g, g.nodes[-1])
    return out, kc, vc


def _fold_projection(g: Graph, node: onnx.NodeProto) -> None:
    """Where the engine's QuantMatMul made `node`'s qkv and nothing else reads it, `node` becomes
    QuantRotaryPagedAttention*, which takes that projection's input and weights and projects them itself
    (plugins/kernels/paged_attention.cc: the same arithmetic, one ORT dispatch fewer a layer; NOTES 42)."""
    proj = quant_matmul.foldable(g, node.input[0], 1)
    if proj is None:
        return
    node.op_type = f"Quant{node.op_type}"
    node.input[0] = proj.input[0]
    node.input.append(proj.input[1])
    node.attribute.extend(proj.attribute)
    g.nodes.remove(proj)


def _check_heads(num_heads: int, num_kv_heads: int, softcap: float | None) -> None:
    if num_heads % num_kv_heads:
        raise EngineError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if softcap is not None and softcap <= 0:
        raise EngineError(f"attention softcap {softcap} must be positive (or None for no softcap)")


def _gathered(g: Graph, op: Scope, q: str, kcache: str, vcache: str, *, q_index: str, kv_slots: str, mask: str,
              out_index: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, softcap: float | None,
              plugin: bool, kv_dtype: str) -> str:
    """The context of every row gathered out of the pools, then attention over [B, Qmax] x [B, Lmax]."""
    qb = op("Gather", [q, q_index], axis=0)         # [B, Qmax, heads*hd]
    kb = op("Gather", [kcache, kv_slots], axis=0)   # [B, Lmax, kv*hd]
    vb = op("Gather", [vcache, kv_slots], axis=0)
    if kv_dtype in ("int8", "float16"):
        kb = op("Cast", [kb], to=TensorProto.FLOAT)
        vb = op("Cast", [vb], to=TensorProto.FLOAT)
    elif kv_dtype == "fp8":
        kb, vb = e4m3.decode(g, op, kb), e4m3.decode(g, op, vb)
    if plugin:
        attrs = {"softcap": float(softcap)} if softcap else {}
        out = op("Attention", [qb, kb, vb, mask], q_num_heads=num_heads, kv_num_heads=num_kv_heads,
                 scale=float(scale), **attrs)       # [B, Qmax, heads*hd]
    else:
        out = _reference(g, op, qb, kb, vb, mask, num_heads, num_kv_heads, head_dim, scale, softcap)
    flat = op("Reshape", [out, g.const([-1, num_heads * head_dim])])   # [B*Qmax, heads*hd]
    return op("Gather", [flat, out_index], axis=0)


def per_query_head(kv_scale: np.ndarray, num_kv_heads: int, group: int) -> np.ndarray:
    """A [kv*hd] per-channel scale of the KV heads as [heads*hd] over the query heads: query head h reads KV head
    h // group (transformers' repeat_kv)."""
    per_head = np.asarray(kv_scale, np.float32).reshape(num_kv_heads, 1, -1)
    return np.repeat(per_head, group, axis=1).reshape(-1)


def _reference(g: Graph, op: Scope, qb: str, kb: str, vb: str, mask: str, num_heads: int, num_kv_heads: int,
               head_dim: int, scale: float, softcap: float | None) -> str:
    group = num_heads // num_kv_heads
    q = op("Transpose", [op("Reshape", [qb, g.const([0, 0, num_heads, head_dim])])], perm=[0, 2, 1, 3])
    k = _expand_heads(g, op, kb, num_kv_heads, group, head_dim)      # [B, heads, Lmax, hd]
    v = _expand_heads(g, op, vb, num_kv_heads, group, head_dim)
    kt = op("Transpose", [k], perm=[0, 1, 3, 2])                       # [B, heads, hd, Lmax]
    scores = op("Mul", [op("MatMul", [q, kt]), g.const(scale, np.float32)])   # [B, heads, Qmax, Lmax]
    if softcap:
        cap = g.const(softcap, np.float32)
        scores = op("Mul", [op("Tanh", [op("Div", [scores, cap])]), cap])
    scores = op("Where", [mask, scores, g.const(MASKED_SCORE, np.float32)])
    out = op("MatMul", [op("Softmax", [scores], axis=-1), v])          # [B, heads, Qmax, hd]
    out = op("Transpose", [out], perm=[0, 2, 1, 3])                    # [B, Qmax, heads, hd]
    return op("Reshape", [out, g.const([0, 0, num_heads * head_dim])])


def _expand_heads(g: Graph, op: Scope, x: str, num_kv_heads: int, group: int, head_dim: int) -> str:
    """[B, L, kv*hd] -> [B, kv*group, L, hd]: query head h reads KV head h // group (transformers' repeat_kv)."""
    x = op("Transpose", [op("Reshape", [x, g.const([0, 0, num_kv_heads, head_dim])])], perm=[0, 2, 1, 3])
    if group == 1:
        return x
    x = op("Unsqueeze", [x, g.const([2])])                              # [B, kv, 1, L, hd]
    x = op("Expand", [x, g.const([1, 1, group, 1, 1])])                # [B, kv, group, L, hd] (broadcast)
    return op("Reshape", [x, g.const([0, num_kv_heads * group, -1, head_dim])])
