"""The memory plan of an engine, computed from the model and build configs alone (so `--dry-run` reads no weights).

    weights per rank      every initializer of the rank's graph at its stored precision: float32 tensors, the
                          rotary tables, and weight-only quantized projections as packed integers plus one
                          float32 scale per group (lm_head at the layers' bits with quantize_lm_head, int8 in
                          blocks of 32 with lm_head_dtype int8; a tied embedding quantized with lm_head is stored once,
                          plus a second copy of its scales that the gather reads), or as the engine's
                          QuantMatMul packs them when the build runs them so (`plugins`); lm_head_dtype
                          bfloat16: lm_head (and a tied embedding) as Bf16MatMul's bfloat16 tiles; at tp > 1 a
                          tied embedding is a whole table of its own at the head's precision
    KV per token          layers x (K + V) x kv_heads_per_rank x head_dim x kv dtype bytes (float32 4, int8 1;
                          the int8 scales are weights: 2 x kv_size float32 per layer, counted with them)
    activations (peak)    one step at max_num_tokens: the widest per-token tensors alive at once, plus the
                          attention scores and the gathered K/V of the largest step shape, plus the logits

The activation figure is an estimate (ORT's allocator reuses buffers); it is meant to size `--max-num-tokens`,
not to be exact.
"""
from __future__ import annotations

import math

