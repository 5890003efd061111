"""The memory plan of an engine, computed from the model and build configs alone (so `--dry-run` reads no weights).

    weights per rank      every initializer of the rank's graph at the compute dtype (float32 for now): the
                          packed tensors and the rotary tables
    KV per token          layers x (K + V) x kv_heads_per_rank x head_dim x kv dtype bytes
    activations (peak)    one step at max_num_tokens: the widest per-token tensors alive at once, plus the
                          attention scores and the gathered K/V of the largest step shape, plus the logits

The activation figure is an estimate (ORT's allocator reuses buffers); it is meant to size `--max-num-tokens`,
not to be exact.
"""
from __future__ import annotations

from engine.core.config import ModelConfig
from engine.core.engine_config import BuildConfig, MemoryPlan
from engine.core.parallel import kv_heads_per_rank, padded_vocab_size
from engine.core.tensors import rank_elements

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def rank_weight_elements(model: ModelConfig, tp: int, max_seq_len: int) -> int:
    """The packed tensors of one rank, plus the rotary cos/sin tables (two pairs with a separate local rope)."""
    rope_tables = 2 if model.local_rope is not None and "sliding" in model.layer_types else 1
    return rank_elements(model, tp) + rope_tables * 2 * max_seq_len * (model.head_dim // 2)


def memory_plan(model: ModelConfig, build: BuildConfig) -> MemoryPlan:
    tp = build.tp_size
    compute = DTYPE_BYTES["float32"]  # ORT CPU computes in float32 whatever the checkpoint stores
    kv_bytes = DTYPE_BYTES[build.kv_cache_dtype]
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
    weights = rank_weight_elements(model, tp, build.max_seq_len) * compute
    return MemoryPlan(weight_bytes_per_rank=(weights,) * tp, activation_bytes=activation,
                      kv_bytes_per_token=kv_per_token, kv_bytes_per_block=kv_per_token * build.tokens_per_block)


def plan_rows(plan: MemoryPlan, build: BuildConfig) -> list[tuple[str, str]]:
    """(item, size) rows for `--dry-run` and `engine inspect`."""
    full_batch = plan.kv_bytes_per_token * build.max_batch_size * build.max_seq_len
    rows = [(f"weights, rank {r}", _size(b)) for r, b in enumerate(plan.weight_bytes_per_rank)]
    rows += [
        ("activations, peak of one step (estimate)", _size(plan.activation_bytes)),
        ("KV cache per token (all layers, K+V)", _size(plan.kv_bytes_per_token)),
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
