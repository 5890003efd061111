"""plugins.rotary: tables against transformers, both lowerings against NumPy and each other."""
import numpy as np
import pytest
import torch

from engine.core.errors import EngineError
from engine.core.model_config import RopeConfig
from engine.plugins.rotary import inv_frequencies, rotary, rotary_tables

from .runner import assert_close, node_names, run_op

ROPES = {
    "default": RopeConfig(theta=10000.0),
    "default-100k": RopeConfig(theta=100000.0),
    "linear": RopeConfig(theta=10000.0, type="linear", factor=4.0),
    "llama3": RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_positions=64),
    "llama3-8k": RopeConfig(theta=500000.0, type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_positions=8192),
}


def hf_config(head_dim: int, rope: RopeConfig, max_positions: int):
    from transformers import LlamaConfig
    params = {"rope_type": rope.type, "rope_theta": rope.theta}
    if rope.type != "default":
        params["factor"] = rope.factor
    if rope.type == "llama3":
        params.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                      original_max_position_embeddings=rope.original_max_positions)
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_parameters=params,
                       max_position_embeddings=max(max_positions, 2 * (rope.original_max_positions or 0)))


@pytest.mark.parametrize("rope_name", list(ROPES))
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_tables_match_transformers(rope_name, head_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    rope, positions = ROPES[rope_name], 4096
    config = hf_config(head_dim, rope, positions)
    if rope.type != "default":   # transformers keeps the default init on the model class since v5
        hf_inv, scaling = ROPE_INIT_FUNCTIONS[rope.type](config, "cpu")
        assert scaling == 1.0
        np.testing.assert_array_equal(inv_frequencies(head_dim, rope), hf_inv.numpy())
    emb = LlamaRotaryEmbedding(config)
    np.testing.assert_array_equal(inv_frequencies(head_dim, rope), emb.inv_freq.numpy())
    hf_cos, hf_sin = emb(torch.zeros(1), torch.arange(positions)[None])
    cos, sin = rotary_tables(head_dim, rope, positions)
    assert cos.shape == sin.shape == (positions, head_dim // 2) and cos.dtype == np.float32
    # transformers duplicates the half table ([freqs, freqs]); same angles, cos/sin within float32 rounding.
    for ours, theirs in ((cos, hf_cos[0].numpy()), (sin, hf_sin[0].numpy())):
        np.testing.assert_allclose(ours, theirs[:, : head_dim // 2], rtol=0, atol=5e-7)
        np.testing.assert_array_equal(theirs[:, : head_dim // 2], theirs[:, head_dim // 2:])


def rotary_ref(x, positions, cos, sin, num_heads, head_dim):
    """HF apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, in float64."""
    xh = x.astype(np.float64).reshape(len(x), num_heads, head_dim)
    c = np.concatenate([cos, cos], -1)[positions][:, None].astype(np.float64)
    s = np.concatenate([sin, sin], -1)[positions][:, None].astype(np.float64)
    rotated = np.concatenate([-xh[..., head_dim // 2:], xh[..., : head_dim // 2]], -1)
    return (xh * c + rotated * s).reshape(x.shape).astype(np.float32)


def packed_positions(chunks):
    """Positions of a packed step: for each (context, new) pair, positions context-new .. context-1."""
    return np.concatenate([np.arange(ctx - new, ctx) for ctx, new in chunks]).astype(np.int64)


@pytest.mark.parametrize("plugin", [False, True])
@pytest.mark.parametrize("num_heads,head_dim", [(1, 8), (3, 64), (9, 64), (4, 128)])
@pytest.mark.parametrize("chunks", [[(1, 1)], [(37, 37)], [(20, 20), (301, 1), (90, 16), (5, 1)]])
def test_rotary(plugin, num_heads, head_dim, chunks):
    rng = np.random.default_rng(5)
    cos, sin = rotary_tables(head_dim, ROPES["llama3"], 512)
    positions = packed_positions(chunks)
    x = rng.standard_normal((len(positions), num_heads * head_dim)).astype(np.float32)
    y = run_op(lambda g, x, p: rotary(g, x, p, g.weight("rope.cos", cos), g.weight("rope.sin", sin),
                                      num_heads=num_heads, head_dim=head_dim, name="/model/layers.0/attn/rotary_q",
                                      plugin=plugin), {"x": x, "positions": positions})
    assert_close(y, rotary_ref(x, positions, cos, sin, num_heads, head_dim))


def test_lowerings_agree_on_random_positions():
    rng = np.random.default_rng(6)
    cos, sin = rotary_tables(64, ROPES["default"], 2048)
    positions = rng.integers(0, 2048, 100).astype(np.int64)
    x = rng.standard_normal((100, 3 * 64)).astype(np.float32)
    a, b = (run_op(lambda g, x, p: rotary(g, x, p, g.weight("c", cos), g.weight("s", sin), num_heads=3, head_dim=64,
                                          name="/r", plugin=plugin), {"x": x, "positions": positions})
            for plugin in (False, True))
    assert_close(a, b)
    assert not np.allclose(a, x, atol=1e-3)   # positions really rotate


@pytest.mark.parametrize("plugin", [False, True])
def test_step_may_pack_more_tokens_than_the_tables_hold(plugin):
    """A step of many short sequences packs more tokens (max_num_tokens) than one sequence may hold (max_seq_len,
    the tables' length): positions stay below the tables, the packed count does not."""
    rng = np.random.default_rng(7)
    cos, sin = rotary_tables(64, ROPES["default"], 16)
    positions = packed_positions([(16, 16)] * 5)           # 80 tokens, tables of 16 positions
    x = rng.standard_normal((80, 2 * 64)).astype(np.float32)
    y = run_op(lambda g, x, p: rotary(g, x, p, g.weight("c", cos), g.weight("s", sin), num_heads=2, head_dim=64,
                                      name="/r", plugin=plugin), {"x": x, "positions": positions})
    assert_close(y, rotary_ref(x, positions, cos, sin, 2, 64))


def test_plugin_node_names():
    cos = np.zeros((4, 4), np.float32)
    names = node_names(lambda g, x, p: rotary(g, x, p, g.weight("c", cos), g.weight("s", cos), num_heads=2,
                                              head_dim=8, name="/r", plugin=True),
                       {"x": np.zeros((1, 16), np.float32), "p": np.zeros(1, np.int64)})
    assert names == ["/r/Unsqueeze", "/r/Unsqueeze_1", "/r/RotaryEmbedding", "/r/Squeeze"]


def test_table_errors():
    with pytest.raises(EngineError, match="odd"):
        rotary_tables(63, RopeConfig(), 8)
    with pytest.raises(EngineError, match="original_max_positions"):
        rotary_tables(64, RopeConfig(type="llama3", factor=8.0), 8)