from engine.core.model_config import ModelConfig, QuantConfig
from engine.core.engine_format import BuildConfig, MemoryPlan, PluginConfig
from engine.core.parallel import kv_heads_per_rank, padded_vocab_size
from engine.core.tensors import logical_shapes, rank_elements, rank_shape, split_name
from engine.core.sharding import PACKED
from engine.plugins import bf16_matmul, gguf_tiles, quant_matmul
from engine.quantization import calibrated_weights, kv_cache, modes
from engine.quantization.weight_only import BITS, stored_bytes

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def rank_weight_elements(model: ModelConfig, tp: int, max_seq_len: int, ep: int = 1) -> int:
    """The packed tensors of one rank, plus the rotary cos/sin tables (two pairs with a separate local rope)."""
    rope_tables = 2 if model.local_rope is not None and "sliding" in model.layer_types else 1
    return rank_elements(model, tp, ep) + rope_tables * 2 * max_seq_len * (model.head_dim // 2)


# logical projections a weight-only mode quantizes (lm_head only with quantize_lm_head or lm_head_dtype int8); a
# mixture of experts' stacked experts [experts, N, K] one projection an expert (its router stays float32)
QUANTIZED_PROJECTIONS = ("attention.q", "attention.k", "attention.v", "attention.dense", "mlp.gate", "mlp.up",
                         "mlp.down", "moe.experts.gate", "moe.experts.up", "moe.experts.down", "moe.shared.gate",
                         "moe.shared.up", "moe.shared.down")


def runs_quant_matmul(quant: QuantConfig, plugins: PluginConfig | None, group_size: int | None = None) -> bool:
    """Whether the build runs its weight-only quantized projections (in groups of `group_size`, default the
    layers') as QuantMatMul (plugins/linear.py)."""
    group = group_size or quant.group_size
    return plugins is not None and group is not None and quant_matmul.runs(
        group, quant.accuracy_level or 0, plugin=plugins.weight_only_quant_matmul_plugin,
        kernel=plugins.engine_kernels_plugin)


def rank_weight_bytes(model: ModelConfig, tp: int, max_seq_len: int, quant: QuantConfig | None,
                      plugins: PluginConfig | None = None, ep: int = 1) -> int:
    """Bytes of one rank's initializers as stored (see the module docstring); `ep`: --moe-ep-size."""
    return _float_head_bytes(model, tp, max_seq_len, quant, plugins, ep) - _bf16_head_saving(model, tp, quant)


def _bf16_head_saving(model: ModelConfig, tp: int, quant: QuantConfig | None) -> int:
    """With lm_head_dtype bfloat16: the float32 lm_head table's bytes less its Bf16MatMul tiles' (a tied embedding
    at tp 1 is that table; at tp > 1 a tied embedding's own table is saved on too)."""
    if quant is None or quant.lm_head_dtype != "bfloat16":
        return 0
    shapes = logical_shapes(model)
    tied = model.tie_word_embeddings
    names = ["vocab_embedding.weight"] if tied and tp == 1 else \
        ["lm_head.weight"] + (["vocab_embedding.weight"] if tied else [])
    saving = 0
    for name in names:
        n, k = rank_shape(name, shapes.get(name, shapes["vocab_embedding.weight"]), model, tp)
        saving += n * k * DTYPE_BYTES["float32"] - bf16_matmul.stored_bytes(n, k)
    return saving


def _float_head_bytes(model: ModelConfig, tp: int, max_seq_len: int, quant: QuantConfig | None,
                      plugins: PluginConfig | None, ep: int) -> int:
    """rank_weight_bytes with lm_head (unless quantized) in float32."""
    compute = DTYPE_BYTES["float32"]
    if quant is None or quant.mode is None:
        return rank_weight_elements(model, tp, max_seq_len, ep) * compute
    if quant.mode in calibrated_weights.CALIBRATED:
        return _calibrated_bytes(model, tp, max_seq_len, quant, runs_quant_matmul(quant, plugins))
    if quant.mode == modes.GGUF:
        return _gguf_bytes(model, max_seq_len, quant)
    head = modes.head_quantization(quant)   # (bits, group) of a quantized lm_head and a tied embedding, or None
    quantized = set(QUANTIZED_PROJECTIONS) | ({"lm_head"} if head else set())
    shapes = logical_shapes(model)
    tied = model.tie_word_embeddings
    if tied and tp > 1:
        shapes["lm_head.weight"] = shapes["vocab_embedding.weight"]
    total = (rank_weight_elements(model, tp, max_seq_len) - rank_elements(model, tp)) * compute  # rotary tables
    for name, shape in shapes.items():
        rows_cols = rank_shape(name, shape, model, tp, ep)
        _, stem, kind = split_name(name)
        bits, group = head if head and stem in ("lm_head", "vocab_embedding") else (BITS[quant.mode], quant.group_size)
        packed = runs_quant_matmul(quant, plugins, group)
        if tied and head and name == "vocab_embedding.weight":
            # read by QuantGather (and QuantMatMul at tp 1), or GatherBlockQuantized with its own scales
            n, k = rows_cols
            total += quant_matmul.stored_bytes(n, k, bits, group) if packed else \
                stored_bytes(n, k, bits, group) + n * (k // group) * compute
        elif kind == "weight" and stem in quantized and packed:
            total += math.prod(rows_cols[:-2]) * quant_matmul.stored_bytes(*rows_cols[-2:], bits, group)
        elif kind == "weight" and stem in quantized:
            offsets = quant.source_grid and stem != "lm_head"   # layers kept on their grid (weight_only.block_grid)
            total += math.prod(rows_cols[:-2]) * stored_bytes(*rows_cols[-2:], bits, group, offsets)
        else:
            total += math.prod(rows_cols) * compute
    return total


def _gguf_bytes(model: ModelConfig, max_seq_len: int, quant: QuantConfig) -> int:
    """--dtype gguf (tp 1): each tensor kept as GGUF blocks as its tiles (plugins/gguf_tiles.py), stored under its
    own name or, stacked, under its packed one; the rest float32 (a float table of a tied model stored once)."""
    compute = DTYPE_BYTES["float32"]
    total = (rank_weight_elements(model, 1, max_seq_len) - rank_elements(model, 1)) * compute  # rotary tables
    for name, shape in logical_shapes(model).items():
        prefix, stem, kind = split_name(name)
        packed = f"{prefix}{PACKED[stem][0]}.{kind}" if stem in PACKED else name
        gguf_kind = quant.formats.get(name) or quant.formats.get(packed)
        total += gguf_tiles.stored_bytes(gguf_kind, *shape) if gguf_kind else math.prod(shape) * compute
    return total


def _calibrated_bytes(model: ModelConfig, tp: int, max_seq_len: int, quant: QuantConfig, packed: bool) -> int:
    """Calibrated modes: one rank's packed projections at their precision (quantization/calibrated_weights.py;
    int4_awq's as QuantMatMul's when `packed`); a tied embedding with a quantized lm_head reads the lm_head's table (at
    tp > 1 a whole copy of it, beside the rank's vocabulary shard: calibrated_weights.shard_calibrated)."""
    compute = DTYPE_BYTES["float32"]
    total = (rank_weight_elements(model, tp, max_seq_len) - rank_elements(model, tp)) * compute  # rotary tables
    h = model.hidden_size
    rows = lambda name: rank_shape(name, logical_shapes(model)[name], model, tp)[0]   # noqa: E731
    qkv = sum(rows(f"layers.0.attention.{p}.weight") for p in "qkv")
    shapes = [(qkv, h), (h, model.q_size // tp), (2 * model.intermediate_size // tp, h),
              (h, model.intermediate_size // tp)]
    awq_packed = packed and quant.mode == "int4_awq"

    def projection(n: int, k: int) -> int:   # values, scales and the AWQ / SmoothQuant input scale
        if awq_packed:
            return quant_matmul.stored_bytes(n, k, 4, quant.group_size) + 4 * k
        return calibrated_weights.stored_bytes(quant.mode, n, k, quant.group_size)

    for n, k in shapes:  # int4_awq layers that keep the checkpoint's blocks store them as int4_wo does
        if quant.source_grid:
            one = quant_matmul.stored_bytes(n, k, 4, quant.group_size) if awq_packed else \
                stored_bytes(n, k, 4, quant.group_size, True)
        else:
            one = projection(n, k)
        total += model.num_layers * one
    tied = model.tie_word_embeddings
    shared = quant.quantize_lm_head and tied and quant.mode in calibrated_weights.SHARED_TABLE
    shapes = logical_shapes(model)
    if tied and tp > 1:   # lm_head's vocabulary shards
        shapes["lm_head.weight"] = shapes["vocab_embedding.weight"]
    for name, shape in shapes.items():
        _, stem, kind = split_name(name)
        if stem in QUANTIZED_PROJECTIONS and kind == "weight":
            continue
        if quant.quantize_lm_head and (stem == "lm_head" or (stem == "vocab_embedding" and shared)):
            continue
        total += math.prod(rank_shape(name, shape, model, tp)) * compute
    if quant.quantize_lm_head:
        total += projection(padded_vocab_size(model, tp) // tp, h)
        if shared and tp > 1:
            total += projection(model.vocab_size, h)
        if tied and quant.mode == "int4_awq" and not awq_packed:  # GatherBlockQuantized's scales
            total += model.vocab_size * (h // quant.group_size) * compute
    return total


def memory_plan(model: ModelConfig, build: BuildConfig, quant: QuantConfig | None = None,
                plugins: PluginConfig | None = None) -> MemoryPlan:
    tp = build.tp_size
    compute = DTYPE_BYTES["float32"]  # ORT CPU computes in float32 whatever the checkpoint stores
    kv_bytes = kv_cache.BYTES[build.kv_cache_dtype]  # int8: 1 byte, 4x the tokens of float32 in the same memory
    kv_size = kv_heads_per_rank(model, tp) * model.head_dim
    kv_per_token = model.num_layers * 2 * kv_size * kv_bytes
    tokens = build.max_num_tokens
    heads = model.num_heads // tp
    widest = 3 * model.hidden_size + (heads * model.head_dim + 2 * kv_size) + 3 * model.intermediate_size // tp
    q_max = min(tokens, build.max_input_len)
    # The largest attention of one step: a prefill chunk of q_max queries over max_seq_len keys, or every
    # sequence of a full batch decoding at max_seq_len.
    scores = max(heads * q_max * build.max_seq_len,
                 heads * min(build.max_batch_size, tokens) * build.max_seq_len)
    gathered_kv = 2 * min(build.max_batch_size, tokens) * build.max_seq_len * kv_size
    logits = min(build.max_batch_size, tokens) * padded_vocab_size(model, tp) // tp
    activation = compute * (tokens * widest + scores + gathered_kv + logits)
    weights = rank_weight_bytes(model, tp, build.max_seq_len, quant, plugins, build.moe_ep_size)
    if build.kv_cache_dtype in kv_cache.QUANTIZED:
        weights += model.num_layers * 2 * kv_size * compute  # the K and V scales, per axis of a pool row
    return MemoryPlan(weight_bytes_per_rank=(weights,) * tp, activation_bytes=activation,
                      kv_bytes_per_token=kv_per_token, kv_bytes_per_block=kv_per_token * build.tokens_per_block)


def plan_rows(plan: MemoryPlan, build: BuildConfig) -> list[tuple[str, str]]:
    """(item, size) rows for `--dry-run` and `engine inspect`."""
    full_batch = plan.kv_bytes_per_token * build.max_batch_size * build.max_seq_len
    rows = [(f"weights, rank {r}", _size(b)) for r, b in enumerate(plan.weight_bytes_per_rank)]
    rows += [
        ("activations, peak of one step (estimate)", _size(plan.activation_bytes)),
        (f"KV cache per token (all layers, K+V, {build.kv_cache_dtype})", _size(plan.kv_bytes_per_token)),
        (f"KV cache per block ({build.tokens_per_block} tokens)", _size(plan.kv_bytes_per_block)),
        (f"KV cache for {build.max_batch_size} sequences x {build.max_seq_len} tokens", _size(full_batch)),
    ]
    return rows


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError
