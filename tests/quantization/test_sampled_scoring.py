"""The accuracy report's reference perplexity measured while sampling the held-out text (runtime/perplexity.py
sample_scored, sample_rows): it must equal a separate scoring pass over the same text, and inverse-CDF sampling
must draw each token with its softmax probability."""
from __future__ import annotations

import numpy as np
import pytest

from engine.runtime.perplexity import perplexity, sample_rows, sample_scored, sample_tokens

LLAMA = "LlamaForCausalLM"
TIED = "LlamaForCausalLM:llama3-rope-tied"


@pytest.mark.parametrize("key", [LLAMA, TIED])
def test_perplexity_while_sampling_equals_a_scoring_pass(tiny, key):
    engine = tiny.engine(key)
    windows, during = sample_scored(engine, sequences=5, length=40, seed=3, start_token=1)
    scored = perplexity(engine, windows)     # prefill of each whole window (ScoringSession), not decode steps
    assert (during.tokens, during.windows) == (scored.tokens, scored.windows) == (5 * 39, 5)
    assert during.nll == pytest.approx(scored.nll, rel=1e-5)
    assert windows == sample_tokens(engine, sequences=5, length=40, seed=3, start_token=1)


def test_inverse_cdf_picks_by_cumulative_mass():
    # row 0: probabilities 0.25, 0, 0.75 (the middle token has no mass); row 1: uniform over 4
    logits = np.array([[np.log(0.25), -1e30, np.log(0.75), -1e30], [0.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    for u0, u1, expected in [(0.0, 0.0, [0, 0]), (0.2499, 0.2499, [0, 0]), (0.2501, 0.2501, [2, 1]),
                             (0.9999, 0.74, [2, 2]), (0.5, 0.99, [2, 3])]:
        tokens, logp = sample_rows(logits, np.array([u0, u1]))
        assert tokens.tolist() == expected, (u0, u1)
        np.testing.assert_allclose(np.exp(logp), [[0.25, 0, 0.75, 0][expected[0]], 0.25], rtol=1e-6)


def test_sampled_frequencies_follow_the_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 50)).astype(np.float32) * 2
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()
    n = 200_000
    tokens, logp = sample_rows(np.repeat(logits, n, axis=0), rng.random(n))
    freq = np.bincount(tokens, minlength=50) / n
    assert np.abs(freq - p).max() < 5 * np.sqrt(p.max() / n)   # 5 sigma of the largest cell
    np.testing.assert_allclose(np.exp(logp), p[tokens], rtol=1e-6)
