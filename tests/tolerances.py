"""Tolerances of engine outputs against references, per compute dtype: the one place they are kept.

`logits_atol` bounds the max absolute difference of logits against transformers (float32, eager attention)
and between two runs of the engine that must agree (paged vs full recompute, batched vs alone).
"""
from __future__ import annotations

import numpy as np

TOLERANCES = {
    "float32": {"logits_atol": 1e-3},
    # lm_head in bfloat16 (--lm-head-dtype bfloat16, its input rounded to bfloat16), between two engine runs that
    # differ in float32 summation order (tp=N vs tp=1): one input element rounded the other way moves a logit by
    # |w| * 2^-8 * |x| (tiny models: ~1e-3, measured 1.7e-3 at most)
    "bfloat16_lm_head": {"logits_atol": 5e-3},
    # int8_sq activations (one int8 scale per token), between two engine runs that differ in float32 summation order
    # (tp=N vs tp=1, the same scales): an activation that lands within a rounding error of a .5 boundary rounds to
    # the neighbouring int8 level in one of them, and the KV cache carries it on (tiny Gemma3's greedy decode at tp 2:
    # 4.3e-3). Usually nothing flips and they agree to 1e-7; tests/tp/test_calibrated_tp.py holds the batched prefill
    # to float32's 1e-3, which a scale per rank (each rank its slice's amax) misses on every tiny model (2.8e-3 to
    # 1.3e-2)
    "int8_activations": {"logits_atol": 1e-2},
}


def assert_logits_close(actual: np.ndarray, expected: np.ndarray, dtype: str = "float32", what: str = "") -> None:
    atol = TOLERANCES[dtype]["logits_atol"]
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.isfinite(actual).all(), f"{what}: non-finite logits"
    diff = float(np.abs(actual - expected).max())
    assert diff <= atol, f"{what}: max abs logit difference {diff:.3g} > {atol} ({dtype})"
