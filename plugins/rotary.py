"""Rotary position embedding (RoPE) on packed tokens, Hugging Face's non-interleaved (rotate_half) convention.

    x [T, heads*hd] viewed as [T, heads, hd] = [x1 | x2] (halves of hd);  c, s = cos[pos], sin[pos]  [T, hd/2]
    y = [x1*c - x2*s | x2*c + x1*s]

`rotary_tables` builds the cos/sin tables once per model (the caller stores them as initializers shared by all
layers); `rotary` applies them. Positions index the tables, so a packed batch may mix sequences freely.
Lowerings: `plugin=False` spells the formula in standard ops; `plugin=True` is one standard opset-23
RotaryEmbedding node on the [T, 1, heads*hd] view with position_ids [T, 1] (3-5x the reference; ORT's contrib
com.microsoft RotaryEmbedding measured the same, so the standard op wins: bench/plugin_lowerings.py).
"""
from __future__ import annotations

import math

import numpy as np

from engine.core.errors import EngineError
from engine.core.model_config import RopeConfig

from .graph import Graph


def inv_frequencies(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """inv_freq [head_dim/2] exactly as transformers' ROPE_INIT_FUNCTIONS compute it.

    The arithmetic is float32 in torch's order on purpose: transformers computes in float32, and at position p an
    inv_freq one ulp away shifts the angle by ~p * 6e-8 rad (1e-4 at p = 2048), which parity tests would see.
    torch divides a scalar by a tensor as the tensor's reciprocal times the scalar (`under`)."""
    f32 = np.float32

    def under(scalar: float, a: np.ndarray) -> np.ndarray:
        return (f32(1) / a) * f32(scalar)

    exponent = np.arange(0, head_dim, 2).astype(f32) / f32(head_dim)
    # theta ** exponent rounded once from float64: torch's float32 pow is correctly rounded here, NumPy's is not on
    # AVX-512 (SVML, 1 ulp off for some exponents)
    inv = f32(1.0) / (np.float64(f32(rope.theta)) ** exponent.astype(np.float64)).astype(f32)
    if rope.type == "linear":
        inv = inv / f32(rope.factor)
    elif rope.type == "llama3":
        if not rope.original_max_positions:
            raise EngineError("llama3 rope scaling needs original_max_positions (original_max_position_embeddings "
                              "in the HF config): re-run `engine convert` with a complete config.json")
        if rope.high_freq_factor == rope.low_freq_factor:
            raise EngineError(f"llama3 rope scaling needs high_freq_factor != low_freq_factor, got "
                              f"{rope.high_freq_factor} for both: fix rope_scaling in config.json")
        old_len = rope.original_max_positions
        low_wavelen, high_wavelen = old_len / rope.low_freq_factor, old_len / rope.high_freq_factor
        wavelen = under(2 * math.pi, inv)
        scaled = np.where(wavelen > low_wavelen, inv / f32(rope.factor), inv)
        smooth = ((under(old_len, wavelen) - f32(rope.low_freq_factor))
                  / f32(rope.high_freq_factor - rope.low_freq_factor))
        smoothed = (f32(1) - smooth) * scaled / f32(rope.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(f32)


def rotary_tables(head_dim: int, rope: RopeConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_positions, head_dim // 2] float32 (transformers' semantics; attention scaling is 1 for the
    supported rope types)."""
    if head_dim % 2:
        raise EngineError(f"head_dim {head_dim} is odd; rotary embedding needs an even head_dim")
    # The angle is rounded to float32 as transformers does (position * inv_freq in float32); cos/sin of that
    # angle are then evaluated in float64 and rounded once.
    angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_frequencies(head_dim, rope)[None, :]
    angles = angles.astype(np.float64)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotary(g: Graph, x: str, positions: str, cos: str, sin: str, *, num_heads: int, head_dim: int, name: str,
           plugin: bool) -> str:
    """x [T, num_heads*head_dim], positions [T] int64 -> rotated x, same shape."""
    op = g.scope(name)
    if plugin:
        # T batches of one token: [T, 1, hidden] with position_ids [T, 1]; Unsqueeze/Squeeze are zero-copy views.
        # Not one batch [1, T, hidden]: ORT refuses a sequence longer than the cos/sin tables ("Updating cos_cache
        # ... not supported"), and a step may pack more tokens (max_num_tokens) than a sequence holds.
        axis1 = g.const([1])
        y = op("RotaryEmbedding", [op("Unsqueeze", [x, axis1]), cos, sin, op("Unsqueeze", [positions, axis1])],
               num_heads=num_heads, interleaved=0)
        return op("Squeeze", [y, axis1])
    half = head_dim // 2
    heads = op("Reshape", [x, g.const([0, num_heads, head_dim])])               # [T, heads, hd]
    x1, x2 = op("Split", [heads, g.const([half, half])], outputs=2, axis=-1)    # [T, heads, hd/2] each
    axis1 = g.const([1])
    c = op("Unsqueeze", [op("Gather", [cos, positions], axis=0), axis1])        # [T, 1, hd/2]
    s = op("Unsqueeze", [op("Gather", [sin, positions], axis=0), axis1])
    y1 = op("Sub", [op("Mul", [x1, c]), op("Mul", [x2, s])])
    y2 = op("Add", [op("Mul", [x2, c]), op("Mul", [x1, s])])
    return op("Reshape", [op("Concat", [y1, y2], axis=-1), g.const([0, -1])])
