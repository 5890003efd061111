"""How many KV blocks the pool gets: from a token count, an explicit byte budget, or a fraction of available memory.

    available = min(MemAvailable (psutil, else /proc/meminfo), the cgroup's limit - its usage (cgroup_memory.py))
                - engine weights - one step's activations
    blocks    = ceil(max_kv_tokens / tpb)                                          or
                floor(kv_cache_bytes / kv_bytes_per_block)                          or
                floor(kv_cache_mem_fraction * available / kv_bytes_per_block)
    blocks    = min(blocks, sequences * blocks of one max_seq_len request)   (more could never be used)
    sequences = max_batch_size, or fewer when the caller knows it runs fewer at once (engine run: its prompts)

and one max_seq_len request must fit, else the error says which max_seq_len would. Weights and activations
come from the engine's memory plan; it knows nothing of the session that allocates the arrays.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.engine_format import EngineConfig
from engine.core.errors import EngineError

from .cgroup_memory import cgroup_room

DEFAULT_KV_CACHE_MEM_FRACTION = 0.5
MiB = 1 << 20


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    tokens_per_block: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.tokens_per_block

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block


def available_memory() -> int:
    """Bytes of memory available to new allocations without swapping, nor passing a container's memory limit."""
    host = _host_available()
    room = cgroup_room()
    return host if room is None else min(host, room)


def _host_available() -> int:
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise EngineError("cannot tell how much memory is available (no psutil, no /proc/meminfo); "
                      "size the KV cache with --max-kv-tokens N")


def kv_bytes_per_block(config: EngineConfig) -> int:
    if config.memory.kv_bytes_per_block:
        return config.memory.kv_bytes_per_block
    # Older memory plans: K and V of every layer, this rank's kv heads, float32.
    m, tp = config.model, config.mapping.tp_size
    kv_heads = max(m.num_kv_heads // tp, 1)
    return 2 * m.num_layers * kv_heads * m.head_dim * 4 * config.build.tokens_per_block


def plan_kv_cache(config: EngineConfig, *, kv_cache_mem_fraction: float = DEFAULT_KV_CACHE_MEM_FRACTION,
                  max_kv_tokens: int | None = None, kv_cache_bytes: int | None = None,
                  available_bytes: int | None = None, max_sequences: int | None = None) -> KVPlan:
    """The pool from, first match: a token count, a byte budget, a fraction of available memory; never more than
    max_sequences (default max_batch_size) max_seq_len requests can use."""
    b = config.build
    tpb = b.tokens_per_block
    per_block = kv_bytes_per_block(config)
    explicit = max_kv_tokens is not None or kv_cache_bytes is not None
    if max_kv_tokens is not None:
        if max_kv_tokens < 1:
            raise EngineError(f"--max-kv-tokens {max_kv_tokens} must be >= 1", usage=True)
        blocks = -(-max_kv_tokens // tpb)
        source = f"--max-kv-tokens {max_kv_tokens}"
    elif kv_cache_bytes is not None:
        if kv_cache_bytes < 1:
            raise EngineError(f"--kv-cache-memory-bytes {kv_cache_bytes} must be >= 1", usage=True)
        blocks = kv_cache_bytes // per_block
        source = f"--kv-cache-memory-bytes {kv_cache_bytes} ({per_block} bytes per block of {tpb} tokens)"
    else:
        if not 0 < kv_cache_mem_fraction <= 1:
            raise EngineError(f"--kv-cache-mem-fraction {kv_cache_mem_fraction} must be in (0, 1]", usage=True)
        avail = available_memory() if available_bytes is None else available_bytes
        weights = max(config.memory.weight_bytes_per_rank, default=0)
        budget = kv_cache_mem_fraction * max(avail - weights - config.memory.activation_bytes, 0)
        blocks = int(budget // per_block)
        source = (f"--kv-cache-mem-fraction {kv_cache_mem_fraction} of {avail / MiB:.0f} MiB available "
                  f"less {weights / MiB:.0f} MiB of weights and {config.memory.activation_bytes / MiB:.0f} MiB "
                  "of activations")
    per_request = -(-b.max_seq_len // tpb)
    blocks = min(blocks, min(b.max_batch_size, max_sequences or b.max_batch_size) * per_request)
    if blocks < per_request:
        fits = blocks * tpb
        raise EngineError(
            f"the KV cache from {source} holds {fits} tokens ({blocks} blocks of {tpb}, "
            f"{blocks * per_block / MiB:.1f} MiB), fewer than one request of max_seq_len {b.max_seq_len} "
            f"needs ({per_request * per_block / MiB:.1f} MiB); the largest max_seq_len that fits is {fits}: raise "
            f"--kv-cache-mem-fraction, --kv-cache-memory-bytes (>= {per_request * per_block}) or --max-kv-tokens "
            f"(>= {b.max_seq_len}), or rebuild with --max-seq-len {fits}",
            usage=explicit)
    return KVPlan(num_blocks=blocks, tokens_per_block=tpb, bytes_per_block=per_block)
