"""Speculative decoding (runtime/speculative/) on the tiny Llama engine: greedy output identical to decoding one
token a step, the rejection sampler's distribution checked statistically, and the runtime's invariants kept
(no leaked blocks, a prefix cache of committed tokens only, preemption, limits, stop strings, logprobs)."""
import numpy as np
import pytest
from scipy import stats

from engine.core.errors import EngineError
from engine.runtime import LLM, SamplingParams
from engine.runtime.sampler import SamplingRow
from engine.runtime.speculative import SpeculativeConfig, verify
from engine.runtime.speculative.ngram import propose

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "max_batch_size": 8,
         "verify_cost": 0}   # every step of the tiny engine's batch speculates, whatever the acceptance


def prompts(n=6, seed=0):
    """Prompts that repeat themselves, so the lookup finds matches (and greedy tiny models loop)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        motif = rng.integers(3, 500, size=3 + i).tolist()
        out.append((motif * 4)[:8 + 3 * i] + rng.integers(3, 500, size=2).tolist())
    return out


@pytest.fixture(scope="module")
def plain(tiny_engine):
    llm = LLM(tiny_engine[1], max_kv_tokens=8 * 64)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def spec(tiny_engine):
    llm = LLM(tiny_engine[1], max_kv_tokens=8 * 64, speculative_config=NGRAM)
    yield llm
    llm.close()


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    assert propose([1, 2, 3, 4, 5, 9, 2, 3], k=3, n_min=1, n_max=3) == [4, 5, 9]
    assert propose([1, 2, 3, 7, 2, 3, 8, 2, 3], k=2, n_min=2, n_max=2) == [8, 2]   # the latest of two matches
    assert propose([5, 6, 7, 5, 6, 7], k=4, n_min=1, n_max=4) == [5, 6, 7]         # the longest suffix first
    assert propose([1, 2, 3, 4], k=3, n_min=1, n_max=3) == []                      # nothing repeats
    assert propose([4], k=3, n_min=1, n_max=3) == []


def test_greedy_output_is_identical_and_drafts_were_accepted(plain, spec):
    ps = prompts()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = plain.generate(ps, params)
    got = spec.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    st = spec.core.speculator.stats
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens, st
    assert spec.core.stats.num_steps < plain.core.stats.num_steps   # several tokens a step
    spec.check_all_free()


def test_single_requests_batches_and_max_tokens(plain, spec):
    for p in prompts(4, seed=1):
        for n in (1, 2, 5, 17):   # max_tokens caps the drafts: exactly n tokens, never more
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            got = spec.generate([p], params)[0]
            assert got.token_ids == plain.generate([p], params)[0].token_ids and len(got.token_ids) == n
    spec.check_all_free()


def test_logprobs_and_stop_strings_are_those_of_plain_decoding(plain, spec):
    p = prompts(1, seed=2)[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    want, got = plain.generate([p], params)[0], spec.generate([p], params)[0]
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.token_id == b.token_id and list(a.top) == list(b.top)
        np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-4)
    stop = want.text[len(want.text) // 2:][:3]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    want, got = plain.generate([p], params)[0], spec.generate([p], params)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert want.finish_reason == "stop"
    spec.check_all_free()


def test_penalties_and_min_tokens_apply_at_each_verified_position(plain, spec):
    for p in prompts(3, seed=9):
        params = SamplingParams(temperature=0, max_tokens=30, min_tokens=12, repetition_penalty=1.2,
                                frequency_penalty=0.3)
        assert spec.generate([p], params)[0].token_ids == plain.generate([p], params)[0].token_ids


def test_prefix_cache_holds_committed_tokens_only(plain, spec):
    """A second request whose prompt is the first one's prompt and output reuses its blocks: the cached K/V must be
    those of the tokens accepted, never of rejected drafts."""
    p = prompts(1, seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = spec.generate([p], params)[0]
    longer = p + first.token_ids
    hits = spec.stats().prefix_cache_hits
    got = spec.generate([longer], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert spec.stats().prefix_cache_hits > hits
    assert got.token_ids == plain.generate([longer], SamplingParams(temperature=0, max_tokens=8,
                                                                    ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preemption_on_a_tiny_pool_gives_the_same_tokens(plain, tiny_engine, policy):
    ps = prompts(6, seed=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(ps, params)]
    small = LLM(tiny_engine[1], max_kv_tokens=64, speculative_config=NGRAM, scheduling_policy=policy)
    got = small.generate(ps, params, priority=[0, 2, 1, 0, 2, 1] if policy == "priority" else 0)
    assert small.core.stats.num_preempted > 0 and small.core.speculator.stats.num_drafts > 0
    assert [o.token_ids for o in got] == want
    small.check_all_free()
    small.close()


def test_seeded_sampling_with_speculation_is_reproducible(spec):
    ps = prompts(3, seed=5)
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    a = [o.token_ids for o in spec.generate(ps, params)]
    b = [o.token_ids for o in spec.generate(ps, params)]
    assert a == b


def test_rejection_sampling_keeps_the_target_distribution():
    """Two positions of fixed target logits and one-hot drafts: the first emitted token is distributed as p0
    whatever the draft, and the second (emitted only after the draft was accepted) as p1."""
    rng = np.random.default_rng(0)
    vocab = 6
    logits = rng.normal(0, 1.5, (2, vocab)).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=5, max_tokens=8)
    p = [np.exp(x / 0.9 - np.max(x / 0.9)) for x in logits.astype(np.float64)]
    for q in p:   # top_k 5: the least likely token is out
        q[np.argmin(q)] = 0
        q /= q.sum()
    gen = np.random.default_rng(1)
    row = SamplingRow(params=params, prompt_token_ids=[1], output_token_ids=[], generator=gen)
    for draft in (int(np.argmax(p[0])), int(np.argsort(p[0])[2])):
        first, second = np.zeros(vocab), np.zeros(vocab)
        for _ in range(20000):
            v = verify(logits, [draft], row, lambda n: [])
            first[v.token_ids[0]] += 1
            if len(v.token_ids) == 2:
                assert v.token_ids[0] == draft
                second[v.token_ids[1]] += 1
        for counts, probs in ((first, p[0]), (second, p[1])):
            keep = probs > 0
            assert counts[~keep].sum() == 0
            assert stats.chisquare(counts[keep], probs[keep] * counts.sum()).pvalue > 1e-3, (draft, counts, probs)


def test_greedy_verification_accepts_the_agreeing_prefix():
    logits = np.full((4, 8), -1.0, dtype=np.float32)
    for i, t in enumerate((3, 5, 1, 6)):
        logits[i, t] = 2.0
    row = SamplingRow(params=SamplingParams(temperature=0), prompt_token_ids=[0], output_token_ids=[],
                      generator=np.random.default_rng(0))
    assert verify(logits, [3, 5, 1], row, lambda n: []).token_ids == [3, 5, 1, 6]   # all accepted, one more
    assert verify(logits, [3, 4, 1], row, lambda n: []).token_ids == [3, 5]         # the target's token at a miss
    assert verify(logits, [2, 5, 1], row, lambda n: []).token_ids == [3]


def test_bad_configs_are_refused_naming_the_value(tiny_engine):
    with pytest.raises(EngineError, match="--speculative 'medusa'"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(EngineError, match="--num-speculative-tokens 0"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(EngineError, match="--prompt-lookup-min 5"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
    with pytest.raises(EngineError, match="needs --draft-engine-dir"):
        SpeculativeConfig(method="draft")
    with pytest.raises(EngineError, match=r"unknown keys \['lookahead'\]"):
        LLM(tiny_engine[1], max_kv_tokens=64, speculative_config={"method": "ngram", "lookahead": 3})


@pytest.fixture(scope="module")
def other_engine(tmp_path_factory):
    """The tiny Llama with int4 weights: a draft that mostly agrees with the float32 target, not always."""
    from tests.runtime.tiny_engine import build_tiny_engine
    return build_tiny_engine(tmp_path_factory.mktemp("draft_engine"), quant="int4_wo")[1]


@pytest.mark.parametrize("draft", ["itself", "other"])
def test_a_draft_engine_gives_the_same_greedy_output(plain, tiny_engine, other_engine, draft):
    draft_dir = tiny_engine[1] if draft == "itself" else other_engine
    llm = LLM(tiny_engine[1], max_kv_tokens=8 * 64, speculative_config={
        "method": "draft", "draft_engine_dir": draft_dir, "num_speculative_tokens": 3, "max_batch_size": 8,
        "verify_cost": 0})
    ps = prompts(6, seed=6) + [np.random.default_rng(7).integers(3, 500, size=45).tolist()]  # 45: a chunked prefill
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    got = llm.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(ps, params)]
    st = llm.core.speculator.stats
    rate = st.num_accepted_tokens / st.num_draft_tokens
    # the same model proposes what the target decodes; int4 weights sometimes propose another token
    assert rate > 0.9 if draft == "itself" else 0 < rate < 0.9, st
    again = llm.generate(ps[:2], params)   # the draft's pool caught up from what it held, or was evicted
    assert [o.token_ids for o in again] == [o.token_ids for o in got[:2]]
    llm.check_all_free()
    llm.close()


def test_a_draft_stops_proposing_where_it_is_unsure(plain, tiny_engine, other_engine):
    ps = prompts(4, seed=10)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    counts = []
    for confidence in (0.0, 0.0033):   # the tiny random model is nearly flat: its top probabilities are 0.003-0.004
        llm = LLM(tiny_engine[1], max_kv_tokens=8 * 64, speculative_config={
            "method": "draft", "draft_engine_dir": other_engine, "num_speculative_tokens": 4, "max_batch_size": 8,
            "verify_cost": 0, "draft_min_confidence": confidence})
        assert [o.token_ids for o in llm.generate(ps, params)] == \
            [o.token_ids for o in plain.generate(ps, params)]
        counts.append(llm.core.speculator.stats.num_draft_tokens)
        llm.close()
    assert counts[1] < counts[0], counts


def test_a_draft_with_another_vocabulary_is_refused_naming_both(tiny_engine, tmp_path):
    import json
    import shutil
    draft = tmp_path / "draft"
    shutil.copytree(tiny_engine[1], draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    name = next(iter(vocab))
    vocab[name + "_renamed"] = vocab.pop(name)
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(EngineError, match=f"the draft engine {draft} has a vocabulary of .* and the target engine"):
        LLM(tiny_engine[1], max_kv_tokens=64, speculative_config={"method": "draft", "draft_engine_dir": draft})


def test_a_sequence_checkpointed_mid_speculation_resumes_to_the_same_tokens(plain, tiny_engine):
    """A request captured between speculative steps (drafts are per step, never in the state) and resumed by another
    speculating engine gives plain decoding's greedy tokens."""
    import asyncio
    import json
    from engine.runtime.sequence_state import SequenceState
    p = prompts(1, seed=8)[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = plain.generate([p], params)[0].token_ids
    first = LLM(tiny_engine[1], max_kv_tokens=512, speculative_config=NGRAM)
    seq, _ = first.make_sequence(p, params, request_id="r")
    first.core.add_request(seq)
    while seq.num_output_tokens < 10:
        first.core.step()
    (state,) = first.core.snapshot()
    first.close()
    state = SequenceState.from_json(json.loads(json.dumps(state.to_json())))
    second = LLM(tiny_engine[1], max_kv_tokens=512, speculative_config=NGRAM)

    async def run():
        return [out async for out in second.resume_async(state)]
    try:
        assert asyncio.run(run())[-1].token_ids == want
        assert second.core.speculator.stats.num_drafts > 0
    finally:
        second.close()


def test_sequences_propose_while_their_acceptance_pays_for_the_batch():
    """With k = 4 and verify_cost 0.2 a step of B decodes costs 1 + 0.8 B plain steps: a sequence accepting 60% of
    its drafts (1.6 + ... = 2.3 tokens a step) pays alone (1.8) but not beside another one (2.6), and then pauses."""
    from engine.runtime.sequence import Sequence
    from engine.runtime.speculative import Speculator
    from engine.runtime.speculative.speculator import expected_tokens

    class Always:
        def propose(self, seqs, ks):
            return [[7] * k for k in ks]

        def forget(self, request_id):
            pass
    assert expected_tokens(1.0, 4) == 5 and abs(expected_tokens(0.6, 4) - 2.3056) < 1e-3
    spec = Speculator(SpeculativeConfig(method="ngram", pause_steps=3), Always(), max_seq_len=1000)

    def decoding(rid):
        s = Sequence(rid, [1, 2, 3], SamplingParams(max_tokens=100), max_tokens=100)
        s.num_computed_tokens = s.num_tokens - 1
        return s
    a, b = decoding("a"), decoding("b")
    for _ in range(4):
        spec.record("a", 4, 2)   # a rate settling at 0.5 a draft: 1.94 tokens a step
    spec.propose([a])
    assert a.draft_token_ids == [7] * 4                 # alone: 1.94 >= 1.8
    a.draft_token_ids = []
    spec.propose([a, b])
    assert a.draft_token_ids == [] and b.draft_token_ids == [7] * 4   # a beside b: 1.94 < 2.6; b is new (rate 1)
    b.draft_token_ids = []
    for _ in range(3):
        spec.propose([a])
        assert a.draft_token_ids == []                  # paused for 3 steps, then tries afresh
    spec.propose([a])
    assert a.draft_token_ids == [7] * 4
