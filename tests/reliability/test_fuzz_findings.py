"""What the schema fuzzer (test_fuzz.py) found, pinned as plain tests.

1. Sampling parameters at the edge of float64: a temperature or repetition_penalty near 0 (OpenAI's schema allows
   any positive number; the fuzzer sent 5e-324) overflowed the logits to +inf, the softmax turned them into NaN,
   and the inverse-CDF draw returned the LAST vocabulary token, whatever the logits said. The request was answered
   200 with nonsense. Now a vanishing temperature is the argmax (its limit), and penalised logits past the float64
   range are clamped, so the draw stays among the tokens the penalty favours.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.runtime.sampler import SamplingRow, sample
from engine.runtime.sampling_params import SamplingParams

LOGITS = np.array([[1.0, 3.0, 2.0, -1.0, 0.5]], dtype=np.float32)


def _draw(seed: int, **params) -> int:
    row = SamplingRow(params=SamplingParams(max_tokens=4, seed=seed, **params), prompt_token_ids=[0, 2],
                      output_token_ids=[], generator=np.random.default_rng(seed))
    with np.errstate(invalid="raise"):  # no NaN arises in the sampler
        return int(sample(LOGITS, [row]).token_ids[0])


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300, 1e-30])
def test_vanishing_temperature_is_the_argmax(temperature):
    assert {_draw(seed, temperature=temperature) for seed in range(20)} == {1}


@pytest.mark.parametrize("penalty", [5e-324, 1e-305])
def test_extreme_repetition_penalty_favours_the_repeated_tokens(penalty):
    """Prompt tokens 0 and 2 have positive logits; dividing by a vanishing penalty makes them dominate."""
    draws = {_draw(seed, temperature=1.0, repetition_penalty=penalty) for seed in range(40)}
    assert draws <= {0, 2} and 2 in draws


def test_huge_repetition_penalty_never_draws_a_repeated_token():
    draws = {_draw(seed, temperature=1e-3, repetition_penalty=1e300) for seed in range(20)}
    assert draws == {1}
