"""Sizing the KV pool from a byte budget or a token count, and refusing a pool too small for max_seq_len."""
import pytest

from engine.core.engine_format import BuildConfig, EngineConfig, MemoryPlan
from engine.core.errors import EngineError
from engine.core.model_config import ModelConfig
from engine.runtime.kv_budget import available_memory, plan_kv_cache

MiB = 1 << 20


def config(max_seq_len=256, max_batch_size=4, tpb=16, per_block=1 * MiB, weights=100 * MiB, act=20 * MiB):
    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, intermediate_size=128, norm_eps=1e-5,
                        max_position_embeddings=max_seq_len)
    return EngineConfig(model=model, build=BuildConfig(max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                                       max_input_len=max_seq_len, tokens_per_block=tpb),
                        memory=MemoryPlan(weight_bytes_per_rank=(weights,), activation_bytes=act,
                                          kv_bytes_per_block=per_block))


def test_fraction_of_available_memory_after_weights_and_activations():
    plan = plan_kv_cache(config(), kv_cache_mem_fraction=0.5, available_bytes=160 * MiB)
    assert plan.num_blocks == 20                      # 0.5 * (160 - 100 - 20) MiB / 1 MiB
    assert plan.num_tokens == 320 and plan.num_bytes == 20 * MiB


def test_capped_at_what_max_batch_size_requests_can_use():
    plan = plan_kv_cache(config(), kv_cache_mem_fraction=1.0, available_bytes=100_000 * MiB)
    assert plan.num_blocks == 4 * 16                   # 4 requests of 256 tokens, 16 blocks each


def test_max_kv_tokens_overrides_the_fraction():
    assert plan_kv_cache(config(), max_kv_tokens=300, available_bytes=1).num_blocks == 19   # ceil(300 / 16)


def test_too_small_names_the_largest_max_seq_len_that_fits():
    with pytest.raises(EngineError, match="largest max_seq_len that fits is 128") as e:
        plan_kv_cache(config(), kv_cache_mem_fraction=0.4, available_bytes=140 * MiB)   # 8 blocks
    assert "max_seq_len 256" in str(e.value)
    with pytest.raises(EngineError, match="largest max_seq_len that fits is 0"):
        plan_kv_cache(config(), available_bytes=50 * MiB)   # less than the weights


@pytest.mark.parametrize("kwargs, named", [(dict(kv_cache_mem_fraction=0.0), "--kv-cache-mem-fraction 0.0"),
                                           (dict(kv_cache_mem_fraction=1.5), "--kv-cache-mem-fraction 1.5"),
                                           (dict(max_kv_tokens=0), "--max-kv-tokens 0")])
def test_bad_values(kwargs, named):
    with pytest.raises(EngineError, match=named) as e:
        plan_kv_cache(config(), available_bytes=1 << 40, **kwargs)
    assert e.value.exit_code == 2


def test_available_memory_is_plausible():
    assert 64 * MiB < available_memory() < 1 << 50


def test_explicit_byte_budget():
    plan = plan_kv_cache(config(), kv_cache_bytes=40 * MiB + 5, available_bytes=1)
    assert plan.num_blocks == 40 and plan.num_bytes == 40 * MiB
    assert plan_kv_cache(config(), max_kv_tokens=300, kv_cache_bytes=40 * MiB).num_blocks == 19  # tokens first
    with pytest.raises(EngineError, match="largest max_seq_len that fits is 128.*--kv-cache-memory-bytes") as e:
        plan_kv_cache(config(), kv_cache_bytes=8 * MiB)
    assert e.value.exit_code == 2
    with pytest.raises(EngineError, match="--kv-cache-memory-bytes 0 must be >= 1"):
        plan_kv_cache(config(), kv_cache_bytes=0)
