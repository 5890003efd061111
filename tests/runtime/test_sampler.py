"""The sampler against hand-computed masks and penalties, and seeded determinism."""
import numpy as np
import pytest

from engine.runtime.sampler import SamplingRow, apply_penalties, filter_probs, sample
from engine.runtime.sampling_params import SamplingParams


def row(params, prompt=(), output=(), seed=0, banned=()):
    return SamplingRow(params=params, prompt_token_ids=list(prompt), output_token_ids=list(output),
                       generator=np.random.default_rng(seed), banned_token_ids=list(banned))


PROBS = np.array([0.5, 0.3, 0.15, 0.05])


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = np.array([[0.1, 3.0, 3.0, -1.0], [5.0, 1.0, 2.0, 0.0]], dtype=np.float32)
    out = sample(logits, [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=0))])
    assert out.token_ids.tolist() == [1, 0]


def test_greedy_rows_of_a_mixed_batch_take_the_general_paths_token():
    """Plain greedy rows (argmax in one call over the float32 logits) beside rows that need the per-row path
    (banned ids, a penalty, logprobs, sampling): each gets what it would alone, ties and -inf included."""
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(6, 40)).astype(np.float32)
    logits[0, [3, 9]] = logits[0].max() + 1     # a tie: the lowest id wins
    logits[1, :] = -np.inf
    logits[1, 7] = -1e30
    rows = [row(SamplingParams(temperature=0)), row(SamplingParams(temperature=0)),
            row(SamplingParams(temperature=0), banned=[int(np.argmax(logits[2]))]),
            row(SamplingParams(temperature=0, repetition_penalty=3.0), prompt=[int(np.argmax(logits[3]))]),
            row(SamplingParams(temperature=0, logprobs=2)), row(SamplingParams(temperature=0.8, seed=3), seed=3)]
    batch = sample(logits, rows)
    alone = [sample(logits[b:b + 1], [r]) for b, r in enumerate(rows[:5])]
    assert batch.token_ids[:5].tolist() == [a.token_ids[0] for a in alone]
    assert batch.token_ids[:2].tolist() == [3, 7]
    assert batch.token_ids[2] != np.argmax(logits[2]) and batch.token_ids[3] != np.argmax(logits[3])
    assert batch.logprobs[:4] == [None] * 4 and batch.logprobs[4].token_id == batch.token_ids[4]


def test_temperature_scales_the_distribution():
    x = np.array([1.0, 2.0, 0.5, -1.0])
    got = filter_probs(x / 2.0, SamplingParams(temperature=2.0))
    want = np.exp(x / 2) / np.exp(x / 2).sum()
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_top_k_mask():
    x = np.array([1.0, 5.0, 3.0, 4.0, 2.0])
    got = filter_probs(x.copy(), SamplingParams(top_k=2))
    want = np.zeros(5)
    want[[1, 3]] = np.exp([5.0, 4.0]) / np.exp([5.0, 4.0]).sum()
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # ties at the k-th value are kept
    tied = filter_probs(np.array([1.0, 3.0, 3.0, 0.0]), SamplingParams(top_k=1))
    assert (tied > 0).tolist() == [False, True, True, False]


@pytest.mark.parametrize("top_p, kept", [(0.5, [0]), (0.7, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_mask(top_p, kept):
    got = filter_probs(np.log(PROBS), SamplingParams(top_p=top_p))
    mask = np.zeros(4, bool)
    mask[kept] = True
    assert ((got > 0) == mask).all()
    np.testing.assert_allclose(got.sum(), 1.0)
    np.testing.assert_allclose(got[mask], PROBS[mask] / PROBS[mask].sum(), rtol=1e-12)


@pytest.mark.parametrize("min_p, kept", [(0.35, [0, 1]), (0.3, [0, 1, 2]), (0.61, [0]), (0.0, [0, 1, 2, 3])])
def test_min_p_mask(min_p, kept):
    got = filter_probs(np.log(PROBS), SamplingParams(min_p=min_p))
    assert np.flatnonzero(got).tolist() == kept


def test_top_k_then_top_p_then_min_p_order():
    # top-k 3 keeps .5 .3 .15 -> renormalised .526 .316 .158; top-p .8 keeps the first two (mass before
    # the third is .842); min-p .65 then drops .316 (< .65 * .526).
    got = filter_probs(np.log(PROBS), SamplingParams(top_k=3, top_p=0.8, min_p=0.65))
    assert np.flatnonzero(got).tolist() == [0]
    got = filter_probs(np.log(PROBS), SamplingParams(top_k=3, top_p=0.8, min_p=0.5))
    assert np.flatnonzero(got).tolist() == [0, 1]


def test_repetition_penalty_over_prompt_and_output():
    x = np.array([2.0, -2.0, 1.0, 0.5])
    apply_penalties(x, row(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1]))
    np.testing.assert_allclose(x, [1.0, -4.0, 1.0, 0.5])
    # and it changes the greedy choice
    logits = np.array([[2.0, 1.5]], dtype=np.float32)
    assert sample(logits, [row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0])]).token_ids[0] == 1


def test_presence_and_frequency_penalties_over_generated_tokens_only():
    x = np.zeros(5)
    apply_penalties(x, row(SamplingParams(presence_penalty=0.25, frequency_penalty=0.5), prompt=[1, 1, 4],
                           output=[2, 2, 3]))
    np.testing.assert_allclose(x, [0.0, 0.0, -1.25, -0.75, 0.0])


def test_banned_tokens_never_drawn():
    logits = np.array([[10.0, 0.0, 0.0]], dtype=np.float32)
    assert sample(logits, [row(SamplingParams(temperature=0), banned=[0])]).token_ids[0] != 0
    for seed in range(20):
        assert sample(logits, [row(SamplingParams(), seed=seed, banned=[0])]).token_ids[0] != 0


def test_seeded_determinism_independent_of_batch():
    rng = np.random.default_rng(123)
    logits = rng.normal(size=(3, 50)).astype(np.float32)
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=7)

    def run(batch_rows, steps=20):
        toks = []
        for _ in range(steps):
            toks.append(sample(logits[:len(batch_rows)], batch_rows).token_ids[0])
        return toks

    alone = run([row(p, seed=7)])
    again = run([row(p, seed=7)])
    in_batch = run([row(p, seed=7), row(SamplingParams(), seed=1), row(SamplingParams(temperature=0))])
    assert alone == again == in_batch
    other = run([row(p, seed=8)])
    assert other != alone


def test_draws_follow_the_filtered_distribution():
    x = np.log(PROBS).astype(np.float32)[None]
    r = row(SamplingParams(top_k=3), seed=0)
    counts = np.bincount([sample(x, [r]).token_ids[0] for _ in range(4000)], minlength=4)
    want = np.array([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert counts[3] == 0
    np.testing.assert_allclose(counts / 4000, want, atol=0.03)


def test_logprobs_are_raw_log_softmax():
    x = np.array([[1.0, 2.0, 3.0, 0.0]], dtype=np.float32)
    out = sample(x, [row(SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.5), prompt=[2])])
    lp = x[0].astype(np.float64) - np.log(np.exp(x[0].astype(np.float64)).sum())
    got = out.logprobs[0]
    assert got.token_id == out.token_ids[0]
    np.testing.assert_allclose(got.logprob, lp[got.token_id])
    assert list(got.top) == [2, 1]
    np.testing.assert_allclose(list(got.top.values()), lp[[2, 1]])
    assert sample(x, [row(SamplingParams(temperature=0))]).logprobs == [None]
