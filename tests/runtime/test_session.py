"""EngineSession invariances: paged decode == full recompute, a batch == each sequence alone, scattered blocks ==
contiguous blocks, chunked prefill == one-shot prefill; the pool is updated in place; bad steps are refused."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from engine.core.engine_format import engine_file, kcache_name, kcache_out_name
from engine.core.errors import EngineError
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk, make_step_inputs
from tests.builder.engines import TinyEngines, prompts
from tests.tolerances import assert_logits_close

# A plain model and one with sliding layers, soft-caps and (1 + w) norms; the window is 8 tokens.
KEYS = ["LlamaForCausalLM", "Gemma2ForCausalLM"]
TPB = 4  # tokens_per_block of the test engines


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyEngines:
    return TinyEngines(tmp_path_factory.mktemp("session_engines"))


def blocks_for(tokens: int, first: int = 0) -> list[int]:
    return list(range(first, first + -(-tokens // TPB)))


@pytest.mark.parametrize("key", KEYS)
def test_paged_decode_equals_full_recompute(tiny, key):
    session = EngineSession(tiny.engine(key), num_blocks=64)
    ids = prompts(1, (11,), seed=2)[0]
    table = blocks_for(11 + 12)
    step_logits = [session.run([SeqChunk(ids, 0, table, True)])[0]]
    seq = list(ids)
    for _ in range(12):
        seq.append(int(step_logits[-1].argmax()))
        step_logits.append(session.run([SeqChunk([seq[-1]], len(seq) - 1, table, True)])[0])
    # The same sequences computed from scratch each time, in blocks the decode never touched.
    for n, logits in zip(range(len(ids), len(seq) + 1), step_logits):
        full = session.run([SeqChunk(seq[:n], 0, blocks_for(n, first=32), True)])[0]
        assert_logits_close(logits, full, what=f"{key} decode at length {n}")


@pytest.mark.parametrize("key", KEYS)
def test_batch_equals_each_alone(tiny, key):
    session = EngineSession(tiny.engine(key), num_blocks=64)
    a, b, c, d = prompts(4, (3, 17, 9, 25), seed=3)
    # b and d already have a prefix in the pool; the batch mixes prefills, a decode and a chunk.
    session.run([SeqChunk(b[:16], 0, blocks_for(17, 10), False)])
    session.run([SeqChunk(d[:20], 0, blocks_for(25, 30), False)])
    chunks = [SeqChunk(a, 0, blocks_for(3, 0), True), SeqChunk(b[16:], 16, blocks_for(17, 10), True),
              SeqChunk(c, 0, blocks_for(9, 20), False), SeqChunk(d[20:], 20, blocks_for(25, 30), True)]
    together = session.run(chunks)
    assert together.shape == (3, session.config.model.vocab_size)
    alone = [session.run([ch])[0] for ch in chunks if ch.num_logits]
    for i, (x, y) in enumerate(zip(together, alone)):
        assert_logits_close(x, y, what=f"{key} sequence {i} in a batch vs alone")


@pytest.mark.parametrize("key", KEYS)
def test_long_chunk_cut_into_rows_equals_each_alone(tiny, key):
    """Six decodes beside a 40-token prefill: the step cuts the prefill into short attention rows (so decodes are
    not padded to 40 queries); logits, and the K/V the chunk leaves for its next decode, match each alone."""
    session = EngineSession(tiny.engine(key), num_blocks=128)
    seqs = prompts(7, (12,) * 6 + (40,), seed=5)
    tables = [blocks_for(48, 12 * i) for i in range(7)]
    for s, t in zip(seqs[:6], tables):
        session.run([SeqChunk(s[:11], 0, t, False)])
    chunks = [SeqChunk(s[11:], 11, t, True) for s, t in zip(seqs[:6], tables)]
    chunks.append(SeqChunk(seqs[6], 0, tables[6], True))
    assert make_step_inputs(chunks, TPB, None)["q_index"].shape[1] < 40
    together = session.run(chunks)
    next_together = session.run([SeqChunk([7], 40, tables[6], True)])[0]
    alone = [session.run([c])[0] for c in chunks[:6]]   # rewrites the same K/V into the same slots
    alone.append(session.run([SeqChunk(seqs[6], 0, blocks_for(48, 100), True)])[0])
    next_alone = session.run([SeqChunk([7], 40, blocks_for(48, 100), True)])[0]
    for i, (x, y) in enumerate(zip(together, alone)):
        assert_logits_close(x, y, what=f"{key} sequence {i} beside a long chunk vs alone")
    assert_logits_close(next_together, next_alone, what=f"{key} decode after a chunk cut into rows")


@pytest.mark.parametrize("key", KEYS)
def test_scattered_blocks_equal_contiguous(tiny, key):
    session = EngineSession(tiny.engine(key), num_blocks=64)
    ids = prompts(1, (21,), seed=4)[0]
    contiguous = session.run([SeqChunk(ids, 0, blocks_for(22), True)])
    scattered_table = [57, 3, 40, 12, 33, 8]        # non-contiguous, out of order
    scattered = session.run([SeqChunk(ids, 0, scattered_table, True)])
    assert_logits_close(scattered, contiguous, what="scattered vs contiguous blocks")
    nxt = int(scattered[0].argmax())
    assert_logits_close(session.run([SeqChunk([nxt], 21, scattered_table, True)]),
                        session.run([SeqChunk(ids + [nxt], 0, blocks_for(22, 20), True)]),
                        what="decode over scattered blocks")


@pytest.mark.parametrize("key", KEYS)
def test_chunked_prefill_equals_one_shot(tiny, key):
    session = EngineSession(tiny.engine(key), num_blocks=64)
    ids = prompts(1, (30,), seed=5)[0]
    one_shot = session.run([SeqChunk(ids, 0, blocks_for(30), True)])
    table = blocks_for(30, 20)
    for start, end in ((0, 7), (7, 19)):
        assert session.run([SeqChunk(ids[start:end], start, table, False)]).shape == (0, 512)
    chunked = session.run([SeqChunk(ids[19:], 19, table, True)])
    assert_logits_close(chunked, one_shot, what=f"{key} chunked vs one-shot prefill")


def test_pool_is_updated_in_place(tiny):
    engine_dir = tiny.engine("LlamaForCausalLM")
    session = EngineSession(engine_dir, num_blocks=16)
    k0 = session.kv_pool[0][0]
    session.run([SeqChunk([5, 6, 7, 8, 9], 0, [3, 9], False)])
    written = np.flatnonzero(np.abs(k0).sum(axis=1))
    assert written.tolist() == [12, 13, 14, 15, 36]   # block 3: slots 12-15, block 9: slot 36
    # The node that writes the pool (the engine's RotaryPagedAttention, QuantRotaryPagedAttention where it takes the
    # q|k|v projection in too; ScatterND without the engine's kernels) produces the bound output itself: an Identity
    # (or any node) between them makes ORT copy the whole pool on every step.
    graph = onnx.load(str(engine_dir / engine_file(0)), load_external_data=False).graph
    producer = {out: node for node in graph.node for out in node.output}[kcache_out_name(0)]
    assert producer.op_type in ("RotaryPagedAttention", "QuantRotaryPagedAttention")
    assert producer.input[4] == kcache_name(0)


def test_sliding_mask_limits_keys_to_window():
    inputs = make_step_inputs([SeqChunk(list(range(10)), 0, [0, 1, 2], True)], TPB, sliding_window=3)
    full, sliding = inputs["attn_mask"][0, 0], inputs["attn_mask_sliding"][0, 0]
    assert full[9].tolist() == [True] * 10
    assert sliding[9].tolist() == [False] * 7 + [True] * 3
    assert sliding[1].tolist() == [True, True] + [False] * 8


def test_bad_steps_are_refused(tiny):
    session = EngineSession(tiny.engine("LlamaForCausalLM"), num_blocks=8)
    with pytest.raises(EngineError, match="needs 3 blocks"):
        session.run([SeqChunk(list(range(3, 12)), 0, [0, 1], True)])
    with pytest.raises(EngineError, match="outside the pool of 8 blocks"):
        session.run([SeqChunk([5, 6], 0, [8], True)])
    with pytest.raises(EngineError, match="token id 512 is outside the vocabulary"):
        session.run([SeqChunk([5, 512], 0, [0], True)])
    with pytest.raises(EngineError, match="max_num_tokens 256"):
        session.run([SeqChunk([5] * 257, 0, list(range(8)) * 9, True)])
    with pytest.raises(EngineError, match="max_batch_size 8"):
        session.run([SeqChunk([5], 0, [0], True)] * 9)


def test_tensor_parallel_engine_is_refused(tiny):
    with pytest.raises(EngineError, match="tp=2 engine: it runs with one process per rank"):
        EngineSession(tiny.engine("LlamaForCausalLM", tp_size=2), num_blocks=8)
