"""runtime/step_inputs.py: a step of decodes takes a shorter path (_decode_inputs) that must give the general packing's
inputs exactly, for any batch, block layout, logits choice and sliding window."""
import numpy as np
import pytest

from engine.runtime.step_inputs import SeqChunk, _packed_inputs, make_step_inputs


def _decodes(rng, batch: int, tokens_per_block: int) -> list[SeqChunk]:
    chunks = []
    for _ in range(batch):
        start = int(rng.integers(0, 70))
        blocks = rng.permutation(96)[: start // tokens_per_block + 1 + int(rng.integers(0, 3))]  # spare blocks too
        chunks.append(SeqChunk([int(rng.integers(0, 1000))], start, blocks.tolist(), bool(rng.integers(0, 2))))
    return chunks


@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_decode_step_equals_the_general_packing(batch, sliding_window):
    rng = np.random.default_rng(batch)
    for tokens_per_block in (1, 4, 16):
        for _ in range(5):
            chunks = _decodes(rng, batch, tokens_per_block)
            fast = make_step_inputs(chunks, tokens_per_block, sliding_window)
            q_len = np.ones(batch, dtype=np.int64)
            start = np.array([c.start_pos for c in chunks], dtype=np.int64)
            need = start // tokens_per_block + 1
            tables = np.zeros((batch, int(need.max())), dtype=np.int64)
            for b, c in enumerate(chunks):
                tables[b, :need[b]] = c.block_table[:need[b]]
            general = _packed_inputs(chunks, q_len, start, tables, tokens_per_block, sliding_window, None)
            assert fast.keys() == general.keys()
            for name, want in general.items():
                got = fast[name]
                assert got.dtype == want.dtype and got.shape == want.shape, name
                np.testing.assert_array_equal(got, want, err_msg=name)


def test_a_step_with_one_longer_chunk_takes_the_general_packing():
    """One chunk of two tokens beside decodes: rows of Qmax 2, not the decode path's Qmax 1."""
    chunks = [SeqChunk([1], 5, [0], True), SeqChunk([2, 3], 0, [1], True)]
    inputs = make_step_inputs(chunks, 16, None)
    assert inputs["q_index"].shape == (2, 2) and inputs["attn_mask"].shape == (2, 1, 2, 6)


def test_a_verification_chunk_is_rows_of_one_token_each_with_its_logits():
    """A decode verifying two speculated tokens (num_logits 3) beside a prefill chunk: its three tokens are three
    rows of one query (the attention kernel's decode path), each seeing its own prefix, and all three give logits."""
    chunks = [SeqChunk([7, 8, 9, 10, 11], 0, [2], True), SeqChunk([1, 2, 3], 5, [0], 3)]
    inputs = make_step_inputs(chunks, 16, None)
    q_index, mask = inputs["q_index"], inputs["attn_mask"][:, 0]
    assert q_index.shape == (4, 5)   # the prefill's row of 5, then three rows of the verification
    np.testing.assert_array_equal(q_index[1:, 0], [5, 6, 7])
    np.testing.assert_array_equal(mask[1:, 0].sum(axis=1), [6, 7, 8])   # positions 5, 6, 7 see keys 0 .. p
    assert not mask[1:, 1:, 1:].any()   # padded query rows see key 0 only
    np.testing.assert_array_equal(inputs["logits_indices"], [4, 5, 6, 7])
    with pytest.raises(Exception, match="wants logits of 4 tokens; it has 3"):
        make_step_inputs([SeqChunk([1, 2, 3], 5, [0], 4)], 16, None)
